"""Decode capture time and memory: the default bucket list of sglang-sized runners (36 buckets,
bs 1..512) captured for the llama-3.2-1b preset, in graph and exact mode: seconds and pool MiB.

    PYTHONPATH=. python benchmarks/model_capture.py --json out/model_capture.json
    (--quantization fp8: the projections' weights in e4m3, per channel)

Targets: all 36 buckets in <= 2 s with <= 0.25 GiB of pool (FP8 weights: no larger than
bf16's).

The modes run one after the other in one process, in ``--modes`` order: the first pays every
kernel variant's first use (a Triton compile, or a load from its disk cache) in its eager
warm-ups, the later ones find them compiled. ``warmup_seconds`` (per bucket in the ledger)
says how much of each capture that was; ``--modes exact,graph`` swaps who pays. Each mode also
prints its seconds by phase (the first eager run of each bucket, host time; the later ones;
recording and instantiating; exact's plan of the attention nodes) and the wall time of the
runner's construction, which adds the loop's own work (freezing the collector, buffers).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from stepgraph.bench.workload import build_model_runner
from stepgraph.runner import CudaGraphRunner, RunnerConfig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--max-bs", type=int, default=512)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--model", default="llama-3.2-1b", help="preset (random weights)")
    ap.add_argument("--ledger", action="store_true", help="print the per-bucket ledger")
    ap.add_argument("--modes", default="graph,exact", help="capture order, e.g. exact,graph")
    ap.add_argument(
        "--quantization",
        choices=("fp8",),
        default=None,
        help="fp8: the projections' weights quantized to e4m3 on load, per channel",
    )
    ap.add_argument(
        "--warmup-iters",
        type=int,
        default=RunnerConfig.warmup_iters,
        help="eager runs of each bucket before its capture (RunnerConfig.warmup_iters)",
    )
    args = ap.parse_args()
    mr = build_model_runner(
        args.model,
        "cuda",
        torch.bfloat16,
        args.max_bs,
        args.context,
        quantization=args.quantization,
    )
    rows = {}
    modes = args.modes.split(",")
    for mode in modes:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        runner = CudaGraphRunner(
            mr,
            RunnerConfig(
                max_bs=args.max_bs,
                mode=mode,
                show_progress=False,
                warmup_iters=args.warmup_iters,
            ),
        )
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0  # the runner's construction: what a caller waits
        s = runner.stats.capture
        rows[mode] = {
            "buckets": len(s.buckets),
            "seconds": round(s.seconds, 3),
            "wall_seconds": round(wall, 3),
            "kernel_variants": s.kernel_variants,  # first used in this process, in this capture
            # first eager runs (host), later ones, recording, exact's plan, the rest
            "phases": {k: round(v, 3) for k, v in s.phases().items()},
            # the eager warm-ups: first-use compiles of the kernel variants land here
            "warmup_seconds": round(s.warmup_seconds, 3),
            "capture_seconds_after_warmup": round(s.seconds - s.warmup_seconds, 3),
            "pool_mib": round(s.pool_bytes / 2**20, 1),
            "slowest_bucket_s": round(max(b.seconds for b in s.buckets), 3),
            # outside the pool: the shared output and workspaces the warm-ups left live
            "outside_mib": round(s.outside_bytes / 2**20, 1),
            "pool_held_mib": None
            if s.pool_held_bytes is None
            else round(s.pool_held_bytes / 2**20, 1),
            "ledger": s.ledger(),  # seconds and MiB per bucket, in capture order
        }
        if args.ledger:
            print(f"{mode}:\n{s.ledger_table()}")
        runner.shutdown()
        torch.cuda.empty_cache()
    rows["model"] = args.model
    rows["quantization"] = args.quantization
    rows["summary"] = {
        f"{m}_{k}": v for m in modes for k, v in rows[m].items() if k not in ("ledger", "phases")
    }
    rows["order"] = modes
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    for mode in modes:
        r = rows[mode]
        print(
            f"{mode:<6} {r['buckets']} buckets in {r['seconds']:.2f} s (target <= 2; warm-ups "
            f"{r['warmup_seconds']:.2f} s), "
            f"pool {r['pool_mib']:.0f} MiB (target <= 256; allocator's count "
            f"{r['pool_held_mib']}), outside {r['outside_mib']:.0f} MiB, "
            f"slowest {r['slowest_bucket_s']} s; "
            f"the runner's construction {r['wall_seconds']:.2f} s, "
            f"{r['kernel_variants']} kernel variants first used"
        )
        print("       by phase (s): " + ", ".join(f"{k} {v:.2f}" for k, v in r["phases"].items()))


if __name__ == "__main__":
    main()
