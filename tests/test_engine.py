"""The engine on the tiny presets: eager and graph (CPU stand-in) modes give identical tokens,
also while the batch shrinks and grows across buckets and when it outgrows the largest bucket;
seeded sampling is reproducible; admission errors leave other requests alone."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("stepgraph.runner")

from stepgraph.engine import Engine, Sampling  # noqa: E402
from stepgraph.errors import ConfigError  # noqa: E402
from stepgraph.model import ModelRunner  # noqa: E402
from stepgraph.runner import RunnerConfig  # noqa: E402

VOCAB = 512


def _runner(preset: str = "tiny", **kw) -> ModelRunner:
    kw.setdefault("max_bs", 8)
    return ModelRunner.from_preset(preset, "cpu", torch.float32, seed=3, max_context_len=96, **kw)


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in lengths]


def _graph_engine(mr: ModelRunner, max_bs: int = 8, **kw) -> Engine:
    return Engine(mr, "graph", RunnerConfig(max_bs=max_bs, show_progress=False), **kw)


def _run_schedule(engine: Engine, schedule: dict[int, list[tuple[list[int], int]]]):
    """Add ``schedule[step]`` requests before that step; run to completion. Returns the
    outputs by request order and the live batch size of every decode step."""
    rids, sizes, step = [], [], 0
    while step <= max(schedule) or engine.has_unfinished:
        for prompt, n in schedule.get(step, []):
            rids.append(engine.add_request(prompt, n))
        sizes.append(sum(1 for r in engine.running if r.output))
        engine.step()
        step += 1
    return [engine.finished[r].output for r in rids], sizes


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen2"])
def test_graph_matches_eager(preset):
    prompts = _prompts([3, 11, 29, 6, 47])
    eager = Engine(_runner(preset), "eager")
    graph = _graph_engine(_runner(preset))
    a = eager.generate(prompts, max_new_tokens=12)
    b = graph.generate(prompts, max_new_tokens=12)
    assert a == b
    assert graph.stats.graph_steps == 11 and graph.stats.eager_steps == 0
    assert eager.runner is None and eager.stats.eager_steps == 11
    assert sum(len(set(t)) for t in a) > 25  # real continuations, not one repeated token


def test_batch_shrinks_and_grows_across_buckets():
    p = _prompts([5, 13, 2, 31, 8, 17, 4], seed=1)
    # 5 requests finishing at different steps (bucket 8 -> 4 -> 2 -> 1), then 2 late arrivals
    schedule = {0: [(p[0], 3), (p[1], 7), (p[2], 12), (p[3], 16), (p[4], 5)]}
    schedule[14] = [(p[5], 6), (p[6], 9)]
    a, sizes_a = _run_schedule(Engine(_runner(), "eager"), schedule)
    graph = _graph_engine(_runner())
    b, sizes_b = _run_schedule(graph, schedule)
    assert a == b and sizes_a == sizes_b
    assert {5, 4, 3, 2, 1} <= set(sizes_b) and sizes_b.index(1) < len(sizes_b) - 1 - sizes_b[
        ::-1
    ].index(3)  # the batch grew back after shrinking to one
    replays = {bs: g.replays for bs, g in graph.runner.graphs.items()}
    assert all(replays[bs] > 0 for bs in (1, 2, 4, 8)), replays
    assert graph.stats.eager_steps == 0


def test_batch_above_largest_bucket_runs_eagerly():
    prompts = _prompts([4, 9, 15, 22, 30], seed=2)
    news = [2, 4, 6, 8, 10]  # five requests, then fewer; runner captures only up to 2
    ref, _ = _run_schedule(Engine(_runner(), "eager"), {0: list(zip(prompts, news))})
    graph = _graph_engine(_runner(), max_bs=2)
    got, sizes = _run_schedule(graph, {0: list(zip(prompts, news))})
    assert got == ref
    assert graph.stats.eager_steps == sum(1 for s in sizes if s > 2)
    assert graph.stats.graph_steps == sum(1 for s in sizes if 0 < s <= 2) > 0
    assert graph.runner.stats.fallbacks["too_large"] == graph.stats.eager_steps


def test_seeded_sampling_is_reproducible():
    prompts = _prompts([7, 19, 3], seed=4)
    engine = Engine(_runner(), "eager")
    kw = dict(max_new_tokens=10, temperature=1.0, top_k=50)
    a = engine.generate(prompts, seed=123, **kw)
    b = engine.generate(prompts, seed=123, **kw)
    c = engine.generate(prompts, seed=124, **kw)
    greedy = engine.generate(prompts, max_new_tokens=10)
    assert a == b and a != c and a != greedy
    assert engine.generate(prompts, max_new_tokens=10, temperature=1.0, top_k=1, seed=5) == greedy
    # graph mode samples the same logits with the same generator: the same tokens
    assert _graph_engine(_runner()).generate(prompts, seed=123, **kw) == a


def test_sampling_follows_the_distribution():
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]]).repeat(20000, 1)
    g = torch.Generator().manual_seed(0)
    counts = torch.bincount(Sampling(1.0).sample(logits, g), minlength=4).float() / 20000
    assert torch.allclose(counts, torch.softmax(logits[0], -1), atol=0.01)
    top2 = Sampling(1.0, top_k=2).sample(logits, g)
    assert set(top2.tolist()) == {1, 2}


def test_admission_error_leaves_others_unaffected():
    mr = _runner(max_bs=4)  # 4 requests of 96 tokens fit the cache
    prompts = _prompts([6, 14], seed=5)
    ref = Engine(_runner(max_bs=4), "eager").generate(prompts, max_new_tokens=8)
    engine = _graph_engine(mr, max_bs=4)
    free = mr.kv_cache.allocator.num_free
    with pytest.raises(ConfigError, match="prompt 1 .*max_context_len"):
        engine.generate([prompts[0], [1] * 90, prompts[1]], max_new_tokens=8)
    assert mr.kv_cache.allocator.num_free == free and not engine.has_unfinished
    # mid-run: a request that can never fit is refused; the running ones finish as before
    rids = [engine.add_request(p, 8) for p in prompts]
    engine.step()
    engine.step()
    with pytest.raises(ConfigError, match="max_context_len"):
        engine.add_request([2] * 95, 8)
    with pytest.raises(ConfigError, match="outside"):
        engine.add_request([VOCAB], 8)
    while engine.has_unfinished:
        engine.step()
    assert [engine.finished[r].output for r in rids] == ref
    assert engine.prefix_cache.num_available == free  # free, or cached and unreferenced
    engine.prefix_cache.clear()
    assert mr.kv_cache.allocator.num_free == free


def test_requests_wait_for_pages():
    """More requests than the cache holds at once: later ones wait, then run; same tokens."""
    prompts = _prompts([10, 20, 30, 12], seed=6)
    ref = Engine(_runner(), "eager").generate(prompts, max_new_tokens=6)
    small = _runner(num_pages=9)  # 8 usable pages of 16 tokens
    engine = _graph_engine(small)
    assert engine.generate(prompts, max_new_tokens=6) == ref
    assert engine.prefix_cache.num_available == 8
    engine.prefix_cache.clear()
    assert small.kv_cache.allocator.num_free == 8


def test_bad_mode():
    with pytest.raises(ConfigError, match="mode"):
        Engine(_runner(), "fast")


def test_each_step_counts_its_wall_time_as_prefilling_or_decode_only(monkeypatch):
    """EngineStats: every step() call once, its time under the steps that ran a prefill forward
    or under the others, from one clock read at its start and one at its end."""
    import stepgraph.engine.engine as engine_module

    ticks = iter(range(0, 10**6, 1))
    clock = type("Clock", (), {"perf_counter": staticmethod(lambda: next(ticks) * 1.0)})
    monkeypatch.setattr(engine_module, "time", clock)
    engine = Engine(_runner(), "eager", max_prefill_tokens=16, overlap=False)
    engine.add_request(_prompts([40])[0], 3)  # 3 prefill steps of 16, 16 and 8 tokens
    steps = 0
    while engine.has_unfinished:
        engine.step()
        steps += 1
    s = engine.stats
    assert (s.steps, s.prefill_steps, s.decode_steps) == (steps, 3, 2) and steps == 5
    assert (s.prefill_step_s, s.decode_step_s) == (3.0, 2.0)  # one tick a step


def test_a_request_is_compared_by_identity():
    """The engine finds a request in its lists by identity: closing one of 512 running compared
    every field of each request before it (a dataclass's ``__eq__``), twice."""
    from stepgraph.engine.requests import Request

    a, twin = Request(0, [1, 2], 4), Request(0, [1, 2], 4)
    assert a != twin and a == a
    running = [twin, a]
    assert running.index(a) == 1
    running.remove(a)
    assert running == [twin] and a not in running
    assert len({a, twin}) == 2  # hashable, by identity
