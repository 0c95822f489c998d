from __future__ import annotations

import gc

import pytest
import torch

from stepgraph.errors import CaptureError
from stepgraph.runner import capture


def test_model_capture_mode_sets_flag_and_refuses_nesting():
    assert not capture.is_capture_mode()
    with capture.model_capture_mode():
        assert capture.is_capture_mode()
        with pytest.raises(CaptureError, match="already in progress"):
            with capture.model_capture_mode():
                pass
        assert capture.is_capture_mode()
    assert not capture.is_capture_mode()


def test_capture_mode_resets_after_an_exception():
    with pytest.raises(ValueError):
        with capture.model_capture_mode():
            raise ValueError("boom")
    assert not capture.is_capture_mode()


def test_freeze_gc_freezes_and_unfreezes():
    before = gc.get_freeze_count()
    with capture.freeze_gc():
        assert gc.get_freeze_count() > before
    assert gc.get_freeze_count() == before
    with capture.freeze_gc(enabled=False):
        assert gc.get_freeze_count() == before


@pytest.fixture
def fresh_global_pool():
    old = capture.get_global_graph_memory_pool()
    capture.set_global_graph_memory_pool(None)
    yield
    capture.set_global_graph_memory_pool(old)


def test_global_pool_helpers_back_onto_one_state_object(fresh_global_pool):
    capture.set_global_graph_memory_pool(("pool", 7))
    assert capture.get_global_graph_memory_pool() == ("pool", 7)
    assert capture.STATE.pool == ("pool", 7)
    assert capture.STATE.pool_for_new_runner().handle == ("pool", 7)


def _three_runners():
    """A decode runner, a config runner and a piecewise runner, captured on the CPU stand-in."""
    from stepgraph import (
        BatchedCudaGraphConfig,
        ConfigGraphRunner,
        CudaGraphRunner,
        PiecewiseBatchedConfig,
        PiecewiseRunner,
        RunnerConfig,
    )
    from stepgraph.toy_model import ToyModelRunner

    class Walks(torch.nn.Module):
        def forward_batched(self, *, walk, inputs):
            return inputs["x"] * 2.0

    decode = CudaGraphRunner(
        ToyModelRunner(num_pages=64), RunnerConfig(capture_bs=(1, 2), show_progress=False)
    )
    one = {"x": torch.randn(3)}
    configs = ConfigGraphRunner(
        Walks(),
        [BatchedCudaGraphConfig("w", one, capture_batch_sizes=[1, 2])],
        device="cpu",
        show_progress=False,
    )
    piecewise = PiecewiseRunner(
        PiecewiseBatchedConfig(
            capture_fn=lambda call: {"y": call.static_inputs["x"] + 1.0},
            make_static_inputs=lambda shape: {"x": torch.randn(shape.bs, 2, 3)},
            seq_len=2,
        ),
        device="cpu",
        batch_sizes=[1, 2],
    )
    return decode, configs, piecewise


def test_the_first_runner_creates_the_global_pool_and_later_runners_share_it(fresh_global_pool):
    decode, configs, piecewise = _three_runners()
    handle = capture.get_global_graph_memory_pool()
    assert handle is not None and decode.pool.handle is handle
    assert configs.pool.handle is handle and piecewise.pool.handle is handle
    # shutting one runner down leaves the others' (and the global) pool in place
    decode.shutdown()
    assert configs.pool.handle is handle and capture.get_global_graph_memory_pool() is handle


def test_set_global_pool_reaches_every_runner_created_afterwards(fresh_global_pool):
    mine = object()
    capture.set_global_graph_memory_pool(mine)
    runners = _three_runners()
    assert [r.pool.handle for r in runners] == [mine] * 3
    capture.set_global_graph_memory_pool(None)  # the next runner creates (and shares) a new one
    fresh = _three_runners()
    assert fresh[0].pool.handle is not mine
    assert {id(r.pool.handle) for r in fresh} == {id(fresh[0].pool.handle)}
    assert runners[0].pool.handle is mine  # runners created before keep theirs


def test_capture_stats_sum_buckets():
    stats = capture.CaptureStats(
        [
            capture.BucketStats(8, 0.5, 0, 3 * 2**20),
            capture.BucketStats(4, 0.25, 3 * 2**20, 4 * 2**20),
        ]
    )
    assert stats.seconds == 0.75 and stats.pool_bytes == 4 * 2**20
    assert stats.summary() == "captured 2 buckets in 0.75 s, pool 4.0 MiB"


def test_a_failed_capture_stops_the_allocator_recording_to_the_pool(monkeypatch):
    """CUDA's capture_end skips ending the pool's recording when the capture was invalidated;
    the backend ends it, so the (shared) pool takes the next capture. Ended already is fine."""
    from stepgraph import graph_pool

    calls = []

    def end(device_index, pool):
        calls.append((device_index, pool))
        if len(calls) > 1:
            raise RuntimeError("endAllocatePool: not currently recording to mempool_id")

    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", end, raising=False)
    graph_pool.stop_recording_to_pool(torch.device("cuda", 3), (0, 7))
    graph_pool.stop_recording_to_pool(torch.device("cuda", 3), (0, 7))  # swallowed
    assert calls == [(3, (0, 7))] * 2


def test_an_abandoned_pool_gets_a_fresh_handle_and_the_global_pool_follows(fresh_global_pool):
    pool = capture.STATE.pool_for_new_runner()
    first = pool.get_or_create(torch.device("cpu"))
    assert capture.get_global_graph_memory_pool() is first
    pool.abandon()  # what a failed CUDA capture does
    assert pool.handle is None and capture.get_global_graph_memory_pool() is None
    second = pool.get_or_create(torch.device("cpu"))
    assert second is not first and capture.get_global_graph_memory_pool() is second
    other = capture.STATE.pool_for_new_runner()
    capture.set_global_graph_memory_pool(mine := object())
    other.abandon()  # a pool that is not (or no longer) the global one leaves the global alone
    assert capture.get_global_graph_memory_pool() is mine
