"""`stepgraph.bucket_plan`: the dynamic programme against brute force, never worse than the
default power-of-two set at the same maximum, trace parsing."""

from __future__ import annotations

import itertools
import random

import pytest

from stepgraph.bucket_plan import padding_waste, plan_buckets, read_trace
from stepgraph.buckets import default_capture_sizes
from stepgraph.errors import ConfigError


def _random_trace(rng: random.Random, max_bs: int, steps: int) -> list[int]:
    """Skewed like serving: a few hot sizes, a tail of others; the max always occurs."""
    hot = rng.sample(range(1, max_bs + 1), k=min(3, max_bs))
    trace = [
        rng.choice(hot) if rng.random() < 0.6 else rng.randint(1, max_bs) for _ in range(steps)
    ]
    return [*trace, max_bs]


def _brute_force(trace: list[int], max_graphs: int) -> float:
    """Best padded rows over EVERY set of <= max_graphs integers in 1..max holding the max
    (not only observed sizes: this also checks that restriction loses nothing)."""
    top = max(trace)
    best = float("inf")
    for k in range(0, max_graphs):
        for rest in itertools.combinations(range(1, top), k):
            buckets = [*rest, top]
            best = min(best, padding_waste(trace, buckets))
    return best


@pytest.mark.parametrize("seed", range(12))
def test_dp_equals_brute_force(seed):
    rng = random.Random(seed)
    max_bs = rng.randint(2, 11)
    trace = _random_trace(rng, max_bs, rng.randint(5, 40))
    max_graphs = rng.randint(1, 4)
    plan = plan_buckets(trace, max_graphs)
    assert plan.buckets[-1] == max_bs
    assert len(plan.buckets) <= max_graphs
    assert plan.buckets == sorted(set(plan.buckets))
    assert plan.padding_waste == pytest.approx(padding_waste(trace, plan.buckets))
    assert plan.padding_waste == pytest.approx(_brute_force(trace, max_graphs), rel=1e-12)


@pytest.mark.parametrize("seed", range(8))
def test_never_worse_than_default_at_same_max(seed):
    rng = random.Random(100 + seed)
    max_bs = rng.choice([7, 16, 33, 64, 100])
    trace = _random_trace(rng, max_bs, 300)
    default = default_capture_sizes(max_bs)
    plan = plan_buckets(trace, len(default))
    assert plan.default_buckets == default
    assert plan.default_padding_waste == pytest.approx(padding_waste(trace, default))
    assert plan.padding_waste <= plan.default_padding_waste + 1e-12
    assert plan.padding_waste >= 1.0


def test_hot_sizes_get_their_own_bucket():
    # 90% of steps at 5, the rest at 12: two graphs should be exactly {5, 12}, waste 1.0
    trace = [5] * 90 + [12] * 10
    plan = plan_buckets(trace, 2)
    assert plan.buckets == [5, 12]
    assert plan.padding_waste == 1.0
    assert plan.default_padding_waste > 1.2  # default pads 5 -> 8, 12 -> 12
    assert plan_buckets(trace, 1).buckets == [12]
    assert plan_buckets(trace, 9).buckets == [5, 12]  # more graphs than sizes: no extras


def test_read_trace_formats_and_errors():
    assert read_trace("3\n\n5  # busy\n3\n") == {3: 2, 5: 1}
    assert read_trace("[1, 4, 4]") == {1: 1, 4: 2}
    with pytest.raises(ConfigError, match="line 2"):
        read_trace("3\nfour\n")
    with pytest.raises(ConfigError, match="non-positive"):
        read_trace("[1, 0]")
    with pytest.raises(ConfigError, match="empty"):
        read_trace("# nothing\n")
    with pytest.raises(ConfigError, match="max_graphs"):
        plan_buckets([1, 2], 0)


def test_runner_config_takes_the_plan():
    RunnerConfig = pytest.importorskip("stepgraph.runner").RunnerConfig
    plan = plan_buckets([3, 3, 9, 17, 17, 17], 3)
    config = RunnerConfig(capture_bs=plan.buckets)
    assert list(config.buckets()) == plan.buckets
