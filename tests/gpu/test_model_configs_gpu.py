"""GPU tier of the declarative configs in the reference model (bf16, 4 layers of the
llama-3.2-1b shape): the decode walk through ``ConfigGraphRunner`` gives the same greedy tokens
as ``CudaGraphRunner`` (same buckets, same attention geometry); piecewise packed prefill matches
eager prefill within bf16 noise, at bucket edges and one past them.

Nothing touches CUDA at import time: without a GPU the module imports and every test skips.
"""

from __future__ import annotations

import pytest
import torch

from stepgraph.engine import Engine
from stepgraph.model import ModelRunner
from stepgraph.model.prefill.piecewise_prefill import PiecewisePrefill, PrefillShapes
from stepgraph.runner import RunnerConfig

pytestmark = pytest.mark.cuda

DEV = "cuda"
PRESET, NUM_LAYERS, MAX_BS, MAX_CONTEXT = "llama-3.2-1b", 4, 8, 2304
LOGIT_TOL = 0.15  # max |logit diff| (std ~1): bf16 GEMMs of padded vs unpadded row counts
TIE_TOL = 0.1  # a top-1 disagreement is accepted only where eager's top two are this close


def _runner() -> ModelRunner:
    return ModelRunner.from_preset(
        PRESET,
        DEV,
        torch.bfloat16,
        seed=7,
        num_layers=NUM_LAYERS,
        max_bs=MAX_BS,
        max_context_len=MAX_CONTEXT,
    )


def _prompts(vocab: int, lengths, seed=0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]


def test_configs_decode_matches_cuda_graph_runner():
    mr = _runner()
    prompts = _prompts(mr.config.vocab_size, [5, 37, 90, 12, 150])
    cfg = RunnerConfig(max_bs=MAX_BS, show_progress=False)
    ref = Engine(mr, "graph", cfg).generate(prompts, max_new_tokens=64)
    engine = Engine(_runner(), "graph", cfg, decode_via="configs")
    assert engine.generate(prompts, max_new_tokens=64) == ref
    assert engine.stats.graph_steps == 63 and engine.stats.eager_steps == 0
    assert engine.config_runner.stats.capture.pool_bytes > 0


@pytest.fixture(scope="module")
def pair():
    config = PrefillShapes(token_buckets=(16, 64, 256, 2048), batch_sizes=(1, 2, 4, 8))
    return _runner(), PiecewisePrefill(_runner(), config)


@pytest.mark.parametrize(
    "lens",
    [
        [16],
        [9, 7],
        [9, 8],
        [30, 20, 10, 4],
        [30, 20, 10, 5],
        [100, 90, 60, 6],
        [1000, 600, 300, 148],
        [700, 500, 300, 200, 100],
        [3, 1, 4, 1, 5, 9, 2],
    ],
)
def test_piecewise_prefill_matches_eager(pair, lens):
    ref_mr, pp = pair
    prompts = _prompts(ref_mr.config.vocab_size, lens, seed=sum(lens))
    pages = [ref_mr.kv_cache.reserve(n) for n in lens]
    assert [pp.mr.kv_cache.reserve(n) for n in lens] == pages
    # The same random K/V in both caches (never zeros), so a stray write anywhere shows.
    g = torch.Generator(device=DEV).manual_seed(sum(lens) + 1)
    caches = list(zip(_kv(pp.mr), _kv(ref_mr)))
    for a, b in caches:
        a.normal_(generator=g)
        b.copy_(a)
    before = [a.clone() for a, _ in caches]
    try:
        graphs = pp.stats.graph_batches
        got = pp.prefill(prompts, pages).clone()
        ref = ref_mr.prefill(prompts, pages)
        assert pp.stats.graph_batches == graphs + 1, "expected a graph replay, ran eagerly"
        assert torch.isfinite(got).all()
        assert (got - ref).abs().max() <= LOGIT_TOL
        top2 = ref.topk(2, dim=-1)
        for i in (got.argmax(-1) != ref.argmax(-1)).nonzero().flatten().tolist():
            gap = float(top2.values[i, 0] - top2.values[i, 1])
            assert gap <= TIE_TOL, f"prompt {i}: top-1 differs with a {gap:.3f} logit gap"
        slots = torch.tensor(
            [s for p, n in zip(pages, lens) for s in pp.mr.kv_cache.slots(p, 0, n)], device=DEV
        )
        # every other slot keeps its value; page 0 is scratch (padded tokens write there)
        rest = torch.ones(before[0].shape[0] * before[0].shape[1], dtype=torch.bool, device=DEV)
        rest[slots] = False
        rest[: pp.mr.kv_cache.page_size] = False
        for i, ((a, b), a0) in enumerate(zip(caches, before)):  # K of every layer, then V
            a, b, a0 = a.flatten(0, 1), b.flatten(0, 1), a0.flatten(0, 1)
            what = f"{'KV'[i // NUM_LAYERS]} cache of layer {i % NUM_LAYERS}"
            torch.testing.assert_close(
                a[slots].float(), b[slots].float(), atol=0.1, rtol=0.05, msg=what
            )
            assert torch.equal(a[rest], a0[rest]), f"piecewise prefill wrote outside: {what}"
            assert torch.equal(b[rest], a0[rest]), f"eager prefill wrote outside: {what}"
    finally:
        for p in pages:
            ref_mr.kv_cache.release(p)
            pp.mr.kv_cache.release(p)


def _kv(mr: ModelRunner) -> list[torch.Tensor]:
    return [*mr.kv_cache.k_caches, *mr.kv_cache.v_caches]


def test_piecewise_capture_stats(pair):
    _, pp = pair
    cap = pp.stats.capture
    assert len(cap.buckets) == (NUM_LAYERS + 1) * 16 and cap.pool_bytes > 0
