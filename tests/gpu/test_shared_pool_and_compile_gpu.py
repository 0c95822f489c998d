"""On a real GPU: runners share the global graph memory pool, and buckets
captured from a torch.compile'd forward replay equal to eager."""

from __future__ import annotations

import gc

import pytest
import torch

from stepgraph import GraphPool, get_global_graph_memory_pool, set_global_graph_memory_pool
from stepgraph.runner import CudaGraphRunner, RunnerConfig
from stepgraph.toy_model import ToyModelRunner

CFG = RunnerConfig(max_bs=64, show_progress=False)


@pytest.fixture(scope="module")
def mr():
    return ToyModelRunner(
        hidden=1024,
        num_layers=8,
        num_pages=600,
        page_size=16,
        max_pages_per_request=8,
        device="cuda",
        seed=23,
    )


def _reserved_after(build) -> tuple[int, list]:
    """Bytes the allocator reserves for what ``build()`` returns (kept alive)."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    kept = build()
    torch.cuda.synchronize()
    return torch.cuda.memory_reserved() - before, kept


def test_two_runners_on_the_global_pool_reserve_little_more_than_one(mr):
    old = get_global_graph_memory_pool()
    try:
        one, kept = _reserved_after(lambda: [CudaGraphRunner(mr, CFG, pool=GraphPool())])
        for r in kept:
            r.shutdown()
        del kept
        set_global_graph_memory_pool(None)
        two, kept = _reserved_after(lambda: [CudaGraphRunner(mr, CFG), CudaGraphRunner(mr, CFG)])
        a, b = kept
        assert a.pool.handle is b.pool.handle is get_global_graph_memory_pool()
        assert one > 0 and two <= 1.2 * one, f"one runner {one} B, two on one pool {two} B"
        # the second runner's captures reuse the first's pool blocks
        assert b.stats.capture.pool_bytes <= 0.2 * a.stats.capture.pool_bytes
        g = torch.Generator().manual_seed(3)
        for bs in (1, 5, 17, 64):  # both still replay correctly, one after the other
            batch = mr.random_batch(bs, g)
            want, _ = mr.eager_reference(batch)
            for r in (a, b):
                torch.testing.assert_close(r.replay(batch).clone(), want, rtol=1e-4, atol=1e-4)
        a.shutdown()
        b.shutdown()
    finally:
        set_global_graph_memory_pool(old)


def test_compiled_buckets_replay_equal_to_eager(mr):
    cfg = RunnerConfig(
        capture_bs=(1, 2, 4, 8),
        enable_torch_compile=True,
        torch_compile_max_bs=2,
        torch_compile_mode="default",
        show_progress=False,
    )
    runner = CudaGraphRunner(mr, cfg)
    assert runner.compile_bs == [1, 2]
    g = torch.Generator().manual_seed(4)
    for bs in (1, 2, 3, 8):
        batch = mr.random_batch(bs, g)
        want, want_state = mr.eager_reference(batch)
        runner.output_buffers[8].fill_(float("nan"))
        torch.testing.assert_close(runner.replay(batch), want, rtol=1e-4, atol=1e-4)
        for have, ref in zip(mr.kv, want_state):
            torch.testing.assert_close(have[mr.page_size :], ref[mr.page_size :])
    runner.shutdown()
