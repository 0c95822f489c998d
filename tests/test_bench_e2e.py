"""The bench's ``engine`` mode on the CPU: the overlapped Engine's decode-only steps are timed
at each point (prompts ending E2E_NEW_TOKENS short of the context), points past the limit are
skipped, and a failure is a reported row, not a crash."""

from __future__ import annotations

import math

import torch

from stepgraph.bench import e2e
from stepgraph.bench.workload import Point
from stepgraph.model import ModelRunner


def _mr() -> ModelRunner:
    return ModelRunner.from_preset(
        "tiny", "cpu", torch.float32, seed=1, max_bs=3, max_context_len=128
    )


def test_engine_rows_time_decode_only_steps(monkeypatch):
    monkeypatch.setattr(e2e, "E2E_MAX_CONTEXT", 64)
    mr = _mr()
    free = mr.kv_cache.allocator.num_free
    steps = []
    decode = e2e.decode_step_ms

    def spy(engine, prompts, new):
        steps.append((len(prompts), {len(p) for p in prompts}))
        return decode(engine, prompts, new)

    monkeypatch.setattr(e2e, "decode_step_ms", spy)
    res = e2e.run_engine(mr, [Point(1, 40), Point(3, 64), Point(2, 65)])
    assert res.error is None
    assert set(res.ms_per_token) == {Point(1, 40), Point(3, 64)}  # 65 > the limit: skipped
    assert all(ms > 0 and math.isfinite(ms) for ms in res.ms_per_token.values())
    # warm-up, then timed; prompts end E2E_NEW_TOKENS + one prefill step short of the context
    assert steps == [(1, {7}), (1, {7}), (3, {31}), (3, {31})]
    assert mr.kv_cache.allocator.num_free == free


def test_requests_outlast_a_prefill_of_many_steps(monkeypatch):
    """At 4 prompt tokens a step, three prompts of 68 (32 new tokens alone) take 51 steps: the
    first request finishes before the last starts (the next test). Asking for 62 new tokens,
    the prompts are 38 tokens, 29 steps, and 32 steps run all three decoding."""
    monkeypatch.setattr(e2e, "E2E_MAX_CONTEXT", 128)
    assert e2e.new_tokens_for(Point(3, 100), 4) == 62
    assert e2e.new_tokens_for(Point(1, 40), 8192) == 33
    full = []
    decode = e2e.decode_step_ms

    def spy(engine, prompts, new):
        ms = decode(engine, prompts, new)
        full.append(ms)
        return ms

    monkeypatch.setattr(e2e, "decode_step_ms", spy)
    res = e2e.run_engine(_mr(), [Point(3, 100)], max_prefill_tokens=4)
    assert res.error is None and math.isfinite(res.ms_per_token[Point(3, 100)])
    assert len(full) == 2 and all(math.isfinite(ms) for ms in full)


def test_with_32_new_tokens_alone_that_point_had_no_full_step():
    mr = _mr()
    from stepgraph.engine import Engine
    from stepgraph.runner import RunnerConfig

    engine = Engine(
        mr,
        "graph",
        RunnerConfig(capture_bs=[3], show_progress=False),
        max_running=3,
        max_prefill_tokens=4,
    )
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(1, mr.config.vocab_size, (3, 100 - 32), generator=g).tolist()
    try:
        assert math.isnan(e2e.decode_step_ms(engine, prompts, 32))
    finally:
        engine.shutdown()


def test_a_failing_engine_is_a_reported_row(monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("no engine today")

    monkeypatch.setattr(e2e, "decode_step_ms", broken)
    res = e2e.run_engine(_mr(), [Point(1, 40)])
    assert "no engine today" in res.error and res.ms_per_token == {}
