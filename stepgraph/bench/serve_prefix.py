"""`stepgraph bench --serve --workload shared-prefix | multi-turn`: the prefix-caching workloads
(``workload_prefix.py``) through the ``Engine``, with prefix caching off and then on, on one model
runner (the same weights) and the same requests: output tokens/s, TTFT p50/p99, the hit rate,
and on/off ratios.

Shared prefix: every request is queued at once (``serve.serve``). Multi-turn: a turn is added
when the previous turn of its chat has finished, its prompt that turn's prompt and output plus a
new question (``serve_turns``), asking for ``--answer-len`` tokens (default ``--turn-len``).
Before each timed run the engine runs one shared-prefix pair (compiles the prefill kernels, also
for a chunk after a cached prefix), then the cache is cleared: the timed run starts cold.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from ..engine.phase_timer import PHASES, PhaseTimer
from ..errors import StepGraphError
from .serve_metrics import RequestTiming, percentile, serving_metrics
from .workload_prefix import (
    answer_tokens,
    longest_context,
    next_prompt,
    shared_prefix_prompts,
    turn_questions,
)


def serve_turns(engine, questions: list[list[list[int]]], answer_len: int) -> tuple[list, float]:
    """Run every chat's turns in order, each asking for ``answer_len`` tokens and added once the
    turn before it finished; return the requests' timings (in submission order) and the seconds
    from start to last token."""
    n_turns = len(questions[0])
    prompts: list[list[int] | None] = [None] * len(questions)
    outputs: list[list[int]] = [[] for _ in questions]
    timings: list[RequestTiming] = []
    live: dict[int, tuple[int, int, RequestTiming]] = {}  # rid -> (chat, turn, timing)
    t0 = time.perf_counter()

    def submit(chat: int, turn: int) -> None:
        prompt = next_prompt(prompts[chat], outputs[chat], questions[chat][turn])
        prompts[chat], outputs[chat] = prompt, []
        timing = RequestTiming(time.perf_counter(), len(prompt))
        timings.append(timing)
        live[engine.add_request(prompt, answer_len, ignore_eos=True)] = (chat, turn, timing)

    for chat in range(len(questions)):
        submit(chat, 0)
    while live or engine.has_unfinished:
        pairs = engine.step()
        end = time.perf_counter()
        for rid, token in pairs:
            chat, turn, timing = live[rid]
            outputs[chat].append(token)
            timing.token_times.append(end)
            if len(outputs[chat]) == answer_len:
                del live[rid]
                engine.finished.pop(rid, None)
                if turn + 1 < n_turns:
                    submit(chat, turn + 1)
        if not pairs and not engine.has_unfinished and live:
            raise StepGraphError(f"{len(live)} turns never finished; the engine is stuck.")
    return timings, max(t.token_times[-1] for t in timings) - t0


def summarize(timings: list[RequestTiming], duration: float, stats) -> dict:
    """Throughput, TTFT p50/p99 (ms) and the prefix cache's hit rate of one run, and where its
    time went: the engine's decode and prefill steps, the prompt tokens it computed, its wall
    seconds in steps that prefilled and in decode-only steps, and the rest (the loop's)."""
    m = serving_metrics(timings, duration)
    ttft = [t.ttft * 1e3 for t in timings]
    in_steps = stats.prefill_step_s + stats.decode_step_s
    return {
        "requests": m["completed"],
        "duration_s": duration,
        "output_throughput": m["output_throughput"],
        "total_token_throughput": m["total_token_throughput"],
        "ttft_p50_ms": percentile(ttft, 50),
        "ttft_p99_ms": percentile(ttft, 99),
        "hit_rate": stats.hit_rate,
        "cached_tokens": stats.cached_tokens,
        "queried_tokens": stats.queried_tokens,
        "steps": stats.steps,
        "decode_steps": stats.decode_steps,
        "prefill_steps": stats.prefill_steps,
        "prefill_tokens": stats.prefill_tokens,
        "prefill_step_s": stats.prefill_step_s,
        "decode_step_s": stats.decode_step_s,
        "outside_steps_s": max(duration - in_steps, 0.0),
    }


def run_workload(engine, args: argparse.Namespace, vocab: int, serve) -> dict:
    """One timed run of ``args.workload`` on ``engine`` (warmed up, its cache cleared first);
    ``serve``: ``bench.serve.serve``, the loop of a queue of requests."""
    seed = args.seed
    warm = shared_prefix_prompts(1, 2, 40, 8, vocab, seed + 7)
    engine.generate(warm[:1], 2, ignore_eos=True)
    engine.generate(warm[1:], 2, ignore_eos=True)  # a chunk after a cached prefix
    engine.prefix_cache.clear()
    engine.stats = type(engine.stats)()
    timer = engine.timer = PhaseTimer()  # a few clock reads a step
    if args.workload == "shared-prefix":
        prompts = shared_prefix_prompts(
            args.groups,
            args.prompts_per_group,
            args.system_prompt_len,
            args.question_len,
            vocab,
            seed,
        )
        run = serve(engine, prompts, args.output_len, [0.0] * len(prompts), engine.max_running)
        timings, duration = run.timings, run.duration_s
    else:
        questions = turn_questions(args.conversations, args.turns, args.turn_len, vocab, seed)
        timings, duration = serve_turns(engine, questions, answer_tokens(args))
    engine.timer = None
    out = summarize(timings, duration, engine.stats)
    out["host_ms_by_phase"] = phase_totals(timer)
    return out


def phase_totals(timer: PhaseTimer) -> dict[str, float]:
    """Milliseconds of the engine's steps by phase over the run (``PhaseTimer``; "landing"
    holds the wait for the device)."""
    return {p: sum(s[i] for s in timer.samples) / 1e6 for i, p in enumerate(PHASES)}


def step_line(name: str, r: dict) -> str:
    """The second line of a run: its engine steps and where its wall time went."""
    decode_only = r["steps"] - r["prefill_steps"]
    each = r["decode_step_s"] / decode_only * 1e3 if decode_only else 0.0
    return (
        f"  {name}: {r['decode_steps']} decode steps, {r['prefill_steps']} prefill steps "
        f"({r['prefill_tokens']} prompt tokens computed); {r['prefill_step_s']:.2f} s in steps "
        f"that prefilled, {r['decode_step_s']:.2f} s in {decode_only} decode-only "
        f"({each:.2f} ms each), {r['outside_steps_s']:.2f} s outside the engine"
    ) + (_phases(r["host_ms_by_phase"]) if "host_ms_by_phase" in r else "")


def _phases(ms: dict[str, float]) -> str:
    cells = ", ".join(f"{p} {v:.0f}" for p, v in ms.items())
    return f"\n    step ms by phase (landing: the wait for the device): {cells}"


def _sizes(args: argparse.Namespace) -> str:
    if args.workload == "shared-prefix":
        return (
            f"{args.groups} groups x {args.prompts_per_group} prompts, system prompt "
            f"{args.system_prompt_len}, question {args.question_len}, output {args.output_len}"
        )
    return (
        f"{args.conversations} conversations x {args.turns} turns, questions of {args.turn_len} "
        f"tokens, answers of {answer_tokens(args)}"
    )


def _setup(args: argparse.Namespace, plan) -> str:
    cap = args.max_prefill_tokens_with_decode or "no cap"
    return (
        f"max running {plan.max_running}, page {plan.page_size} tokens, prefill "
        f"{args.max_prefill_tokens} tokens a step ({cap} with decode)"
    )


def format_table(workload: str, sizes: str, runs: dict[str, dict], setup: str = "") -> str:
    """The two runs side by side (each with its ``step_line``), then caching on over off;
    ``setup``: the engine's limits, on the header line."""
    lines = [
        f"workload {workload}: {sizes}" + (f"; {setup}" if setup else ""),
        f"{'caching':<8} {'requests':>8} {'out tok/s':>10} {'TTFT p50 ms':>12} "
        f"{'TTFT p99 ms':>12} {'hit rate':>9}",
    ]
    for name, r in runs.items():
        lines.append(
            f"{name:<8} {r['requests']:>8} {r['output_throughput']:>10.1f} "
            f"{r['ttft_p50_ms']:>12.1f} {r['ttft_p99_ms']:>12.1f} {r['hit_rate']:>9.1%}"
        )
        if "steps" in r:
            lines.append(step_line(name, r))
    off, on = runs.get("off"), runs.get("on")
    if off and on:
        speed = on["output_throughput"] / off["output_throughput"]
        ttft = off["ttft_p50_ms"] / on["ttft_p50_ms"] if on["ttft_p50_ms"] else float("inf")
        lines.append(f"on / off: {speed:.2f}x output tokens/s, TTFT p50 {ttft:.2f}x lower")
    return "\n".join(lines)


def run_prefix_bench(args: argparse.Namespace, plan, config, model: str, make_engine, serve) -> int:
    """Caching off, then on, on one model runner; print the table, write ``--json``
    (``make_engine`` and ``serve``: ``bench.serve``'s, handed in by its ``run_serve``)."""
    import torch

    from .constants import DTYPES
    from .serve_args import check_serve_memory
    from .workload import build_model_runner

    cuda = args.device == "cuda"
    dtype = DTYPES[args.dtype or ("bfloat16" if cuda else "float32")]
    max_context = longest_context(args) + 1
    check_serve_memory(args, config, plan, dtype, max_context)
    setup = _setup(args, plan)
    print(f"stepgraph bench --serve: building {model}, {_sizes(args)}; {setup}", file=sys.stderr)
    mr = build_model_runner(
        model, args.device, dtype, plan.max_running, max_context, page_size=plan.page_size
    )
    if cuda:
        mr.set_kernels(args.kernels or "fused")
    runs = {}
    for name, caching in (("off", False), ("on", True)):
        budgets = args.max_prefill_tokens, plan.prefill, caching
        engine = make_engine(
            mr, plan.mode, plan.max_running, *budgets, args.max_prefill_tokens_with_decode
        )
        try:
            print(f"stepgraph bench --serve: prefix caching {name}", file=sys.stderr)
            runs[name] = run_workload(engine, args, config.vocab_size, serve)
        finally:
            engine.shutdown()
        if cuda:
            torch.cuda.synchronize()
    print(format_table(args.workload, _sizes(args), runs, setup))
    if args.json:
        meta = {
            "max_running": plan.max_running,
            "page_size": plan.page_size,
            "max_prefill_tokens": args.max_prefill_tokens,
            "max_prefill_tokens_with_decode": args.max_prefill_tokens_with_decode,
            "mode": plan.mode,
            "prefill": plan.prefill,
        }
        report = {"workload": args.workload, "sizes": _sizes(args), "meta": meta, "runs": runs}
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.json}")
    return 0


__all__ = [
    "format_table",
    "run_prefix_bench",
    "run_workload",
    "serve_turns",
    "step_line",
    "summarize",
]
