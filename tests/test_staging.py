"""Pinned staging on the CPU stand-in: replay equals eager under a random walk of batch sizes,
the slot parity follows the host's count, and no slot is written before its copy ran."""

from __future__ import annotations

import pytest
import torch

from stepgraph.batch import pack_batch
from stepgraph.errors import ConfigError
from stepgraph.runner import CudaGraphRunner, RunnerConfig
from stepgraph.runner.input_buffers import pad_row
from stepgraph.runner.staging import PinnedStaging
from stepgraph.toy_model import ToyModelRunner

CFG = RunnerConfig(max_bs=16, show_progress=False, pinned_staging=True)


def test_staging_needs_packed_inputs():
    with pytest.raises(ConfigError, match="packed_inputs=True"):
        RunnerConfig(pinned_staging=True, packed_inputs=False)


@pytest.mark.parametrize("packed", [True, False])
def test_random_walk_of_batch_sizes_equals_eager(packed):
    mr = ToyModelRunner(num_pages=160, seed=11)
    runner = CudaGraphRunner(mr, CFG)
    staging = runner._staging
    assert staging.count == 0 and int(staging.parity) == 0
    g = torch.Generator().manual_seed(7)
    sizes = [16, 1, 9, 3, 16, 2, 5, 5, 12, 1, 8, 7]  # grow and shrink across buckets
    for k, bs in enumerate(sizes):
        batch = mr.random_batch(bs, g, packed=packed)
        want, want_state = mr.eager_reference(batch)
        got = runner.replay(batch)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for have, ref in zip(mr.kv, want_state):  # padded rows wrote only into scratch page 0
            torch.testing.assert_close(have[mr.page_size :], ref[mr.page_size :])
        assert staging.count == k + 1 and int(staging.parity) == (k + 1) % 2
        assert int(staging.copied) == k + 1  # the in-graph copy count, mirrored on the host
        bucket = min(b for b in runner.capture_bs if b >= bs)
        slot = k % 2  # the slot this replay read: live rows, then padding up to the bucket
        torch.testing.assert_close(staging.rows(slot)[:bs], pack_batch(batch).cpu())
        assert (staging.rows(slot)[bs:bucket] == staging.pad).all()


def test_a_slot_is_not_overwritten_before_its_copy_ran():
    mr = ToyModelRunner(num_pages=160, seed=2)
    width = mr.max_pages_per_request + 4
    staging = PinnedStaging(pad_row(mr.max_pages_per_request, 1, torch.device("cpu")), 8, mr.device)
    assert staging.host.shape == (8, 2, width)
    seen_at_wait = []

    def gpu_catches_up():  # the wait's pause: replay 0 copies its slot now
        seen_at_wait.append(staging.rows(0).clone())
        staging.copied[0] = 1

    staging.pause = gpu_catches_up
    g = torch.Generator().manual_seed(3)
    a, b, c = (mr.random_batch(4, g, packed=True) for _ in range(3))
    staging.stage(a, 4)  # replay 0 reads slot 0; nothing has been copied yet (copied = 0)
    staging.replayed()
    staging.stage(b, 4)  # slot 1: free, no wait
    staging.replayed()
    assert staging.waits == 0 and seen_at_wait == []
    staging.stage(c, 4)  # slot 0 again: must wait for replay 0's copy before writing
    assert staging.waits == 1 and len(seen_at_wait) == 1
    torch.testing.assert_close(seen_at_wait[0][:4], pack_batch(a))  # still a's rows then
    torch.testing.assert_close(staging.rows(0)[:4], pack_batch(c))
    torch.testing.assert_close(staging.rows(1)[:4], pack_batch(b))
