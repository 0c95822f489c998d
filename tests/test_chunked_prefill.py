"""Packed and chunked prefill on the CPU (tiny preset, float32): packed logits equal each prompt
prefilled alone; a prompt cut into chunks of 1, 7, 16, 17 or the budget gives the same first
logits, the same cache and the same tokens; decoding goes on while a long prompt prefills; a
fault mid-way through a chunked prefill frees every page; bad budgets are refused."""

from __future__ import annotations

import pytest
import torch

from stepgraph.engine import Engine
from stepgraph.errors import ConfigError, ReplayError
from stepgraph.model import ModelRunner
from stepgraph.model.prefill.extend_batch import PrefillChunk
from stepgraph.runner import RunnerConfig

from .conftest import rel_err
from .guards import time_limit

VOCAB = 512
CHUNKS = [1, 7, 16, 17, 8192]  # 8192: the default budget, no cut


def _runner(seed: int = 2, **kw) -> ModelRunner:
    kw = dict(max_bs=4, max_context_len=96) | kw
    return ModelRunner.from_preset("tiny", "cpu", torch.float32, seed=seed, **kw)


def _prompts(seed: int, lens) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in lens]


def _poison(mr: ModelRunner) -> None:
    for c in (*mr.kv_cache.k_caches, *mr.kv_cache.v_caches):
        c.fill_(float("nan"))


def test_packed_prefill_equals_each_prompt_alone():
    mr = _runner()
    _poison(mr)  # a slot the prefill reads but never wrote shows as NaN
    prompts = _prompts(1, [13, 1, 40, 16])
    pages = [mr.kv_cache.reserve(len(p)) for p in prompts]
    packed = mr.prefill(prompts, pages).clone()  # [4, vocab]
    for i, (p, pg) in enumerate(zip(prompts, pages)):
        alone = mr.prefill([p], [pg])[0]
        assert rel_err(packed[i], alone) < 1e-5


@pytest.mark.parametrize("chunk", CHUNKS)
def test_chunks_give_the_whole_prompts_logits_and_cache(chunk):
    prompts = _prompts(2, [37, 5])
    whole_mr, mr = _runner(), _runner()
    _poison(mr)
    pages = [whole_mr.kv_cache.reserve(len(p)) for p in prompts]
    assert [mr.kv_cache.reserve(len(p)) for p in prompts] == pages
    whole = whole_mr.prefill(prompts, pages)
    last = {}
    for start in range(0, max(map(len, prompts)), chunk):  # every prompt cut at each chunk
        live = [(i, p) for i, p in enumerate(prompts) if start < len(p)]
        chunks = [PrefillChunk(p[start : start + chunk], start, pages[i]) for i, p in live]
        for (i, _), row in zip(live, mr.extend(chunks)):
            last[i] = row.clone()
    for i in range(len(prompts)):
        assert rel_err(last[i], whole[i]) < 1e-4
    slots = torch.tensor(
        [s for p, pg in zip(prompts, pages) for s in mr.kv_cache.slots(pg, 0, len(p))]
    )
    for a, b in zip(
        mr.kv_cache.k_caches + mr.kv_cache.v_caches,
        whole_mr.kv_cache.k_caches + whole_mr.kv_cache.v_caches,
    ):
        assert rel_err(a.flatten(0, 1)[slots], b.flatten(0, 1)[slots]) < 1e-5


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_engine_tokens_do_not_depend_on_the_budget(mode):
    prompts = _prompts(3, [29, 3, 17, 45])
    ref = Engine(_runner(), "eager").generate(prompts, max_new_tokens=6)
    for budget in CHUNKS:
        config = RunnerConfig(max_bs=4, show_progress=False) if mode != "eager" else None
        engine = Engine(_runner(), mode, config, max_prefill_tokens=budget)
        assert engine.generate(prompts, max_new_tokens=6) == ref, budget
        assert engine.stats.prefill_tokens == sum(map(len, prompts))
        if budget < 45:
            assert engine.stats.prefill_steps >= -(-sum(map(len, prompts)) // budget)
        engine.shutdown()


def test_decoding_goes_on_while_a_long_prompt_prefills():
    """Budget 16: a running request gets a token at every step of a 100-token prefill."""
    mr = _runner(max_context_len=160)
    short, long_ = _prompts(4, [4, 100])
    engine = Engine(mr, "eager", max_prefill_tokens=16, overlap=False)  # tokens of this step
    a = engine.add_request(short, 20)
    assert engine.step() == [(a, engine.running[0].output[0])]  # prefilled, first token
    b = engine.add_request(long_, 3)
    steps, first_of_b = 0, []
    while not first_of_b:
        out = engine.step()
        steps += 1
        assert [rid for rid, _ in out].count(a) == 1  # one token of a, every step
        first_of_b = [tok for rid, tok in out if rid == b]
    assert steps == 7  # ceil(100 / 16) prefill steps, b's first token with the last
    while engine.has_unfinished:
        engine.step()
    want = Engine(_runner(max_context_len=160), "eager").generate([long_, short], 20)
    assert engine.finished[b].output == want[0][:3]
    assert engine.finished[a].output == want[1]


def test_a_fault_mid_chunked_prefill_frees_every_page():
    mr = _runner(num_pages=40)
    engine = Engine(mr, "eager", max_prefill_tokens=7)
    free = mr.kv_cache.allocator.num_free
    prompts = _prompts(5, [30, 12, 21])
    calls = {"n": 0}
    extend = mr.extend

    def failing(chunks):
        calls["n"] += 1
        if calls["n"] == 3:  # the first prompt is half prefilled
            raise RuntimeError("injected fault in extend")
        return extend(chunks)

    engine.prefiller = type("Failing", (), {"extend": staticmethod(failing)})()
    with time_limit(20), pytest.raises(RuntimeError, match="injected fault"):
        engine.generate(prompts, max_new_tokens=4)
    assert not engine.running and not engine.waiting and not engine.finished
    assert mr.kv_cache.allocator.num_free == free
    engine.prefiller = mr
    want = Engine(_runner(num_pages=40), "eager").generate(prompts, 4)
    assert engine.generate(prompts, max_new_tokens=4) == want


@pytest.mark.parametrize("bad", [0, -3, True, 7.5])
def test_bad_budget_is_refused_before_anything_is_built(bad):
    with pytest.raises(ConfigError, match="max_prefill_tokens must be an integer >= 1"):
        Engine(_runner(), "eager", max_prefill_tokens=bad)


def test_budget_of_one_token_works():
    prompts = _prompts(6, [5, 3])
    want = Engine(_runner(), "eager").generate(prompts, 3)
    engine = Engine(_runner(), "eager", max_prefill_tokens=1)
    assert engine.generate(prompts, 3) == want
    assert engine.stats.prefill_steps == 8


def test_engine_refuses_calls_after_shutdown():
    engine = Engine(_runner(), "graph", RunnerConfig(max_bs=2, show_progress=False))
    engine.shutdown()
    for call in (
        lambda: engine.generate([[1, 2]], 2),
        lambda: engine.add_request([1], 2),
        engine.step,
    ):
        with pytest.raises(ReplayError, match="after shutdown"):
            call()


def test_extend_refuses_chunks_past_their_pages():
    mr = _runner()
    pages = mr.kv_cache.reserve(16)  # one page
    with pytest.raises(ConfigError, match="chunk 0 ends at position 17"):
        mr.extend([PrefillChunk(list(range(1, 18)), 0, pages)])
    mr.extend([PrefillChunk(list(range(1, 17)), 0, pages)])  # exactly the page
    with pytest.raises(ConfigError, match="chunk 0 starts at -1"):
        mr.extend([PrefillChunk([1], -1, pages)])


@pytest.mark.parametrize("lens", [[1], [5, 3], [17, 2, 9], [40, 1, 1, 1, 1]])
def test_extend_batch_keeps_the_kernels_specialisation(lens):
    """Whatever the chunk count and lengths, the int32 index tensors start 16-byte aligned and
    the table's row stride is a multiple of 16: Triton compiles no new variant per batch."""
    from stepgraph.model.prefill.extend_batch import build_extend_batch

    mr = _runner()
    chunks = [PrefillChunk(list(range(1, n + 1)), 0, mr.kv_cache.reserve(n)) for n in lens]
    b = build_extend_batch(chunks, mr.page_size, mr.device)
    for t in (b.qo_indptr, b.kv_lens, b.block_table):
        assert t.data_ptr() % 16 == 0 and t.dtype == torch.int32
    assert b.block_table.stride(0) % 16 == 0 and b.block_table.shape[0] == len(lens)
    assert b.qo_indptr.tolist() == [0, *torch.tensor(lens).cumsum(0).tolist()]
    assert b.kv_lens.tolist() == lens and b.last_idx.tolist() == [
        x - 1 for x in b.qo_indptr[1:].tolist()
    ]


@pytest.mark.parametrize("seed", [-1, 2**64, True, 1.5])
def test_generate_refuses_a_seed_outside_64_bits(seed):
    engine = Engine(_runner(), "eager")
    with pytest.raises(ConfigError, match=r"seed must be an integer in \[0, 2\*\*64 - 1\]"):
        engine.generate([[1, 2]], 2, temperature=1.0, seed=seed)
    assert not engine.has_unfinished
    assert engine.generate([[1, 2]], 2, temperature=1.0, seed=2**64 - 1)  # the largest seed
