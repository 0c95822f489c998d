"""`stepgraph bench --serve --workload shared-prefix | multi-turn` on the CPU: the workloads'
shapes (pure), their flag checks at the limit and one past it, a multi-turn run submits each
turn after the one before with the previous prompt and output in it, and the whole command
prints caching off and on with a hit rate."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from stepgraph.bench.serve_prefix import serve_turns
from stepgraph.bench.workload_prefix import (
    PREFIX_DEFAULTS,
    check_prefix_workload,
    longest_context,
    next_prompt,
    shared_prefix_prompts,
    turn_questions,
)
from stepgraph.cli import main as cli_main
from stepgraph.engine import Engine
from stepgraph.errors import ConfigError
from stepgraph.model import ModelRunner


def test_shared_prefix_prompts_are_groups_of_one_system_prompt_and_a_question():
    prompts = shared_prefix_prompts(3, 5, 20, 4, 50, seed=1)
    assert len(prompts) == 15 and all(len(p) == 24 for p in prompts)
    heads = {tuple(p[:20]) for p in prompts}
    assert len(heads) == 3
    assert sorted(sum(tuple(p[:20]) == h for p in prompts) for h in heads) == [5, 5, 5]
    assert all(1 <= t < 50 for p in prompts for t in p)
    assert prompts == shared_prefix_prompts(3, 5, 20, 4, 50, seed=1)  # seeded
    assert prompts != shared_prefix_prompts(3, 5, 20, 4, 50, seed=2)


def test_a_turn_is_the_previous_prompt_its_output_and_a_new_question():
    qs = turn_questions(2, 3, 4, 50, seed=0)
    assert len(qs) == 2 and all(len(c) == 3 and all(len(q) == 4 for q in c) for c in qs)
    first = next_prompt(None, [], qs[0][0])
    assert first == qs[0][0]
    assert next_prompt(first, [9, 8], qs[0][1]) == qs[0][0] + [9, 8] + qs[0][1]


def _args(**kw) -> argparse.Namespace:
    a = argparse.Namespace(**{k: None for k in PREFIX_DEFAULTS}, output_len=128)
    for k, v in kw.items():
        setattr(a, k, v)
    return a


def test_workload_checks_at_the_limit_and_one_past():
    a = _args(workload="shared-prefix", system_prompt_len=100, question_len=20, output_len=9)
    check_prefix_workload(a, 128, "m")  # 100 + 20 + 9 - 1 = 128 positions: fits exactly
    assert longest_context(a) == 128
    a.output_len = 10
    with pytest.raises(ConfigError, match="--system-prompt-len, --question-len or --output-len"):
        check_prefix_workload(a, 128, "m")
    m = _args(workload="multi-turn", turns=4, turn_len=16)
    check_prefix_workload(m, 127, "m")  # 2 * 4 * 16 - 1
    with pytest.raises(ConfigError, match="--turns, --turn-len or --answer-len"):
        check_prefix_workload(m, 126, "m")
    assert m.answer_len == 16  # the default: --turn-len
    with pytest.raises(ConfigError, match="--turn-len must be an integer >= 1, got 0"):
        check_prefix_workload(_args(workload="multi-turn", turn_len=0), 10**6, "m")
    with pytest.raises(ConfigError, match="--workload chat: choose one of"):
        check_prefix_workload(_args(workload="chat"), 10**6, "m")
    d = _args()
    check_prefix_workload(d, 10**6, "m")
    assert (d.workload, d.groups, d.prompts_per_group, d.system_prompt_len) == (
        "random",
        16,
        32,
        2048,
    )
    assert (d.question_len, d.conversations, d.turns, d.turn_len) == (128, 32, 6, 256)
    assert d.answer_len == 256


def test_answer_len_checks_at_one_and_one_past_the_models_positions():
    # 4 turns of 16-token questions and 1-token answers: 4 * 17 - 1 = 67 positions
    one = _args(workload="multi-turn", turns=4, turn_len=16, answer_len=1)
    check_prefix_workload(one, 67, "m")
    assert longest_context(one) == 67
    with pytest.raises(ConfigError, match="needs 67 positions .* lower --turns, --turn-len or"):
        check_prefix_workload(one, 66, "m")
    with pytest.raises(ConfigError, match="--answer-len must be an integer >= 1, got 0"):
        check_prefix_workload(_args(workload="multi-turn", answer_len=0), 10**6, "m")
    eight = _args(workload="multi-turn", turns=6, turn_len=256, answer_len=8)
    check_prefix_workload(eight, 6 * 264 - 1, "m")  # the last turn: 6 questions, 6 answers
    with pytest.raises(ConfigError, match="needs 1583 positions"):
        check_prefix_workload(eight, 6 * 264 - 2, "m")
    # not yet checked (None): the default, the turn's length
    assert longest_context(_args(workload="multi-turn", turns=2, turn_len=5)) == 19


def test_each_turn_waits_for_the_one_before_and_carries_it():
    mr = ModelRunner.from_preset("tiny", "cpu", torch.float32, max_bs=4, max_context_len=128)
    engine = Engine(mr, "eager")
    added = []
    add = engine.add_request

    def recording(prompt, n, **kw):
        added.append((list(prompt), sum(1 for r in engine.running) + len(engine.waiting)))
        return add(prompt, n, **kw)

    engine.add_request = recording
    qs = turn_questions(2, 3, 16, 512, seed=3)
    timings, duration = serve_turns(engine, qs, 16)
    assert len(timings) == 6 and duration > 0
    assert all(len(t.token_times) == 16 for t in timings)
    prompts = [p for p, _ in added]
    assert prompts[:2] == [qs[0][0], qs[1][0]]
    for p in prompts[2:]:  # later turns: a first turn's question, 16 out, the next question
        chat = 0 if p[:16] == qs[0][0] else 1
        turn = (len(p) - 16) // 32
        assert len(p) == 16 + 32 * turn and p[-16:] == qs[chat][turn]
    assert engine.stats.cached_tokens > 0  # turn 2 on re-reads turn 1's pages


def test_the_command_runs_caching_off_then_on(capsys):
    argv = ["bench", "--serve", "--device", "cpu", "--model", "tiny", "--max-running", "2"]
    sizes = ["--groups", "2", "--prompts-per-group", "3", "--system-prompt-len", "130"]
    sizes += ["--question-len", "6", "--output-len", "4"]
    assert cli_main([*argv, "--workload", "shared-prefix", *sizes]) == 0
    out = capsys.readouterr().out
    assert "workload shared-prefix: 2 groups x 3 prompts" in out and "on / off:" in out
    table = [w for w in map(str.split, out.splitlines()) if len(w) == 6 and w[1].isdigit()]
    rows = {w[0]: w for w in table}  # the rows "off" and "on" of the table
    assert rows["off"][-1] == "0.0%" and float(rows["on"][-1].rstrip("%")) > 0
    assert cli_main([*argv, "--workload", "multi-turn", "--turns", "2", "--no-prefix-caching"]) == 2
    assert "--no-prefix-caching does not apply" in capsys.readouterr().err


def test_group_mates_queued_at_once_find_the_system_prompt_their_first_computes(tmp_path):
    """All 8 requests fit one admission round; each group's first computes the 8 full pages of
    its system prompt and its 3 mates wait for them, then find them: the most hits there are
    (admitting all 8 at once found none)."""
    out = tmp_path / "prefix.json"
    argv = ["bench", "--serve", "--device", "cpu", "--model", "tiny", "--max-running", "8"]
    argv += ["--workload", "shared-prefix", "--groups", "2", "--prompts-per-group", "4"]
    argv += ["--system-prompt-len", "130", "--question-len", "6", "--output-len", "4"]
    assert cli_main([*argv, "--json", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert runs["off"]["cached_tokens"] == 0
    on = runs["on"]
    assert on["cached_tokens"] == 2 * 3 * 128 and on["queried_tokens"] == 8 * 136
    assert on["hit_rate"] == pytest.approx(768 / 1088)


def _plan(*flags: str):
    from stepgraph.bench.serve_args import check_serve_args
    from stepgraph.cli import build_parser
    from stepgraph.cli_args import model_config

    args = build_parser().parse_args(["bench", "--serve", "--device", "cpu", *flags])
    return args, check_serve_args(args, model_config("tiny"), "tiny")


def test_prefix_workloads_run_every_request_they_can_have_in_flight_at_most_512():
    from stepgraph.bench.serve_args import PREFIX_MAX_RUNNING

    shared = ["--workload", "shared-prefix", "--system-prompt-len", "16", "--question-len", "4"]
    assert _plan(*shared, "--groups", "16", "--prompts-per-group", "32")[1].max_running == 512
    assert _plan(*shared, "--groups", "3", "--prompts-per-group", "5")[1].max_running == 15
    # 513 requests at once: capped at the limit
    assert _plan(*shared, "--groups", "19", "--prompts-per-group", "27")[1].max_running == 512
    assert PREFIX_MAX_RUNNING == 512
    assert _plan("--workload", "multi-turn", "--turn-len", "8")[1].max_running == 32
    turns = ["--workload", "multi-turn", "--turn-len", "8", "--conversations", "7"]
    assert _plan(*turns)[1].max_running == 7
    assert _plan(*turns, "--max-running", "3")[1].max_running == 3  # given: kept
    assert _plan()[1].max_running == 64  # random: min(--num-requests, 64) as before
    assert _plan("--num-requests", "5")[1].max_running == 5


def test_the_page_size_defaults_by_workload_and_is_checked_at_its_limits():
    assert _plan()[1].page_size == 64  # random: the decode kernel's tuned page
    assert _plan("--workload", "multi-turn", "--turn-len", "8")[1].page_size == 16
    assert _plan("--page-size", "256")[1].page_size == 256
    assert _plan("--page-size", "1")[1].page_size == 1
    for bad in ("512", "0", "24"):
        with pytest.raises(ConfigError, match=f"--page-size must be a power of two .* got {bad}"):
            _plan("--page-size", bad)


def test_a_run_that_cannot_fit_is_refused_naming_max_running(monkeypatch, capsys):
    import stepgraph.model.kv_cache as kv_cache
    from stepgraph.bench.serve_args import check_serve_memory
    from stepgraph.bench.workload import bench_bytes
    from stepgraph.cli_args import model_config

    config = model_config("tiny")
    args, plan = _plan("--workload", "shared-prefix", "--system-prompt-len", "16")
    need = sum(bench_bytes(config, torch.float32, 512, 200, 16).values())
    assert plan.max_running == 512 and plan.page_size == 16
    monkeypatch.setattr(kv_cache, "free_bytes", lambda device: need)
    check_serve_memory(args, config, plan, torch.float32, 200)  # exactly fits
    monkeypatch.setattr(kv_cache, "free_bytes", lambda device: need - 1)
    with pytest.raises(ConfigError, match="--max-running 512 requests of 200 tokens need") as e:
        check_serve_memory(args, config, plan, torch.float32, 200)
    assert "lower --max-running" in str(e.value) and "\n" not in str(e.value)
    monkeypatch.setattr(kv_cache, "free_bytes", lambda device: 2**20)
    argv = ["bench", "--serve", "--device", "cpu", "--workload", "multi-turn", "--turn-len", "8"]
    assert cli_main(argv) == 2  # the command: one line, exit 2, before anything is built
    err = capsys.readouterr().err
    assert "--max-running 32 requests of 96 tokens need" in err and "building" not in err


def test_short_answers_carry_into_the_next_turn_and_the_header_says_so(tmp_path, capsys):
    """``--answer-len 5``: every turn asks for 5 tokens, the next prompt carries them, and the
    cache finds every full page written before a turn (its answer's last token never written)."""
    out = tmp_path / "short.json"
    argv = ["bench", "--serve", "--device", "cpu", "--workload", "multi-turn", "--answer-len"]
    argv += ["5", "--conversations", "3", "--turns", "4", "--turn-len", "40", "--json", str(out)]
    assert cli_main(argv) == 0
    text = capsys.readouterr().out
    assert "3 conversations x 4 turns, questions of 40 tokens, answers of 5;" in text
    report = json.loads(out.read_text())
    assert report["sizes"] == "3 conversations x 4 turns, questions of 40 tokens, answers of 5"
    on, ps, q, a = report["runs"]["on"], 16, 40, 5
    assert on["requests"] == 12
    # turn t (from 0): t questions and t answers before its own question
    assert on["queried_tokens"] == 3 * sum(q * (t + 1) + a * t for t in range(4))
    assert on["cached_tokens"] == 3 * sum((t * (q + a) - 1) // ps * ps for t in range(1, 4))
    assert on["decode_steps"] >= 4  # 5 tokens a turn: the first from the prefill


def test_each_turn_asks_for_the_answer_len():
    mr = ModelRunner.from_preset("tiny", "cpu", torch.float32, max_bs=4, max_context_len=128)
    engine = Engine(mr, "eager")
    added = []
    add = engine.add_request

    def recording(prompt, n, **kw):
        added.append((list(prompt), n))
        return add(prompt, n, **kw)

    engine.add_request = recording
    qs = turn_questions(2, 3, 16, 512, seed=3)
    timings, _ = serve_turns(engine, qs, 1)  # one token a turn: at the limit
    assert [n for _, n in added] == [1] * 6
    assert all(len(t.token_times) == 1 for t in timings)
    for p, _ in added:  # turn t: t questions and t one-token answers, then its question
        turn = (len(p) - 16) // 17
        assert len(p) == 16 + 17 * turn


def test_multi_turn_finds_every_full_page_written_before_it(tmp_path):
    """A turn finds every full page of the turn before it, prompt and answer; only the page the
    answer's last token (never fed, so never written) would end stays uncached: 16-token pages,
    the engine's, lose at most 16 tokens a turn (64-token pages lost 64, capping the hit rate
    of 6 turns of 256 tokens at 79.9%)."""
    out = tmp_path / "turns.json"
    argv = ["bench", "--serve", "--device", "cpu", "--workload", "multi-turn"]
    argv += ["--conversations", "3", "--turns", "4", "--turn-len", "40", "--json", str(out)]
    assert cli_main(argv) == 0
    report = json.loads(out.read_text())
    assert report["meta"]["page_size"] == 16 and report["meta"]["max_running"] == 3
    on, ps, turn = report["runs"]["on"], 16, 40
    queried = 3 * sum(2 * turn * t + turn for t in range(4))
    # turn t (from 0) finds the 2*turn*t - 1 tokens written before it, in full pages
    cached = 3 * sum((2 * turn * t - 1) // ps * ps for t in range(1, 4))
    assert (on["queried_tokens"], on["cached_tokens"]) == (queried, cached)
    assert report["runs"]["off"]["cached_tokens"] == 0


def test_the_report_says_where_each_run_spent_its_steps(tmp_path, capsys):
    out = tmp_path / "steps.json"
    argv = ["bench", "--serve", "--device", "cpu", "--workload", "shared-prefix"]
    argv += ["--groups", "2", "--prompts-per-group", "3", "--system-prompt-len", "40"]
    argv += ["--question-len", "6", "--output-len", "5", "--json", str(out)]
    assert cli_main(argv) == 0
    text = capsys.readouterr().out
    assert "max running 6, page 16 tokens" in text
    runs = json.loads(out.read_text())["runs"]
    for name, r in runs.items():
        assert f"  {name}: {r['decode_steps']} decode steps, {r['prefill_steps']} prefill" in text
        # every request's first token comes from its prefill, the other 4 from decode steps
        assert r["decode_steps"] >= 4 and r["prefill_steps"] >= 1
        assert r["steps"] >= r["decode_steps"] and r["steps"] >= r["prefill_steps"]
        assert r["prefill_step_s"] > 0 and r["decode_step_s"] > 0 and r["outside_steps_s"] >= 0
        in_steps = r["prefill_step_s"] + r["decode_step_s"] + r["outside_steps_s"]
        assert in_steps == pytest.approx(r["duration_s"], rel=0.05)
        from stepgraph.engine.phase_timer import PHASES

        phases = r["host_ms_by_phase"]
        assert list(phases) == list(PHASES) and all(v >= 0 for v in phases.values())
        # the phases split the steps' time (the timer's own marks aside)
        in_engine = (r["prefill_step_s"] + r["decode_step_s"]) * 1e3
        assert sum(phases.values()) == pytest.approx(in_engine, rel=0.2)
    assert text.count("step ms by phase (landing: the wait for the device): admission") == 2
    assert runs["off"]["prefill_tokens"] == 6 * 46
    # on: the 2 full pages of each system prompt computed once, the rest of each prompt
    assert runs["on"]["prefill_tokens"] == 6 * 46 - 4 * 32
