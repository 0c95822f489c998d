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
    assert steps == [(1, {8}), (1, {8}), (3, {32}), (3, {32})]  # warm-up, then timed
    assert mr.kv_cache.allocator.num_free == free


def test_a_failing_engine_is_a_reported_row(monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("no engine today")

    monkeypatch.setattr(e2e, "decode_step_ms", broken)
    res = e2e.run_engine(_mr(), [Point(1, 40)])
    assert "no engine today" in res.error and res.ms_per_token == {}
