"""Faults leak nothing: a step that raises (prefill, decode or sampling) drops every waiting
and running request and frees its pages; bad sampling arguments are refused before anything
is queued; failed generates can never fill a small cache and hang the next call."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from stepgraph.engine import Engine, Sampling
from stepgraph.errors import ConfigError
from stepgraph.model import ModelRunner
from stepgraph.runner import RunnerConfig

from .guards import assert_kv_unchanged, fill_kv_random, kv_snapshot, time_limit

VOCAB = 512


def _runner(num_pages: int = 16, max_bs: int = 4) -> ModelRunner:
    # 16 pages of 16 tokens: 15 usable, each request below takes 2 or 3 of them
    return ModelRunner.from_preset(
        "tiny",
        "cpu",
        torch.float32,
        seed=5,
        max_bs=max_bs,
        max_context_len=64,
        num_pages=num_pages,
    )


def _engine(mode: str, mr: ModelRunner) -> Engine:
    if mode == "eager":
        return Engine(mr, "eager")
    return Engine(mr, "graph", RunnerConfig(max_bs=4, show_progress=False))


def _prompts(seed: int, n: int = 4) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 30, (n,), generator=g).tolist()
    return [torch.randint(1, VOCAB, (k,), generator=g).tolist() for k in lengths]


def _assert_clean(engine: Engine, free: int, held_outside: bool = False) -> None:
    """No page held: every page is free or cached and unreferenced, and free once cleared
    (``held_outside``: the test holds allocator pages the cache does not know)."""
    assert not engine.waiting and not engine.running
    cache = engine.prefix_cache
    if not held_outside:
        cache.check()
    assert cache.num_available == free and not cache._tree.refs
    cache.clear()
    assert engine.model_runner.kv_cache.allocator.num_free == free
    assert not engine.has_unfinished


def test_failed_generates_never_fill_a_small_cache_and_the_next_call_runs():
    """16 pages, max_bs 4, eight generates with top_k=0, then a valid
    one. Each bad call is a ConfigError before anything is queued; the valid one finishes."""
    mr = _runner()
    engine = _engine("eager", mr)
    fill_kv_random(mr.kv_cache, seed=1)
    kv, free = kv_snapshot(mr.kv_cache), mr.kv_cache.allocator.num_free
    prompts = _prompts(0)
    with time_limit(20):
        for _ in range(8):
            with pytest.raises(ConfigError, match="top_k"):
                engine.generate(prompts, 8, temperature=1.0, top_k=0)
        assert engine.stats.prefills == 0 and engine.stats.decode_tokens == 0
        assert_kv_unchanged(mr.kv_cache, kv)
        _assert_clean(engine, free)
        out = engine.generate(prompts, 8, temperature=1.0, top_k=5, seed=3)
    assert [len(o) for o in out] == [8] * 4
    _assert_clean(engine, free)


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(temperature=-1.0), "temperature"),
        (dict(temperature=1.0, top_k=-5), "top_k"),
        (dict(temperature=1.0, top_k=2.5), "top_k"),
    ],
)
def test_bad_sampling_is_refused_before_anything_runs(kw, match):
    mr = _runner()
    engine = _engine("eager", mr)
    fill_kv_random(mr.kv_cache, seed=2)
    kv, free = kv_snapshot(mr.kv_cache), mr.kv_cache.allocator.num_free
    with time_limit(20), pytest.raises(ConfigError, match=match):
        engine.generate(_prompts(1), 4, **kw)
    assert_kv_unchanged(mr.kv_cache, kv)
    _assert_clean(engine, free)
    assert engine.stats.prefills == 0 and not engine.finished
    with pytest.raises(ConfigError, match=match):
        Sampling(**kw)


@pytest.mark.parametrize(
    "prompt,n,match",
    [
        ([1, 2, VOCAB], 4, "outside"),
        ([1, "2"], 4, "not a list of token ids: it holds str"),
        ([], 4, "empty"),
        ([1, 2], 0, "max_new_tokens"),
        ([1, 2], 2.0, "max_new_tokens"),
    ],
)
def test_bad_requests_are_refused_and_leave_state_alone(prompt, n, match):
    mr = _runner()
    engine = _engine("eager", mr)
    fill_kv_random(mr.kv_cache, seed=3)
    kv, free = kv_snapshot(mr.kv_cache), mr.kv_cache.allocator.num_free
    with time_limit(20), pytest.raises(ConfigError, match=match):
        engine.generate([[5, 6, 7], prompt], n)
    assert_kv_unchanged(mr.kv_cache, kv)
    _assert_clean(engine, free)


def test_prompt_beyond_max_position_embeddings_is_refused():
    mr = ModelRunner.from_preset("tiny", "cpu", torch.float32, seed=5, max_bs=2, max_context_len=64)
    mr.config = dataclasses.replace(mr.config, max_position_embeddings=32)
    engine = _engine("eager", mr)
    with pytest.raises(ConfigError, match="max_position_embeddings=32"):
        engine.generate([list(range(1, 31))], 4)  # 33 positions
    _assert_clean(engine, mr.kv_cache.allocator.num_free)


def test_max_running_must_be_positive():
    with pytest.raises(ConfigError, match="max_running"):
        Engine(_runner(), "eager", max_running=0)


class _FaultOnCall:
    """Wraps the model's forward; raises on call number ``at`` (1-based) after ``arm()``."""

    def __init__(self, forward, at: int) -> None:
        self.forward, self.at, self.calls = forward, at, None

    def arm(self) -> None:
        self.calls = 0

    def __call__(self, *args, **kwargs):
        if self.calls is not None:
            self.calls += 1
            if self.calls == self.at:
                self.calls = None
                raise RuntimeError("injected fault")
        return self.forward(*args, **kwargs)


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_fault_on_third_forward_twelve_times_leaks_nothing(mode):
    mr = _runner()
    engine = _engine(mode, mr)
    free = mr.kv_cache.allocator.num_free
    fault = _FaultOnCall(mr.model.forward, at=3)
    mr.model.forward = fault  # instance attribute: nn.Module.__call__ finds it
    prompts = _prompts(7)
    with time_limit(30):
        for i in range(12):
            fault.arm()
            with pytest.raises(RuntimeError, match="injected fault"):
                engine.generate(prompts[: 1 + i % 4], 6, temperature=float(i % 2), seed=i)
            _assert_clean(engine, free)
            assert not engine.finished
        out = engine.generate(prompts, 6)
    fresh = _engine(mode, _runner()).generate(prompts, 6)
    assert out == fresh
    _assert_clean(engine, free)


def test_fault_in_sampling_aborts_added_requests(monkeypatch):
    mr = _runner()
    engine = _engine("eager", mr)
    free = mr.kv_cache.allocator.num_free
    for p in _prompts(9):
        engine.add_request(p, 5)
    engine.step()

    def broken(self, logits, generator):
        raise RuntimeError("sampling fault")

    monkeypatch.setattr(Sampling, "sample", broken)
    with time_limit(20), pytest.raises(RuntimeError, match="sampling fault"):
        engine.step()
    _assert_clean(engine, free)


def test_nothing_admissible_and_nothing_running_raises_instead_of_spinning():
    mr = _runner()
    engine = _engine("eager", mr)
    held = mr.kv_cache.allocator.allocate(14)  # pages held outside the engine: 1 free
    engine.add_request(_prompts(4)[0] + [1] * 20, 8)  # needs more than one page
    with time_limit(20), pytest.raises(ConfigError, match="pages"):
        engine.step()
    _assert_clean(engine, 1, held_outside=True)
    mr.kv_cache.release(held)
    assert math.isfinite(engine.generate([[1, 2, 3]], 2)[0][0])
