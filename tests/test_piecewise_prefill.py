"""Piecewise packed prefill on the CPU stand-in against ``ModelRunner.prefill``: random
mixed-length batches (on a token-bucket edge and one past it), chunks over a cached prefix,
identical K/V at the prompts' slots and nowhere else, poisoned static buffers, the eager
fallback, config errors, and the engine option."""

from __future__ import annotations

import pytest
import torch

from stepgraph.engine import Engine
from stepgraph.errors import ConfigError
from stepgraph.model import ModelRunner
from stepgraph.model.prefill.extend_batch import PrefillChunk
from stepgraph.model.prefill.piecewise_prefill import PiecewisePrefill, PrefillShapes
from stepgraph.runner import RunnerConfig

VOCAB = 512
CFG = PrefillShapes(token_buckets=(8, 32, 128), batch_sizes=(1, 2, 4))
TOL = dict(rtol=1e-5, atol=1e-5)


def _runner(preset: str = "tiny") -> ModelRunner:
    return ModelRunner.from_preset(
        preset, "cpu", torch.float32, seed=3, max_bs=8, max_context_len=128
    )


@pytest.fixture(scope="module", params=["tiny", "tiny-qwen2"])
def pair(request):
    """(eager model runner, piecewise prefill on a twin model runner with the same weights)."""
    return _runner(request.param), PiecewisePrefill(_runner(request.param), CFG)


def _poison_kv(mr: ModelRunner) -> None:
    for c in (*mr.kv_cache.k_caches, *mr.kv_cache.v_caches):
        c.fill_(float("nan"))


def _check(pair, lens, seed):
    ref_mr, pp = pair
    mr = pp.mr
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in lens]
    pages = [ref_mr.kv_cache.reserve(n) for n in lens]
    assert [mr.kv_cache.reserve(n) for n in lens] == pages  # twin caches, same pages
    try:
        _poison_kv(mr)  # every slot the prefill must not write stays NaN
        graphs = pp.stats.graph_batches
        got = pp.prefill(prompts, pages).clone()
        assert pp.stats.graph_batches == graphs + 1
        ref = ref_mr.prefill(prompts, pages)
        torch.testing.assert_close(got, ref, **TOL)
        assert (got.argmax(-1) == ref.argmax(-1)).all()
        slots = torch.tensor([s for p, n in zip(pages, lens) for s in mr.kv_cache.slots(p, 0, n)])
        for a, b in zip(
            (*mr.kv_cache.k_caches, *mr.kv_cache.v_caches),
            (*ref_mr.kv_cache.k_caches, *ref_mr.kv_cache.v_caches),
        ):
            flat_a, flat_b = a.flatten(0, 1), b.flatten(0, 1)  # [slots, heads, hd]
            torch.testing.assert_close(flat_a[slots], flat_b[slots], **TOL)
            untouched = torch.ones(flat_a.shape[0], dtype=torch.bool)
            untouched[slots] = False
            assert flat_a[untouched].isnan().all()  # padding never reached the KV cache
    finally:
        for p in pages:
            ref_mr.kv_cache.release(p)
            mr.kv_cache.release(p)


@pytest.mark.parametrize(
    "lens",
    [
        [8],  # exactly one bucket, one prompt
        [5, 3],  # exactly on the bucket edge (8), with a spare request slot
        [5, 4],  # one token past it
        [20, 1, 11],  # exactly 32
        [20, 1, 12],  # 33
        [60, 3, 17, 48],  # max bs, exactly the largest bucket
        [100, 26],  # two padded requests of one token each
    ],
)
def test_matches_eager_prefill(pair, lens):
    _check(pair, lens, seed=sum(lens))


def test_random_mixed_batches(pair):
    g = torch.Generator().manual_seed(11)
    for trial in range(6):
        bs = int(torch.randint(1, 4, (1,), generator=g))
        lens = torch.randint(1, 40, (bs,), generator=g).tolist()
        _check(pair, lens, seed=100 + trial)


@pytest.mark.parametrize("cut", [1, 7, 16, 17])
def test_chunks_over_a_cached_prefix_match_eager_extend(pair, cut):
    """A second chunk attends to the first through the cache: piecewise equals eager extend,
    and both equal the prompt prefilled whole."""
    ref_mr, pp = pair
    g = torch.Generator().manual_seed(40 + cut)
    prompts = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in (30, 19)]
    pages = [ref_mr.kv_cache.reserve(n) for n in (30, 19)]
    assert [pp.mr.kv_cache.reserve(n) for n in (30, 19)] == pages
    try:
        whole = ref_mr.prefill(prompts, pages).clone()
        head = [PrefillChunk(p[:cut], 0, pg) for p, pg in zip(prompts, pages)]
        tail = [PrefillChunk(p[cut:], cut, pg) for p, pg in zip(prompts, pages)]
        ref_mr.extend(head)
        pp.mr.extend(head)
        graphs = pp.stats.graph_batches
        got = pp.extend(tail).clone()
        assert pp.stats.graph_batches == graphs + 1
        torch.testing.assert_close(got, ref_mr.extend(tail), **TOL)
        torch.testing.assert_close(got, whole, **TOL)
    finally:
        for p in pages:
            ref_mr.kv_cache.release(p)
            pp.mr.kv_cache.release(p)


def test_poisoned_static_buffers_do_not_leak(pair):
    _, pp = pair
    for t in pp._static.values():
        t.fill_(10**4 if t.dtype == torch.int64 else float("nan"))
    for r in pp.runners:  # written behind the runners' back: every row is dirty again
        r.mark_inputs_dirty()
    _check(pair, [9, 14], seed=8)  # padding rows are refilled at the next replay


@pytest.mark.parametrize(
    "lens, graph",
    [
        ([1, 1, 1, 1], True),  # a full bs-4 shape with leftover tokens: the spare slot holds them
        ([2, 2, 2, 1], True),
        ([5, 2, 1, 1], True),
        ([2] * 5, False),  # 5 prompts > the largest bs (4)
    ],
)
def test_batches_run_from_a_graph_iff_some_shape_holds_them(pair, lens, graph):
    ref_mr, pp = pair
    g = torch.Generator().manual_seed(9 + sum(lens))
    assert pp.can_run(lens) == graph
    prompts = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in lens]
    pages = [pp.mr.kv_cache.reserve(n) for n in lens]
    eager, graphs = pp.stats.eager_batches, pp.stats.graph_batches
    got = pp.prefill(prompts, pages).clone()
    assert (pp.stats.graph_batches, pp.stats.eager_batches) == (
        graphs + graph,
        eager + (not graph),
    )
    torch.testing.assert_close(got, ref_mr.prefill(prompts, pages), **TOL)
    for p in pages:
        pp.mr.kv_cache.release(p)


def test_config_errors(pair):
    with pytest.raises(ConfigError, match="max\\(batch_sizes\\)"):
        PrefillShapes(token_buckets=(8, 32), batch_sizes=(1, 8))
    with pytest.raises(ConfigError, match="sorted"):
        PrefillShapes(token_buckets=(32, 8))
    with pytest.raises(ConfigError, match="chunk 1 is empty"):
        pair[1].prefill([[1], []], [[1], [2]])
    with pytest.raises(ConfigError, match="page lists"):
        pair[1].prefill([[1]], [])
    with pytest.raises(ConfigError, match="prefill must be"):
        Engine(pair[0], prefill="cuda-graph")


def test_engine_piecewise_prefill_and_config_decode_match_eager():
    prompts = [
        torch.randint(1, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        for n in (3, 11, 29, 6, 47)
    ]
    ref = Engine(_runner(), "eager").generate(prompts, max_new_tokens=8)
    engine = Engine(
        _runner(),
        "graph",
        RunnerConfig(max_bs=8, show_progress=False),
        max_running=3,
        prefill="piecewise",
        decode_via="configs",
        prefill_config=CFG,
    )
    assert engine.generate(prompts, max_new_tokens=8) == ref
    assert engine.prefiller.stats.graph_batches >= 2 and engine.stats.prefills == 5
    engine.shutdown()


def test_every_region_shares_one_graph_pool(pair):
    """The regions replay one after another in capture order, so one pool serves them all;
    a pool per region multiplied the memory by the number of layers."""
    _, pw = pair
    pools = {id(r._backend.pool) for r in pw.runners}
    assert pools == {id(pw._pool)}
