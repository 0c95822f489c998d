"""The decode graph runner on a real GPU, with the toy paged model."""

from __future__ import annotations

import pytest
import torch

from stepgraph.runner import CudaGraphRunner, RunnerConfig
from stepgraph.toy_model import ToyModelRunner


@pytest.fixture(scope="module")
def mr():
    return ToyModelRunner(
        hidden=64,
        num_layers=4,
        num_pages=600,
        page_size=16,
        max_pages_per_request=8,
        device="cuda",
        seed=17,
    )


@pytest.fixture(scope="module")
def runner(mr):
    r = CudaGraphRunner(mr, RunnerConfig(max_bs=64, show_progress=False))
    yield r
    r.shutdown()


def test_replay_equals_eager_for_every_bs(mr, runner):
    g = torch.Generator().manual_seed(33)
    for bs in range(1, runner.max_bs + 1):
        batch = mr.random_batch(bs, g)
        want, want_state = mr.eager_reference(batch)
        runner.output_buffers[max(runner.capture_bs)].fill_(float("nan"))  # poison
        got = runner.replay(batch)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        for have, ref in zip(mr.kv, want_state):  # padding rows wrote only into scratch page 0
            torch.testing.assert_close(have[mr.page_size :], ref[mr.page_size :])


def test_shrinking_batch_in_one_bucket_keeps_live_state_clean(mr, runner):
    g = torch.Generator().manual_seed(5)
    runner.replay(mr.random_batch(48, g))
    small = mr.random_batch(33, g)  # same bucket (48), rows 33..47 were live a step ago
    want, want_state = mr.eager_reference(small)
    torch.testing.assert_close(runner.replay(small), want, rtol=1e-4, atol=1e-4)
    for have, ref in zip(mr.kv, want_state):
        torch.testing.assert_close(have[mr.page_size :], ref[mr.page_size :])


def test_outputs_are_the_static_buffers(mr, runner):
    g = torch.Generator().manual_seed(6)
    a, b = mr.random_batch(3, g), mr.random_batch(3, g)
    want_a, _ = mr.eager_reference(a)
    out = runner.replay(a)
    torch.testing.assert_close(out, want_a, rtol=1e-4, atol=1e-4)
    want_b, want_state = mr.eager_reference(b)
    runner.replay(b)
    # the first result, not copied, now holds the second batch's logits
    torch.testing.assert_close(out, want_b, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(want_a, want_b, rtol=1e-3, atol=1e-3)
    for have, ref in zip(mr.kv, want_state):
        torch.testing.assert_close(have[mr.page_size :], ref[mr.page_size :])


def test_capture_stats_are_recorded(mr, runner):
    import time

    from stepgraph.graph_pool import GraphPool

    assert [b.bs for b in runner.stats.capture.buckets] == sorted(runner.capture_bs, reverse=True)
    start = time.perf_counter()
    fresh = CudaGraphRunner(mr, RunnerConfig(max_bs=16, show_progress=False), pool=GraphPool())
    wall = time.perf_counter() - start
    stats = fresh.stats.capture
    try:
        assert [b.bs for b in stats.buckets] == [16, 8, 4, 2, 1]
        assert all(b.seconds > 0 for b in stats.buckets)
        assert stats.seconds <= wall  # per-bucket stopwatches inside the constructor
        # a fresh pool: the ledger adds up to the allocator's own count of the pool's segments
        assert stats.pool_held_bytes is not None and stats.pool_held_bytes > 0
        assert abs(stats.pool_bytes - stats.pool_held_bytes) <= 2 * 2**20, stats.ledger()
    finally:
        fresh.shutdown()
