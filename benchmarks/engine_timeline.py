"""Where the engine's decode step goes on the device: the overlapped ``Engine`` (mode exact) serving
``bs`` requests of one preset, its decode-only steps traced with torch.profiler (CUPTI records
every kernel and copy, those inside the graph too), and the device's idle time between them.

Per batch size: the period of a step on the device (start of one replay's first kernel to the
next's), the time the device was busy in it, and the idle gaps over ``--gap-us`` with the names
of what ran before and after each, summed over the traced steps by that pair. A step period over
the bench's GPU step is idle time the host (or a copy) left, and the pairs say where it falls.
Beside it, under the same profiler, the engine's own runner replaying one fixed batch of ``bs``
rows back to back (the bench's GPU step): a busy time over the bench's is device work the engine
adds, a period over it with equal busy time is idle.

    PYTHONPATH=. python3 benchmarks/engine_timeline.py --batch-sizes 1,8 --context 512
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict

import torch

from stepgraph.bench.workload import Point, build_model_runner, decode_batch
from stepgraph.engine import Engine
from stepgraph.runner import RunnerConfig

WARM_STEPS = 8  # steps after the prefill before the trace


def trace_steps(engine: Engine, prompts: list[list[int]], steps: int):
    """[(name, start µs, end µs)] of every device activity over ``steps`` decode-only steps."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    new = WARM_STEPS + steps + 4
    for p in prompts:
        engine.add_request(p, new, ignore_eos=True)
    while engine.waiting or any(r.scheduled == 0 for r in engine.running):
        engine.step()
    for _ in range(WARM_STEPS):
        engine.step()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    engine.drain()
    engine.finished.clear()
    acts = [
        (e.name, e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == DeviceType.CUDA
    ]
    return sorted(acts, key=lambda a: a[1])


def trace_replays(engine: Engine, bs: int, context: int, steps: int):
    """As ``trace_steps``, for the engine's runner replaying one decode batch of ``bs`` rows at
    ``context`` tokens ``steps`` times back to back (what ``stepgraph bench`` times)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    mr = engine.model_runner
    batch, pages = decode_batch(mr, Point(bs, context))
    for _ in range(WARM_STEPS):
        engine.runner.replay(batch)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.runner.replay(batch)
        torch.cuda.synchronize()
    for req_pages in pages:
        mr.kv_cache.release(req_pages)
    acts = [
        (e.name, e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == DeviceType.CUDA
    ]
    return sorted(acts, key=lambda a: a[1])


def analyse(acts, gap_us: float) -> dict:
    """Step periods (by the most frequent first-of-step kernel), busy time, gaps by pair."""
    firsts = [a for a in acts if "fill_inputs" in a[0] or "graph_inputs" in a[0]]
    starts = [a[1] for a in firsts]
    periods = [b - a for a, b in zip(starts, starts[1:])]
    if len(starts) > 1:  # whole steps only: from the first step's start to the last's
        acts = [a for a in acts if starts[0] <= a[1] < starts[-1]]
    busy, gaps = (acts[0][2] - acts[0][1] if acts else 0.0), defaultdict(lambda: [0, 0.0])
    frontier = acts[0][2] if acts else 0.0
    prev = acts[0][0] if acts else ""
    for name, s, e in acts[1:]:
        if s > frontier + gap_us:
            key = f"{prev[:60]} -> {name[:60]}"
            gaps[key][0] += 1
            gaps[key][1] += s - frontier
        if e > frontier:
            busy += e - max(s, frontier)
            frontier, prev = e, name
    steps = max(1, len(periods))
    top = sorted(gaps.items(), key=lambda kv: -kv[1][1])[:8]
    by_kernel: dict[str, float] = defaultdict(float)
    for name, s, e in acts:
        by_kernel[name[:60]] += (e - s) / steps
    return {
        "steps": len(periods),
        "period_us": statistics.median(periods) if periods else float("nan"),
        "busy_us_per_step": busy / steps,
        "gaps": [{"pair": k, "count": c, "us_per_step": t / steps} for k, (c, t) in top],
        "kernel_us_per_step": dict(sorted(by_kernel.items(), key=lambda kv: -kv[1])),
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.2-1b")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--gap-us", type=float, default=2.0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--kernels", type=int, default=10, help="kernels printed, by time a step")
    args = ap.parse_args(argv)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    mr = build_model_runner(  # pages for twice the rows: the runner-alone batches beside
        args.model, "cuda", torch.bfloat16, 2 * max(sizes), args.context + args.steps + 64
    )
    engine = Engine(
        mr, "exact", RunnerConfig(capture_bs=sizes, show_progress=False), max_running=max(sizes)
    )
    g = torch.Generator().manual_seed(0)
    out = {}
    try:
        for bs in sizes:
            prompts = torch.randint(1, mr.config.vocab_size, (bs, args.context), generator=g)
            trace_steps(engine, prompts.tolist(), 4)  # untimed: compiles
            res = analyse(trace_steps(engine, prompts.tolist(), args.steps), args.gap_us)
            alone = analyse(trace_replays(engine, bs, args.context, args.steps), args.gap_us)
            # the context the engine's requests had halfway through its traced steps
            mid = args.context + WARM_STEPS + args.steps // 2
            alone_mid = analyse(trace_replays(engine, bs, mid, args.steps), args.gap_us)
            out[bs] = {"engine": res, "runner_alone": alone, "runner_alone_mid": alone_mid}
            runs = (
                ("engine", res),
                ("runner alone", alone),
                (f"runner alone, ctx {mid}", alone_mid),
            )
            for what, r in runs:
                print(
                    f"bs {bs} {what}: period {r['period_us']:.1f} µs, busy "
                    f"{r['busy_us_per_step']:.1f} µs a step ({r['steps']} steps)"
                )
                for gp in r["gaps"]:
                    print(f"   {gp['us_per_step']:7.2f} µs/step  x{gp['count']:<4} {gp['pair']}")
                for name, us in list(r["kernel_us_per_step"].items())[: args.kernels]:
                    print(f"   {us:7.2f} µs/step  {name}")
    finally:
        engine.shutdown()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
