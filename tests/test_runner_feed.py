"""The device token feed (``runner/feed.py``), host-only staged batches, skipped value checks
and staging's resync after hand replays, on the CPU stand-in against eager references."""

from __future__ import annotations

import pytest
import torch

from stepgraph.batch import pack_batch
from stepgraph.errors import ConfigError, ReplayError
from stepgraph.runner import CudaGraphRunner, RunnerConfig
from stepgraph.runner.feed import check_feed, feed_id, resolve_feed
from stepgraph.toy_model import ToyModelRunner

VOCAB = 97  # the toy's default vocabulary
FEED = 12


def _runner(mr, feed=None, **kw):
    return CudaGraphRunner(mr, RunnerConfig(max_bs=8, show_progress=False, **kw), feed=feed)


def _fed_batch(batch, rows):
    """``batch`` with row ``i`` reading ``feed[rows[i]]`` where ``rows[i]`` is not None."""
    ids = batch.input_ids.clone()
    for i, j in enumerate(rows):
        if j is not None:
            ids[i] = feed_id(j)
    batch.input_ids = ids
    batch.packed_cpu = pack_batch(batch)
    batch.packed = batch.packed_cpu.clone()
    return batch


def _resolved(batch, feed):
    ids = batch.input_ids.clone()
    neg = ids < 0
    ids[neg] = feed[-1 - ids[neg]]
    return ids


def test_resolve_feed_matches_a_python_gather():
    g = torch.Generator().manual_seed(0)
    feed = torch.randint(0, VOCAB, (FEED,), generator=g)
    ids = torch.tensor([5, feed_id(0), 0, feed_id(FEED - 1), feed_id(3), VOCAB - 1])
    want = [5, int(feed[0]), 0, int(feed[FEED - 1]), int(feed[3]), VOCAB - 1]
    resolve_feed(ids, feed)
    assert ids.tolist() == want


@pytest.mark.parametrize("staged", [False, True])
@pytest.mark.parametrize("packed", [True, False])
def test_fed_rows_replay_as_eager_on_the_resolved_ids(staged, packed):
    if staged and not packed:
        pytest.skip("staging stages packed rows")
    mr = ToyModelRunner(num_pages=160, seed=3)
    g = torch.Generator().manual_seed(4)
    feed = torch.randint(1, VOCAB, (FEED,), generator=g)
    runner = _runner(mr, feed=feed, pinned_staging=staged, packed_inputs=packed)
    for step, (bs, rows) in enumerate(
        [(5, [0, None, FEED - 1, 7, None]), (3, [2, 2, None]), (8, list(range(8)))]
    ):
        feed.copy_(torch.randint(1, VOCAB, (FEED,), generator=g))  # a new step's tokens
        batch = _fed_batch(mr.random_batch(bs, g), rows)
        eager = type(batch)(**{**batch.__dict__})
        eager.input_ids, eager.packed, eager.packed_cpu = _resolved(batch, feed), None, None
        want, _ = mr.eager_reference(eager)
        got = runner.replay(batch)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"step {step}")


def test_feed_limits_at_the_edge_and_one_past():
    mr = ToyModelRunner(num_pages=160, seed=5)
    feed = torch.randint(1, VOCAB, (FEED,), generator=torch.Generator().manual_seed(1))
    runner = _runner(mr, feed=feed)
    g = torch.Generator().manual_seed(6)
    runner.replay(_fed_batch(mr.random_batch(2, g), [FEED - 1, None]))  # -FEED: the last row
    with pytest.raises(ReplayError, match=r"input_ids\[0\] = -13 is outside \[-12, 97\)"):
        runner.replay(_fed_batch(mr.random_batch(2, g), [FEED, None]))
    bad = mr.random_batch(1, g)
    bad.input_ids = torch.tensor([VOCAB])
    bad.packed_cpu = pack_batch(bad)
    with pytest.raises(ReplayError, match="input_ids"):
        runner.replay(bad)


def test_without_a_feed_a_negative_id_is_refused():
    mr = ToyModelRunner(num_pages=160, seed=5)
    runner = _runner(mr)
    batch = _fed_batch(mr.random_batch(2, torch.Generator().manual_seed(2)), [0, None])
    with pytest.raises(ReplayError, match=r"input_ids\[0\] = -1 is outside \[0, 97\)"):
        runner.replay(batch)


@pytest.mark.parametrize(
    "feed, match",
    [
        ([1, 2], "must be a torch.Tensor"),
        (torch.zeros(4, dtype=torch.int32), "1-D int64"),
        (torch.zeros(4, dtype=torch.bool), "1-D int64"),
        (torch.zeros(2, 2, dtype=torch.int64), "1-D int64"),
        (torch.zeros(0, dtype=torch.int64), "at least one row"),
        (torch.zeros(8, dtype=torch.int64)[::2], "contiguous"),
    ],
)
def test_bad_feeds_are_refused_by_name(feed, match):
    with pytest.raises(ConfigError, match=match):
        check_feed(feed, torch.device("cpu"))


def test_values_checked_skips_the_value_checks_and_only_then():
    mr = ToyModelRunner(num_pages=160, seed=7)
    runner = _runner(mr)
    batch = mr.random_batch(2, torch.Generator().manual_seed(3), packed=True)
    batch.packed_cpu = batch.packed_cpu.clone()
    batch.packed_cpu[1, 0] = VOCAB  # a bad host row, never copied (the device rows are fine)
    with pytest.raises(ReplayError, match=r"input_ids\[1\] = 97"):
        runner.replay(batch)
    batch.values_checked = True  # the builder vouches: no check runs
    want, _ = mr.eager_reference(batch)
    torch.testing.assert_close(runner.replay(batch), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "value, cuda, packed, stages",
    [
        (None, True, True, True),
        (None, False, True, False),
        (None, True, False, False),
        (True, False, True, True),
        (False, True, True, False),
    ],
)
def test_pinned_staging_default_is_on_for_cuda_graphs_of_packed_inputs(value, cuda, packed, stages):
    cfg = RunnerConfig(pinned_staging=value, packed_inputs=packed, show_progress=False)
    assert cfg.stages(cuda) is stages


@pytest.mark.parametrize("value", [1, 0, "yes"])  # 1 == True in Python: refused all the same
def test_pinned_staging_takes_a_bool_or_none(value):
    with pytest.raises(ConfigError, match="pinned_staging must be True, False or None"):
        RunnerConfig(pinned_staging=value)


def test_a_staged_runner_replays_a_batch_of_host_rows_only():
    mr = ToyModelRunner(num_pages=160, seed=9)
    runner = _runner(mr, pinned_staging=True)
    g = torch.Generator().manual_seed(8)
    for bs in (3, 7, 1):
        batch = mr.random_batch(bs, g, packed=True)
        want, _ = mr.eager_reference(batch)
        batch.packed = None
        batch.input_ids = torch.full((bs,), -5)  # fields unread: poisoned to prove it
        got = runner.replay(batch)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_staging_counts_hand_replays_back_in():
    mr = ToyModelRunner(num_pages=160, seed=10)
    runner = _runner(mr, pinned_staging=True)
    g = torch.Generator().manual_seed(9)
    runner.replay(mr.random_batch(2, g, packed=True))
    for hand in (1, 2, 3):  # an odd count flips the parity the host would assume
        for _ in range(hand):
            runner.graphs[2].replay()  # a bare launch, as benchmarks time it
        batch = mr.random_batch(2, g, packed=True)
        want, _ = mr.eager_reference(batch)
        torch.testing.assert_close(runner.replay(batch), want, rtol=1e-5, atol=1e-5)
    assert runner._staging.resyncs == 3
