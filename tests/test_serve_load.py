"""benchmarks/serve_load.py: where the longest gap between two tokens of a request fell, every
request's TTFT and longest gap, the prefill cap passed to the launched server (one server per
value, in one call), and its refusals (one line on stderr, exit 2)."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import pathlib
import subprocess
import sys
import time

import pytest

from stepgraph.bench.serve_metrics import RequestTiming

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "serve_load.py"


@pytest.fixture(scope="module")
def load():
    spec = importlib.util.spec_from_file_location("serve_load", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _timing(arrival: float, prompt: int, times: list[float]) -> RequestTiming:
    return RequestTiming(arrival / 1e3, prompt, [t / 1e3 for t in times])  # ms -> s


def test_a_stall_of_every_stream_with_a_prefill_at_its_end(load):
    """Three requests decode every 10 ms; all pause from 40 to 190 ms (the streams' tokens of
    one step arrive up to 1.9 ms apart), when two new requests get their first token (one at
    the end, one 2 ms after it: the same step, the limit), a third 2.1 ms after it (a later
    step's)."""
    timings = [
        _timing(0.0, 100, [0.0, 10, 20, 30, 40, 190, 200, 210]),
        _timing(0.0, 100, [1.0, 11, 21, 31, 41.9, 191.8, 200, 210]),  # 149.9 ms: not the longest
        _timing(0.0, 100, [0.5, 10, 20, 30, 40.5, 188.1, 200, 210]),  # 1.9 ms before the end
        _timing(0.0, 1000, [190.0, 200.0]),
        _timing(0.0, 24, [192.0, 200.0]),
        _timing(0.0, 7, [192.1, 200.0]),
        _timing(190.0, 5, [195.0]),  # sent at the gap's end: never waited across it
        _timing(41.9, 3, [42.0]),  # first token 2 ms after the start: the start's step
    ]
    gap = load.longest_gap(timings, 0.0)
    assert gap["request"] == 0 and gap["token"] == 4
    assert gap["ms"] == pytest.approx(150.0) and gap["at_ms"] == pytest.approx(40.0)
    assert (gap["decoding"], gap["stalled"]) == (2, 2)  # every other stream paused: the engine
    assert (gap["first_tokens"], gap["their_prompt_tokens"]) == (2, 1024)
    assert (gap["waiting"], gap["waiting_prompt_tokens"]) == (3, 1031)
    figures = load.request_figures(timings)
    assert figures["ttft_ms_per_request"] == [0.0, 1.0, 0.5, 190.0, 192.0, 192.1, 5.0, 0.1]
    assert len(figures["max_gap_ms_per_request"]) == 8
    assert figures["max_gap_ms_per_request"][:6] == pytest.approx([150, 149.9, 147.6, 10, 8, 7.9])
    line = load.describe_gap(gap)
    assert "150.0 ms: request 0, tokens 4-5, at 40 ms" in line
    assert "of 2 other requests decoding across it, 2 got no token in it" in line
    assert "3 requests waited for a first token across it (1031 prompt tokens)" in line
    assert "the load generator itself paused 0.0 ms of it" in line  # none recorded here


def test_a_gap_of_one_stream_while_the_others_get_tokens(load):
    """One stream waits 50 ms while the other gets tokens inside (2.1 ms after its start, past
    the 2 ms of the step that began it): not an engine pause."""
    timings = [
        _timing(0.0, 10, [0.0, 10, 60, 70]),
        _timing(0.0, 10, [0.0, 12.1, 60, 70]),
        _timing(0.0, 10, [5.0]),  # one token: no gap of its own, not decoding across it
    ]
    gap = load.longest_gap(timings, 0.0)
    assert (gap["request"], gap["token"], gap["ms"]) == (0, 1, pytest.approx(50.0))
    assert (gap["decoding"], gap["stalled"], gap["first_tokens"], gap["waiting"]) == (1, 0, 0, 0)
    assert load.longest_gap([_timing(0.0, 10, [1.0])], 0.0) is None
    assert "none" in load.describe_gap(None)


def test_the_load_generators_own_pauses_are_recorded_and_shared_out(load):
    """A 30 ms block of the client's event loop is one pause of about 30 ms; wake-ups at most
    5 ms late are none. The share of a gap is the pauses' overlap with it."""

    async def run(block_s: float) -> list:
        stalls: list = []
        watch = asyncio.ensure_future(load.watch_loop(stalls))
        await asyncio.sleep(0.01)
        time.sleep(block_s)  # the loop held, as a GC pause or a slow parse would
        await asyncio.sleep(0.01)
        watch.cancel()
        return stalls

    stalls = asyncio.run(run(0.03))
    assert len(stalls) == 1 and 0.025 < stalls[0][1] - stalls[0][0] < 0.2
    quiet = asyncio.run(run(0.0))  # nothing held: no pause of the 30 ms (a busy box may lag)
    assert all(b - a < 0.025 for a, b in quiet)
    pauses = [(1.0, 1.03), (2.0, 2.01)]
    assert load.paused_within(pauses, 1.02, 2.005) == pytest.approx(0.015)
    assert load.paused_within(pauses, 1.03, 2.0) == 0.0  # touching ends share nothing


def test_each_use_of_a_workload_sends_fresh_ids_of_the_same_lengths(load):
    prompts = [[1] * 5, [2] * 300, [3]]
    a = load.fresh_ids(prompts, 1000, "0:level 0")
    assert [len(p) for p in a] == [5, 300, 1]
    assert all(0 <= t < 1000 for p in a for t in p)
    assert a == load.fresh_ids(prompts, 1000, "0:level 0")  # seeded: the same each call
    b = load.fresh_ids(prompts, 1000, "0:level 1")
    assert a[1] != b[1] and a[1] != prompts[1]  # 300 ids: equal only by a 1e-900 chance


def test_prefill_caps_parse_and_refuse(load):
    assert load.prefill_caps(None) == [None]
    assert load.prefill_caps("2048,1024,512") == [2048, 1024, 512]
    assert load.prefill_caps("0") == [0]  # no cap
    for bad in ("-1", "512,-1", "a", "", "1.5"):
        with pytest.raises(ValueError, match="--max-prefill-tokens-with-decode takes whole"):
            load.prefill_caps(bad)


def test_the_launched_server_gets_the_cap(load):
    args = argparse.Namespace(
        model="tiny", max_running=8, max_context=256, mode="graph", engine="process", device=None
    )
    cmd = load.serve_command(args, 1024)
    assert cmd[cmd.index("--max-prefill-tokens-with-decode") + 1] == "1024"
    assert "--max-prefill-tokens-with-decode" not in load.serve_command(args)
    assert load.serve_command(args, 0)[-2:] == ["--max-prefill-tokens-with-decode", "0"]


@pytest.mark.parametrize(
    "extra,says",
    [
        (["--url", "http://127.0.0.1:1", "--max-prefill-tokens-with-decode", "512"], "--launch"),
        (["--launch", "--max-prefill-tokens-with-decode", "512,-2"], "whole numbers >= 0"),
    ],
)
def test_refusals_are_one_line_and_exit_2(extra, says):
    r = subprocess.run(
        [sys.executable, str(SCRIPT), "--model", "tiny", *extra],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1 and says in r.stderr
    assert "--max-prefill-tokens-with-decode" in r.stderr


def test_one_call_serves_each_cap_and_reports_it(tmp_path):
    """Two servers in one call (CPU, tiny, a smoke workload): each run names its cap (the flag
    on the server's command line: ``serve_command`` above; the serve CLI's tests follow it to
    the engine), both stop cleanly, with every request's TTFT and longest gap."""
    out = tmp_path / "load.json"
    cmd = [sys.executable, str(SCRIPT), "--launch", "--model", "tiny", "--device", "cpu"]
    cmd += ["--quick", "--concurrency", "4", "--max-prefill-tokens-with-decode", "2048,16"]
    r = subprocess.run(
        cmd + ["--json", str(out)], capture_output=True, text=True, timeout=240, cwd=ROOT
    )
    assert r.returncode == 0, r.stderr[-2000:]
    data = json.loads(out.read_text())
    runs = data["runs"]
    assert [run["max_prefill_tokens_with_decode"] for run in runs] == [2048, 16]
    assert all(run["server_exit"] == 0 and run["engine_process_gone"] for run in runs)
    level = runs[0]["levels"][0]
    assert len(level["ttft_ms_per_request"]) == level["completed"] == 8
    assert level["max_gap_ms"] == pytest.approx(max(level["max_gap_ms_per_request"]), abs=1e-3)
    assert "prefill cap conc" in r.stdout and "longest token gap" in r.stdout
    assert level["client_stall_ms"] >= 0.0 and "client_stall_ms" in level["gap"]
    # the rehearsal ran this workload's lengths first: fresh ids, so the cache served nothing
    assert all(lv["prefix_hit_rate"] == 0.0 for run in runs for lv in run["levels"])
    assert "prefix cache hit rate 0.0%" in r.stdout
