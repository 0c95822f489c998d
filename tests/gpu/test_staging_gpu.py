"""Pinned staging on the GPU: the host writes the next batch while the previous replay runs.

A sleep kernel before each replay keeps the GPU behind the host, so the host stages batch k + 2
into the slot replay k reads while replay k's copy has not run yet, unless it waits for the
slot's copy. The same walk with the wait switched off must go wrong: that proves the test
would catch a slot overwritten before its copy ran.
"""

from __future__ import annotations

import pytest
import torch

from stepgraph.runner import CudaGraphRunner, RunnerConfig
from stepgraph.runner import staging as staging_mod
from stepgraph.toy_model import ToyModelRunner

SLEEP_CYCLES = 4_000_000  # ~2 ms of GPU time per step: the host is always ahead
SIZES = [1, 7, 16, 2, 33, 3, 64, 1, 1, 9, 40, 5, 17, 2, 64, 8]  # across buckets, up and down


@pytest.fixture(scope="module")
def mr():
    return ToyModelRunner(
        hidden=64,
        num_layers=4,
        num_pages=600,
        page_size=16,
        max_pages_per_request=8,
        device="cuda",
        seed=23,
    )


def _batches(mr, seed: int):
    g = torch.Generator().manual_seed(seed)
    # host rows (packed_cpu) for most steps, device-only batches (a D2H into the slot) for some
    return [mr.random_batch(bs, g, packed=(i % 3 != 2)) for i, bs in enumerate(SIZES)]


def _eager(mr, batches):
    saved = mr.clone_state()
    outs = [mr.forward(b).clone() for b in batches]
    torch.cuda.synchronize()
    mr.load_state(saved)
    return outs


def _replayed(mr, runner, batches):
    saved = mr.clone_state()
    outs = []
    for b in batches:
        torch.cuda._sleep(SLEEP_CYCLES)  # the GPU lags; the host runs on
        outs.append(runner.replay(b).clone())  # ordered on the stream: no host sync
    torch.cuda.synchronize()
    mr.load_state(saved)
    return outs


def test_staged_random_walk_equals_eager_with_the_host_ahead(mr):
    runner = CudaGraphRunner(mr, RunnerConfig(max_bs=64, show_progress=False, pinned_staging=True))
    batches = _batches(mr, 1)
    want = _eager(mr, batches)
    got = _replayed(mr, runner, batches)
    for k, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4, msg=f"step {k}")
    assert runner._staging.waits > 0  # the host really was ahead and had to wait
    # the count the fill kernel stores into pinned host memory: one per replay
    assert int(runner._staging.copied) == runner._staging.count == len(batches)
    runner.shutdown()


def test_without_the_wait_a_slot_is_overwritten_and_the_walk_fails(mr, monkeypatch):
    runner = CudaGraphRunner(mr, RunnerConfig(max_bs=64, show_progress=False, pinned_staging=True))
    monkeypatch.setattr(staging_mod.PinnedStaging, "_wait_for", lambda self, n: None)  # the bug
    batches = _batches(mr, 2)
    want = _eager(mr, batches)
    got = _replayed(mr, runner, batches)
    wrong = [k for k, (g, w) in enumerate(zip(got, want)) if not torch.allclose(g, w, 1e-4, 1e-4)]
    assert wrong, "overwriting a slot before its copy ran went unnoticed"
    runner.shutdown()


def test_staged_replay_equals_unstaged_at_every_bucket(mr):
    plain = CudaGraphRunner(mr, RunnerConfig(max_bs=64, show_progress=False))
    staged = CudaGraphRunner(mr, RunnerConfig(max_bs=64, show_progress=False, pinned_staging=True))
    g = torch.Generator().manual_seed(3)
    for bs in plain.capture_bs:
        batch = mr.random_batch(bs, g, packed=True)
        want, _ = mr.eager_reference(batch)
        torch.testing.assert_close(plain.replay(batch), want, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(staged.replay(batch), want, rtol=1e-4, atol=1e-4)
    plain.shutdown()
    staged.shutdown()


@pytest.mark.parametrize(
    "column,value",
    [("out_cache_loc", -1), ("out_cache_loc", 600 * 16), ("seq_lens", 0), ("input_ids", 10**6)],
)
def test_staged_host_rows_with_a_bad_value_are_refused_before_the_device_sees_them(
    mr, column, value
):
    """The staged replay checks a user's host rows on the host (numpy, before the pinned
    slot): a bad value is a ReplayError, the KV cache and the copy count are unchanged, and
    the next good batch replays equal to eager (no device-side assert, no stuck stream)."""
    from stepgraph.batch import PACKED
    from stepgraph.errors import ReplayError

    runner = CudaGraphRunner(mr, RunnerConfig(max_bs=64, show_progress=False, pinned_staging=True))
    g = torch.Generator().manual_seed(5)
    bad = mr.random_batch(3, g, packed=True)
    PACKED.column(bad.packed_cpu, column)[1] = value
    saved = mr.clone_state()
    with pytest.raises(ReplayError, match=column):
        runner.replay(bad)
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(mr.kv, saved))
    assert runner._staging.count == 0 and int(runner._staging.copied) == 0
    good = mr.random_batch(3, g, packed=True)
    want, _ = mr.eager_reference(good)
    torch.testing.assert_close(runner.replay(good), want, rtol=1e-4, atol=1e-4)
    runner.shutdown()


@pytest.mark.parametrize("staged", [False, True])
def test_batches_of_device_fields_are_packed_in_one_launch_and_equal_eager(mr, staged):
    """A batch of device fields only is packed by one concatenation (int32 columns promoted):
    straight into the static rows unstaged, into the pinned slot through one D2H copy staged;
    at every bucket, the last with a block table narrower than the runner's."""
    cfg = RunnerConfig(max_bs=64, show_progress=False, pinned_staging=staged)
    runner = CudaGraphRunner(mr, cfg)
    g = torch.Generator().manual_seed(9)
    for bs in runner.capture_bs:
        batch = mr.random_batch(bs, g)  # fields only
        want, _ = mr.eager_reference(batch)
        torch.testing.assert_close(runner.replay(batch), want, rtol=1e-4, atol=1e-4)
    batch = mr.random_batch(5, g, max_len=2 * mr.page_size)  # two pages a request at most
    batch.block_table = batch.block_table[:, :2].contiguous()
    want, _ = mr.eager_reference(batch)
    torch.testing.assert_close(runner.replay(batch), want, rtol=1e-4, atol=1e-4)
    runner.shutdown()


@pytest.mark.parametrize("kind", ["host_rows", "device_packed", "device_fields"])
def test_a_staged_replay_makes_no_host_sync(mr, kind):
    """No batch kind's replay waits for the device on the host (torch's sync debug mode turns
    any synchronizing CUDA call into an error): host rows (numpy into the pinned slot), device
    rows (a D2H copy queued on the stream) and device fields (one concatenation, then that)."""
    runner = CudaGraphRunner(mr, RunnerConfig(max_bs=64, show_progress=False, pinned_staging=True))
    batch = mr.random_batch(3, torch.Generator().manual_seed(13), packed=kind != "device_fields")
    if kind == "device_packed":
        batch.packed_cpu = None
    runner.replay(batch)  # the first call builds its views and the bucket's state
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(4):
            runner.replay(batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert runner.stats.replays == 5
    runner.shutdown()
