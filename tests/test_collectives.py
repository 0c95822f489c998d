"""The in-graph all-reduce measurement's logic on the CPU (the figures need two GPUs)."""

from __future__ import annotations

import pytest
import torch

from stepgraph.bench import collectives
from stepgraph.model import parallel
from stepgraph.model.model_runner import ModelRunner


def test_without_all_reduce_skips_the_collective_and_restores_it():
    x = torch.ones(3)
    real = parallel._all_reduce
    with collectives.without_all_reduce():
        assert parallel._all_reduce(x, None, 2) is x  # world 2, no process group: no call made
    assert parallel._all_reduce is real
    with pytest.raises(RuntimeError, match="boom"), collectives.without_all_reduce():
        raise RuntimeError("boom")
    assert parallel._all_reduce is real


def test_split_step_figures():
    s = collectives.split_step(2.0, 1.5, n_calls=5)
    assert s["allreduce_us"] == 500.0 and s["allreduce_us_per_call"] == 100.0
    assert s["allreduce_share"] == 0.25 and s["step_ms"] == 2.0
    assert collectives.split_step(1.0, 1.2, 5)["allreduce_us"] == 0.0  # noise: never negative


def test_allreduce_in_graph_captures_both_graphs_and_frees_the_pages():
    mr = ModelRunner.from_preset("tiny", "cpu", torch.float32, seed=1, max_bs=4, max_context_len=64)
    free = mr.kv_cache.allocator.num_free
    fake = iter([3.0, 2.0, 5.0, 4.5])  # with, without; per batch size
    seen = []

    def time_ms(fn):
        fn()  # a replay of the stand-in graph
        seen.append(parallel._all_reduce is not collectives._no_all_reduce)
        return next(fake)

    out = collectives.allreduce_in_graph(mr, [1, 4], context=32, time_ms=time_ms)
    n = 2 * mr.config.num_layers + 1
    assert out[1]["allreduce_us"] == 1000.0 and out[4]["allreduce_us"] == 500.0
    assert out[1]["allreduce_us_per_call"] == round(1000.0 / n, 2)
    assert all(seen)  # the switch is off again by the time replays are timed
    assert mr.kv_cache.allocator.num_free == free
