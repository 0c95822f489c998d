"""The attention's L2 prefetch of the next weights (``kernels/l2_shadow``) on the GPU: the split
kernels with regions give the same bits as without (before and after their own work, split +
combine and folded), and the fused decode step with every switch value gives eager's logits
and KV bit for bit, in eager, and in a captured graph against eager.

Nothing touches CUDA at import time: without a GPU the module imports and every test skips.
"""

from __future__ import annotations

import pytest
import torch

from stepgraph.bench.workload import Point, decode_batch, fill_kv_random
from stepgraph.kernels.decode_inputs import DecodeWorkspace
from stepgraph.kernels.flash_decode import flash_decode
from stepgraph.kernels.l2_shadow import shadow_spec
from stepgraph.model import ModelRunner, fused_decode
from stepgraph.runner import CudaGraphRunner, RunnerConfig

pytestmark = pytest.mark.cuda
DEV = "cuda"
SPECS = ["o", "o,gu=0.25", "o,gu=0.5@end"]


@pytest.mark.parametrize("fold", [False, True])
@pytest.mark.parametrize("end", [False, True])
def test_split_kernels_with_regions_are_bit_identical(fold, end):
    g = torch.Generator(DEV).manual_seed(7 + fold + 2 * end)
    bs, n_heads, n_kv, hd, pages, page = 8, 32, 8, 64, 80, 64
    q = torch.randn(bs, n_heads, hd, generator=g, device=DEV).bfloat16()
    kc, vc = (torch.randn(pages, page, n_kv, hd, generator=g, device=DEV).bfloat16()
              for _ in range(2))  # fmt: skip
    table = torch.randperm(pages, generator=g, device=DEV)[: bs * 10].reshape(bs, 10).int()
    lens = torch.randint(1, 640, (bs,), generator=g, device=DEV).int()
    o_w = torch.randn(2048, 2048, generator=g, device=DEV).bfloat16()
    gu_w = torch.randn(16384, 2048, generator=g, device=DEV).bfloat16()

    def run(**shadow):
        ws = DecodeWorkspace.allocate(bs, n_heads, hd, 8, q.device)
        return flash_decode(q, kc, vc, table, lens, num_splits=8, workspace=ws,
                            fold_combine=fold, **shadow)  # fmt: skip

    want = run()
    got = run(shadow=[(o_w, 2048), (gu_w, 512)], shadow_end=end)
    torch.cuda.synchronize()
    assert torch.equal(got, want)


@pytest.fixture(scope="module")
def mr():
    runner = ModelRunner.from_preset(
        "llama-3.2-1b", DEV, torch.bfloat16, seed=5, num_layers=3, max_bs=64,
        max_context_len=1024, page_size=64,
    )  # fmt: skip
    fill_kv_random(runner)
    return runner


def _step(mr, batch):
    caches = (*mr.kv_cache.k_caches, *mr.kv_cache.v_caches)
    before = [c.clone() for c in caches]
    try:
        return mr.forward(batch).clone(), [c.clone() for c in caches]
    finally:
        for c, c0 in zip(caches, before):
            c.copy_(c0)


@pytest.mark.parametrize("bs", [8, 48])  # split + combine, and the folded attention
@pytest.mark.parametrize("spec", SPECS)
def test_fused_step_with_the_prefetch_equals_without(mr, monkeypatch, bs, spec):
    batch, pages = decode_batch(mr, Point(bs, 500), seed=bs)
    try:
        monkeypatch.setattr(fused_decode, "SHADOW", shadow_spec("0"))
        want, kv_want = _step(mr, batch)
        monkeypatch.setattr(fused_decode, "SHADOW", shadow_spec(spec))
        got, kv_got = _step(mr, batch)
        assert torch.equal(got, want)
        assert all(torch.equal(a, b) for a, b in zip(kv_got, kv_want))
        # mode exact replays what eager computed, the prefetch captured in the graph
        cfg = RunnerConfig(capture_bs=(bs,), max_bs=bs, mode="exact", show_progress=False)
        runner = CudaGraphRunner(mr, cfg)
        try:
            mr.greedy_tokens.fill_(-1)
            graphed, kv_graphed = _step_graph(mr, runner, batch)
            assert torch.equal(mr.fused_tokens(bs), want.argmax(-1))
        finally:
            runner.shutdown()
        assert torch.equal(graphed, want)
        assert all(torch.equal(a, b) for a, b in zip(kv_graphed, kv_want))
    finally:
        for p in pages:
            mr.kv_cache.release(p)


def _step_graph(mr, runner, batch):
    caches = (*mr.kv_cache.k_caches, *mr.kv_cache.v_caches)
    before = [c.clone() for c in caches]
    try:
        return runner.replay(batch).clone(), [c.clone() for c in caches]
    finally:
        for c, c0 in zip(caches, before):
            c.copy_(c0)
