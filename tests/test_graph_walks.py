"""The decode walk through ``ConfigGraphRunner`` on the CPU stand-in: greedy tokens equal the
``CudaGraphRunner``'s and eager's, padded requests touch only scratch page 0, the eager chunk
path above the largest bucket, and the adapter's errors."""

from __future__ import annotations

import pytest
import torch

from stepgraph.engine import Engine
from stepgraph.errors import ConfigError
from stepgraph.model import ModelRunner
from stepgraph.model.decode.graph_walks import (
    DECODE_WALK,
    DecodeGraphWalks,
    build_decode_graph_runner,
)
from stepgraph.model.kv_cache import SCRATCH_PAGE
from stepgraph.runner import RunnerConfig

VOCAB = 512


def _runner(preset: str = "tiny", **kw) -> ModelRunner:
    kw.setdefault("max_bs", 8)
    return ModelRunner.from_preset(preset, "cpu", torch.float32, seed=3, max_context_len=96, **kw)


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen2"])
def test_configs_decode_matches_cuda_graph_runner_and_eager(preset):
    prompts = _prompts([3, 11, 29, 6, 47], seed=1)
    cfg = RunnerConfig(max_bs=8, show_progress=False)
    ref = Engine(_runner(preset), "graph", cfg).generate(prompts, max_new_tokens=10)
    eager = Engine(_runner(preset), "eager").generate(prompts, max_new_tokens=10)
    engine = Engine(_runner(preset), "graph", cfg, decode_via="configs")
    got = engine.generate(prompts, max_new_tokens=10)
    assert got == ref == eager
    assert engine.runner is None and engine.stats.graph_steps == 9 and engine.stats.eager_steps == 0
    assert engine.config_runner.stats.replays == 9
    assert sum(len(set(t)) for t in got) > 20  # real continuations


def test_batch_above_largest_bucket_runs_eagerly_in_chunks():
    prompts = _prompts([4, 9, 15, 22, 30], seed=2)
    ref = Engine(_runner(), "eager").generate(prompts, max_new_tokens=6)
    engine = Engine(
        _runner(),
        "graph",
        RunnerConfig(capture_bs=(1, 2), show_progress=False),
        decode_via="configs",
    )
    assert engine.generate(prompts, max_new_tokens=6) == ref
    stats = engine.config_runner.stats
    assert stats.eager_reasons["too_large"] == engine.stats.eager_steps == 5
    assert stats.eager_calls == 5 * 3  # 5 requests in chunks of <= 2


def test_padded_requests_touch_only_scratch_page():
    mr = _runner()
    walks, runner = build_decode_graph_runner(mr, capture_batch_sizes=[4])
    single = walks.single_request_inputs()
    assert single["seq_len"].item() == 1 and single["out_cache_loc"].item() == 0
    assert (single["block_table"] == SCRATCH_PAGE).all() and single["input_ids"].item() == 0
    g = torch.Generator().manual_seed(5)
    pages = [mr.kv_cache.reserve(40) for _ in range(3)]
    for cache in (*mr.kv_cache.k_caches, *mr.kv_cache.v_caches):
        cache.normal_(generator=g)
        cache[SCRATCH_PAGE] = 1e4  # poison: a real request reading scratch would show
    tokens, positions = [5, 77, 300], [9, 20, 38]
    before = [c.clone() for c in (*mr.kv_cache.k_caches, *mr.kv_cache.v_caches)]
    batch = mr.decode_batch(tokens, positions, pages)
    got = runner.run(DECODE_WALK, walks.requests(batch)).clone()  # bs 3 padded to 4
    assert runner.stats.replays == 1
    after = [c.clone() for c in (*mr.kv_cache.k_caches, *mr.kv_cache.v_caches)]
    live = {mr.kv_cache.slot(pg, p) for pg, p in zip(pages, positions)}
    for b, a in zip(before, after):
        changed = (b != a).flatten(2).any(-1).flatten().nonzero().flatten().tolist()  # slots
        assert set(changed) <= live | {0}, changed  # live slots and scratch slot 0 only
    # the eager reference on the KV as it was: same logits
    for c, b in zip((*mr.kv_cache.k_caches, *mr.kv_cache.v_caches), before):
        c.copy_(b)
    ref = mr.forward(mr.decode_batch(tokens, positions, pages))
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(got).all()


def test_adapter_errors():
    mr = _runner()
    walks = DecodeGraphWalks(mr)
    inputs = walks.decode_config([1]).model_inputs([walks.single_request_inputs()])
    with pytest.raises(ConfigError, match="got 'prefill'"):
        walks.forward_batched(walk="prefill", inputs=inputs)
    with pytest.raises(ConfigError, match="lack"):
        walks.forward_batched(walk=DECODE_WALK, inputs={"input_ids": inputs["input_ids"]})
    assert walks.forward_batched(walk=DECODE_WALK, inputs=inputs).shape == (1, VOCAB)
    with pytest.raises(ConfigError, match="mode='graph'"):
        Engine(mr, "exact", decode_via="configs")
    with pytest.raises(ConfigError, match="decode_via"):
        Engine(mr, "graph", decode_via="fast")
