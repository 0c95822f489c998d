"""One thread drives a runner: a call from a thread other than the creator's raises
ReplayError naming the rule (static outputs; one runner per thread, or serialize and opt out),
and leaves the runner, the engine's requests and the KV cache as they were. With the opt-out,
serialized calls from another thread give eager's results."""

from __future__ import annotations

import threading

import pytest
import torch

from stepgraph.configs import PiecewiseRunner  # noqa: F401  (one base: the rule covers it)
from stepgraph.engine import Engine
from stepgraph.errors import ReplayError
from stepgraph.model import ModelRunner
from stepgraph.model.decode.graph_walks import build_decode_graph_runner
from stepgraph.runner import CudaGraphRunner, RunnerConfig
from stepgraph.toy_model import ToyModelRunner

from .guards import assert_kv_unchanged, fill_kv_random, kv_snapshot, time_limit


def _in_thread(fn):
    """``fn()`` in a new thread; its result or exception."""
    box = {}

    def body():
        try:
            box["result"] = fn()
        except BaseException as e:
            box["error"] = e

    t = threading.Thread(target=body, name="other-thread")
    t.start()
    t.join(20)
    assert not t.is_alive(), "thread hung"
    return box.get("result"), box.get("error")


def test_replay_from_another_thread_is_refused_then_allowed_when_opted_out():
    toy = ToyModelRunner(num_pages=40, page_size=4, max_pages_per_request=4)
    runner = CudaGraphRunner(toy, RunnerConfig(max_bs=4, show_progress=False))
    batch = toy.random_batch(3, torch.Generator().manual_seed(1), packed=True)
    kv = [c.clone() for c in toy.kv]
    with time_limit(30):
        _, err = _in_thread(lambda: runner.replay(batch))
        assert isinstance(err, ReplayError)
        assert "other-thread" in str(err) and "check_same_thread = False" in str(err)
        assert runner.stats.replays == 0 and all(torch.equal(a, b) for a, b in zip(kv, toy.kv))
        expected = runner.replay(batch).clone()  # the owner thread still works
        for c, k in zip(toy.kv, kv):
            c.copy_(k)
        runner.check_same_thread = False
        out, err = _in_thread(lambda: runner.replay(batch).clone())
    assert err is None and torch.equal(out, expected)


def test_two_threads_on_one_runner_one_gets_an_error_not_wrong_results():
    toy = ToyModelRunner(num_pages=40, page_size=4, max_pages_per_request=4)
    runner = CudaGraphRunner(toy, RunnerConfig(max_bs=4, show_progress=False))
    g = torch.Generator().manual_seed(2)
    batches = [toy.random_batch(2, g, packed=True) for _ in range(2)]
    with time_limit(30):
        ok = [runner.replay(batches[0]).clone() for _ in range(5)]
        _, err = _in_thread(lambda: [runner.replay(batches[1]) for _ in range(5)])
    assert isinstance(err, ReplayError) and runner.stats.replays == 5
    assert all(torch.equal(o, ok[0]) for o in ok)


def test_config_runner_remembers_its_thread():
    mr = ModelRunner.from_preset("tiny", "cpu", torch.float32, 2, max_bs=2, max_context_len=32)
    walks, runner = build_decode_graph_runner(mr, capture_batch_sizes=[1, 2], show_progress=False)
    pages = mr.kv_cache.reserve(4)
    batch = mr.decode_batch([5], [2], [pages])
    _, err = _in_thread(lambda: runner.run("decode", walks.requests(batch)))
    assert isinstance(err, ReplayError) and "ConfigGraphRunner" in str(err)


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_engine_refuses_other_threads_and_keeps_its_requests(mode):
    mr = ModelRunner.from_preset("tiny", "cpu", torch.float32, 4, max_bs=4, max_context_len=64)
    config = RunnerConfig(max_bs=4, show_progress=False) if mode == "graph" else None
    engine = Engine(mr, mode, config)
    fill_kv_random(mr.kv_cache, seed=4)
    rid = engine.add_request([3, 9, 27, 81], 6)
    engine.step()
    kv, free = kv_snapshot(mr.kv_cache), mr.kv_cache.allocator.num_free
    stats = (engine.stats.prefills, engine.stats.decode_tokens)
    with time_limit(30):
        for call in (
            engine.step,
            lambda: engine.add_request([1], 2),
            lambda: engine.generate([[1]], 2),
        ):
            _, err = _in_thread(call)
            assert isinstance(err, ReplayError) and "Engine" in str(err)
        assert_kv_unchanged(mr.kv_cache, kv)
        assert mr.kv_cache.allocator.num_free == free and len(engine.running) == 1
        assert (engine.stats.prefills, engine.stats.decode_tokens) == stats
        while engine.has_unfinished:
            engine.step()
    assert len(engine.finished[rid].output) == 6
    engine.check_same_thread = False  # serialized by join: allowed, runner included
    out, err = _in_thread(lambda: engine.generate([[3, 9, 27, 81]], 6))
    assert err is None and out == [engine.finished[rid].output]
