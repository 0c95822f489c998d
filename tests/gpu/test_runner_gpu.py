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
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
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
    out = runner.replay(mr.random_batch(3, g))
    assert out.data_ptr() == runner.output_buffers[4].data_ptr()
    before = out.clone()
    runner.replay(mr.random_batch(3, g))
    assert not torch.equal(out, before)


def test_capture_stats_are_recorded(runner):
    stats = runner.stats.capture
    assert [b.bs for b in stats.buckets] == sorted(runner.capture_bs, reverse=True)
    assert stats.pool_bytes > 0 and stats.seconds > 0
