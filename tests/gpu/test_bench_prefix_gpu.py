"""`stepgraph bench --serve --workload shared-prefix | multi-turn` on the GPU (tiny preset,
seconds): the prefix workloads run every request they can have in flight on 16-token pages,
find exactly the pages the turns before them wrote, and report the engine's steps and its host
time by phase, the wait for the device included."""

from __future__ import annotations

import json

import pytest

from stepgraph.cli import main
from stepgraph.engine.phase_timer import PHASES

pytestmark = pytest.mark.cuda

TINY = ["bench", "--serve", "--model", "tiny", "--dtype", "float32"]


def test_multi_turn_on_cuda_finds_every_full_page_written_before_it(tmp_path):
    out = tmp_path / "turns.json"
    argv = [*TINY, "--workload", "multi-turn", "--conversations", "4", "--turns", "3"]
    assert main([*argv, "--turn-len", "40", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["meta"]["page_size"] == 16 and report["meta"]["max_running"] == 4
    on = report["runs"]["on"]
    assert on["queried_tokens"] == 4 * sum(80 * t + 40 for t in range(3))
    assert on["cached_tokens"] == 4 * sum((80 * t - 1) // 16 * 16 for t in range(1, 3))
    for r in report["runs"].values():
        assert r["decode_steps"] >= 3 * 39 and r["prefill_steps"] >= 3
        assert list(r["host_ms_by_phase"]) == list(PHASES)
        assert r["host_ms_by_phase"]["landing"] > 0  # the wait for the device's tokens


def test_shared_prefix_on_cuda_runs_every_prompt_at_once(tmp_path):
    out = tmp_path / "shared.json"
    argv = [*TINY, "--workload", "shared-prefix", "--groups", "4", "--prompts-per-group", "8"]
    argv += ["--system-prompt-len", "256", "--question-len", "32", "--output-len", "16"]
    assert main([*argv, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["meta"]["max_running"] == 32 and report["meta"]["page_size"] == 16
    off, on = report["runs"]["off"], report["runs"]["on"]
    assert off["prefill_tokens"] == 32 * 288 and off["cached_tokens"] == 0
    # each group's first computes its system prompt's 16 pages; its 7 mates find them
    assert on["cached_tokens"] == 4 * 7 * 256 and on["prefill_tokens"] == 32 * 288 - 28 * 256
    assert on["requests"] == off["requests"] == 32


def test_multi_turn_with_short_answers_on_cuda(tmp_path):
    """``--answer-len 4``: each turn asks for 4 tokens, the next carries them, and the cache
    finds every full page written before a turn."""
    out = tmp_path / "short.json"
    argv = [*TINY, "--workload", "multi-turn", "--conversations", "4", "--turns", "3"]
    assert main([*argv, "--turn-len", "40", "--answer-len", "4", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["sizes"] == "4 conversations x 3 turns, questions of 40 tokens, answers of 4"
    on = report["runs"]["on"]
    assert on["queried_tokens"] == 4 * sum(40 * (t + 1) + 4 * t for t in range(3))
    assert on["cached_tokens"] == 4 * sum((44 * t - 1) // 16 * 16 for t in range(1, 3))
    assert on["requests"] == report["runs"]["off"]["requests"] == 12
