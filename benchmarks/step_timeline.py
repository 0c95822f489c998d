"""Where one decode step's time goes, kernel by kernel, on the device's own clock: the fused step
replayed from a CUDA graph under torch.profiler (CUPTI records each kernel inside the graph),
the kernels of one replay in launch order, and per kind of kernel:

- ``own``: its span, first program's start to last program's end (with PDL it includes the
  wait beside its predecessor);
- ``gap``: its start minus its predecessor's end (negative: it started early, PDL);
- ``advance``: its end minus its predecessor's end, how far it moved the step's frontier. The
  advances of a replay add up to the step, so they say where the step's time goes, which the
  sum of spans (``model_step.py``'s profile) cannot once kernels overlap.

Kinds are the kernel's name and its position in the layer (``_norm_gemv_kernel`` serves o_proj
and down), as medians over the middle layers of several replays, in µs.

    PYTHONPATH=. python3 benchmarks/step_timeline.py --batch-sizes 1,8,32 --context 512
    PYTHONPATH=. python3 benchmarks/step_timeline.py --quantization fp8   # FP8 weights
    STEPGRAPH_PDL=0 PYTHONPATH=. python3 benchmarks/step_timeline.py   # each kernel alone
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict

import torch

from stepgraph.bench.modes import time_step
from stepgraph.bench.workload import Point, build_model_runner, decode_batch
from stepgraph.runner import CudaGraphRunner, RunnerConfig


def replay_kernels(step, replays: int) -> list[list[tuple[str, float, float]]]:
    """[(name, start µs, end µs)] of each replay's kernels, in start order."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    runs = []
    for _ in range(replays):  # one replay per trace: its kernels are the whole trace
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        ks = [
            (e.name, e.time_range.start, e.time_range.end)
            for e in prof.events()
            if e.device_type == DeviceType.CUDA and "emcpy" not in e.name
        ]
        runs.append(sorted(ks, key=lambda k: k[1]))
    return runs


def layer_period(names: list[str]) -> tuple[int, int]:
    """(kernels a layer, index of a middle layer's attention): the names repeat with the layer's
    period in the middle of the step (layer 0 and the head may differ)."""
    n = len(names)
    mid = n // 4
    for per in range(2, 40):
        if mid + 3 * per < n and all(names[i] == names[i + per] for i in range(mid, mid + 2 * per)):
            start = next((i for i in range(mid, mid + per) if "split_kv" in names[i]), mid)
            return per, start
    raise RuntimeError(f"no layer period in {n} kernels: {names[:20]} ...")


def layer_rows(runs, num_layers: int) -> tuple[list[dict], float]:
    """Per kind of kernel of a layer (from its attention on), over half the layers from the
    middle of each replay: medians of own, gap and advance (µs); and the median traced step."""
    own, gap, adv = defaultdict(list), defaultdict(list), defaultdict(list)
    keys: list[str] = []
    steps = []
    for ks in runs:
        steps.append(ks[-1][2] - ks[0][1])
        per, start = layer_period([k[0] for k in ks])
        for i in range(start, min(start + per * (num_layers // 2), len(ks) - per)):
            name, t0, t1 = ks[i]
            key = f"{(i - start) % per}:{name}"
            if key not in keys:
                keys.append(key)
            own[key].append(t1 - t0)
            gap[key].append(t0 - ks[i - 1][2])
            adv[key].append(t1 - ks[i - 1][2])
    rows = [
        dict(
            kernel=k,
            own=statistics.median(own[k]),
            gap=statistics.median(gap[k]),
            advance=statistics.median(adv[k]),
        )
        for k in keys
    ]
    return rows, statistics.median(steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-3.2-1b")
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--replays", type=int, default=5)
    ap.add_argument("--quantization", default=None, choices=("fp8",), help="FP8 weights")
    ap.add_argument("--json")
    args = ap.parse_args()
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    mr = build_model_runner(
        args.model,
        "cuda",
        torch.bfloat16,
        max(sizes),
        args.context + 64,
        quantization=args.quantization,
    )
    layers = mr.config.num_layers
    out = []
    for bs in sizes:
        cfg = RunnerConfig(capture_bs=(bs,), max_bs=bs, show_progress=False)
        runner = CudaGraphRunner(mr, cfg)
        batch, pages = decode_batch(mr, Point(bs, args.context))
        try:
            step = lambda b=batch, r=runner: r.replay(b)  # noqa: E731
            ms = time_step(step, 20)
            runs = replay_kernels(step, args.replays)
        finally:
            runner.shutdown()
            for p in pages:
                mr.kv_cache.release(p)
        rows, span = layer_rows(runs, layers)
        per_layer = sum(r["advance"] for r in rows)
        print(
            f"\nbs {bs}, ctx {args.context}: {ms * 1e3:.1f} µs a step (CUDA events), "
            f"{span:.1f} traced, {len(runs[0])} kernels, a layer {per_layer:.1f} µs"
        )
        print(f"  {'kernel (position in the layer)':<40}{'own':>8}{'gap':>8}{'advance':>9}")
        for r in rows:
            print(f"  {r['kernel'][:40]:<40}{r['own']:8.2f}{r['gap']:8.2f}{r['advance']:9.2f}")
        out.append(
            dict(
                bs=bs,
                context=args.context,
                step_us=ms * 1e3,
                traced_us=span,
                kernels=len(runs[0]),
                layer_us=per_layer,
                rows=rows,
            )
        )
    if args.json:  # "summary": what scripts/gpu-check's closing table prints
        summary = {f"layer_us_bs{p['bs']}": round(p["layer_us"], 2) for p in out}
        with open(args.json, "w") as f:
            json.dump(dict(summary=summary, points=out), f, indent=1)


if __name__ == "__main__":
    main()
