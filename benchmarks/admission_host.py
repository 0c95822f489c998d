"""Host cost of admission with a long queue: the real ``Engine`` loop over a stand-in step of
(near) zero GPU time (``engine_host.stand_in_runner``), ``--requests`` prompts of
``--prompt-len`` tokens all queued at once, ``--max-running`` at a time, each generating
``--new-tokens``; µs a step of the admission phase (``PhaseTimer``; its total over the run:
the schedule, and so the number of steps, may differ between versions) and of the whole step,
with prefix caching off and on.

    python benchmarks/admission_host.py                      # 512 x 2000, shared and unshared
    python benchmarks/admission_host.py --requests 128 --json out/admission.json

Workloads: ``unshared`` (every prompt its own tokens: every lookup misses at its first page)
and ``shared`` (16 groups: a system prompt of all but the last 128 tokens, then a question:
lookups walk the whole system prompt). The admission phase includes the lookups of the
waiting requests it looks at, their page counts and the reservations. Then the same queues
while ``--max-running`` requests decode and nothing can start: the admission phase a step.
Last, `stepgraph bench --serve`'s offline workload: the host's whole time over the run.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from engine_host import stand_in_runner

from stepgraph.engine import Engine
from stepgraph.engine.phase_timer import PhaseTimer
from stepgraph.engine.requests import PREFILLS

# the stand-in's prefill is ``mr.extend``: the unpadded prefiller calls it (the padded ones run
# the model's own forward)
STAND_IN = {"prefill": "unpadded"} if "unpadded" in PREFILLS else {}


def stand_in_engine(mr, max_running: int, caching: bool) -> Engine:
    return Engine(mr, "eager", max_running=max_running, prefix_caching=caching, **STAND_IN)


def prompts_of(kind: str, n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    if kind == "unshared":
        return [[rng.randrange(1, 250) for _ in range(length)] for _ in range(n)]
    question = min(128, length // 2)
    systems = [[rng.randrange(1, 250) for _ in range(length - question)] for _ in range(16)]
    out = [systems[i % 16] + [rng.randrange(1, 250) for _ in range(question)] for i in range(n)]
    rng.shuffle(out)
    return out


def measure(args: argparse.Namespace, kind: str, caching: bool) -> dict[str, float]:
    context = args.prompt_len + args.new_tokens
    mr = stand_in_runner("cpu", args.max_running, context)
    engine = stand_in_engine(mr, args.max_running, caching)
    for p in prompts_of(kind, args.requests, args.prompt_len):
        engine.add_request(p, args.new_tokens, ignore_eos=True)
    timer = PhaseTimer()
    engine.timer = timer
    wall = []
    while engine.has_unfinished:
        t0 = time.perf_counter_ns()
        engine.step()
        wall.append(time.perf_counter_ns() - t0)
    engine.timer = None
    admission = [s[0] for s in timer.samples]
    row = {
        "steps": len(wall),
        "admission_us_mean": round(statistics.fmean(admission) / 1e3, 2),
        "admission_us_median": round(statistics.median(admission) / 1e3, 2),
        "admission_ms_total": round(sum(admission) / 1e6, 2),
        "step_us_mean": round(statistics.fmean(wall) / 1e3, 2),
        "hit_rate": round(engine.stats.hit_rate, 4),
    }
    engine.shutdown()
    return row


def measure_steady(args: argparse.Namespace, kind: str, caching: bool, steps: int = 50) -> float:
    """µs of the admission phase a step while ``--max-running`` requests decode and the rest
    of the queue waits (nothing can start): what a long queue costs a step by itself."""
    new = 2 * args.max_running + steps  # none ends before the last has started
    context = args.prompt_len + new
    mr = stand_in_runner("cpu", args.max_running, context)
    engine = stand_in_engine(mr, args.max_running, caching)
    for p in prompts_of(kind, args.requests, args.prompt_len - new):
        engine.add_request(p, new, ignore_eos=True)
    while len(engine.running) < args.max_running or any(r.scheduled == 0 for r in engine.running):
        engine.step()
    timer = PhaseTimer()
    engine.timer = timer
    for _ in range(steps):
        engine.step()
    engine.timer = None
    engine.abort_all()
    engine.shutdown()
    return round(statistics.fmean(s[0] for s in timer.samples) / 1e3, 2)


def measure_random(repeats: int = 7, seed: int = 0) -> dict[str, dict[str, float]]:
    """The offline workload of `stepgraph bench --serve` (64 requests, prompts 128-1024, 128
    new tokens, all queued at once) over the stand-in step, caching off and on in turn
    ``repeats`` times (a shared host's noise moves whole runs): the host's CPU ms over the run,
    the least and the median, and what caching adds a step (the least on less the least off)."""
    from stepgraph.bench.serve_metrics import random_prompts

    prompts = random_prompts(64, 576, 7 / 9, 250, seed)
    mr = stand_in_runner("cpu", 64, max(map(len, prompts)) + 128)
    totals: dict[bool, list[float]] = {False: [], True: []}
    steps = 0
    for _ in range(repeats):
        for caching in (False, True):
            engine = stand_in_engine(mr, 64, caching)
            for p in prompts:
                engine.add_request(p, 128, ignore_eos=True)
            wall = []
            while engine.has_unfinished:  # this thread's CPU time: other processes' load
                t0 = time.thread_time_ns()  # on a shared host moves it less than wall time
                engine.step()
                wall.append(time.thread_time_ns() - t0)
            engine.shutdown()  # clears the prefix cache: the next run starts cold
            totals[caching].append(sum(wall) / 1e6)
            steps = len(wall)
    out = {}
    for caching, ms in totals.items():
        out["on" if caching else "off"] = {
            "steps": steps,
            "host_ms_min": round(min(ms), 2),
            "host_ms_median": round(statistics.median(ms), 2),
        }
    added = (out["on"]["host_ms_min"] - out["off"]["host_ms_min"]) / steps * 1e3
    out["on"]["caching_us_a_step"] = round(added, 1)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--prompt-len", type=int, default=2000)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--max-running", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=7, help="offline workload: runs each way")
    ap.add_argument("--random-only", action="store_true", help="only the offline workload")
    ap.add_argument("--json", default=None, help="write the result here")
    args = ap.parse_args(argv)
    out: dict = {"args": vars(args), "runs": {}}
    print(
        f"{'workload':<10}{'caching':>8}{'steps':>7}{'admit us':>10}{'admit ms':>10}"
        f"{'step us':>10}{'hits':>7}"
    )
    for kind in ("unshared", "shared") if not args.random_only else ():
        for caching in (False, True):
            r = measure(args, kind, caching)
            out["runs"][f"{kind}/{'on' if caching else 'off'}"] = r
            print(
                f"{kind:<10}{'on' if caching else 'off':>8}{r['steps']:>7}"
                f"{r['admission_us_mean']:>10.1f}{r['admission_ms_total']:>10.1f}"
                f"{r['step_us_mean']:>10.1f}{r['hit_rate']:>7.1%}"
            )
    print(f"\nadmission us a step, {args.max_running} decoding and the rest of the queue waiting")
    for kind in ("unshared", "shared") if not args.random_only else ():
        for caching in (False, True):
            us = measure_steady(args, kind, caching)
            out["runs"][f"{kind}/{'on' if caching else 'off'}"]["steady_admission_us"] = us
            print(f"{kind:<10}{'on' if caching else 'off':>8}{us:>10.1f}")
    print(
        "\nthe offline workload (64 requests, 128-1024 + 128 tokens): host ms over the run, "
        f"least and median of {args.repeats}"
    )
    for name, r in measure_random(args.repeats).items():
        out["runs"][f"random/{name}"] = r
        print(
            f"{'random':<10}{name:>8}{r['steps']:>7}{r['host_ms_min']:>10.1f}"
            f"{r['host_ms_median']:>10.1f}"
        )
    added = out["runs"]["random/on"]["caching_us_a_step"]
    print(f"caching adds {added:.1f} us a step (least on - least off)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
