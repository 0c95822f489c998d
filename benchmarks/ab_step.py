"""A/B of the fused decode step's switches in one process, interleaved: one model, and for each
round, variant and batch size a graph captured at that bucket alone, its median ms per step
(CUDA events after warm-up, as ``stepgraph bench`` times it), the fraction of the bandwidth
floor and the kernels a step. Variants are sets of ``STEPGRAPH_*`` switches; the step's
import-time flags are re-read after each is set (``STEPGRAPH_PROJ_TILES``,
``STEPGRAPH_PROJ_CUBLAS``, ``STEPGRAPH_SEPARATE_NORM``,
``STEPGRAPH_REFERENCE_BUCKETS``, ``STEPGRAPH_CUBLAS_HANDOFF``, ``STEPGRAPH_HANDOFF_MIN_BUCKET``,
``STEPGRAPH_ATTENTION_PDL``, ``STEPGRAPH_FOLD_MERGE``, ``STEPGRAPH_MIN_SPLIT_KEYS``,
``STEPGRAPH_WIDE_MIN_SPLIT_KEYS`` and ``STEPGRAPH_PROGRAMS_PER_SM`` among them;
``STEPGRAPH_PDL_TRIGGER`` and ``STEPGRAPH_ATTN_VARIANT`` are read at each launch).

    PYTHONPATH=. python3 benchmarks/ab_step.py --batch-sizes 8,32 --context 512 --rounds 2 \\
        --variant base: --variant "plain:STEPGRAPH_ARGMAX_FOLD=0;STEPGRAPH_PDL=0"

The last column compares each variant's logits with the first variant's on the same batch
(bit for bit where the variant changes no arithmetic: PDL, schedules).

Each bs is captured as a bucket of its own, so the kernel choices keyed by a default bucket
(``tile_table``'s, ``REFERENCE_ROWS``) apply to it only where it is one (1, 2, 4, 8, 16, 32,
48, 64): bs 3 here is bucket 3, where serving replays it in bucket 4 (run J9's bs 3 row).

Rounds interleave the variants, so a drift of the GPU over the run shows as a spread between
rounds rather than as a difference between variants (bs 8 varies about 2% between calls).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from stepgraph.bench.modes import kernels_per_step, time_step
from stepgraph.bench.timing import copy_bandwidth_gbps
from stepgraph.bench.workload import (
    Point,
    build_model_runner,
    decode_batch,
    kv_bytes,
    weight_bytes,
)
from stepgraph.kernels import proj_tiles, splits
from stepgraph.model import fused_decode, fused_mlp, step_attention
from stepgraph.model.kernel_choice import attention_pdl_env, buckets_env
from stepgraph.runner import CudaGraphRunner, RunnerConfig


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    """``name:VAR=V;VAR2=V2`` -> (name, env); ``name:`` is the defaults."""
    name, _, body = text.partition(":")
    env = {}
    for item in filter(None, body.split(";")):
        key, _, value = item.partition("=")
        env[key.strip()] = value.strip()
    return name, env


def apply(env: dict[str, str], saved: dict[str, str | None]) -> None:
    """Set ``env`` over the saved originals, and re-read the step's import-time flags."""
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    for key, value in env.items():
        saved.setdefault(key, os.environ.get(key))
        os.environ[key] = value
    fused_decode.NORM_HANDOFF = os.environ.get("STEPGRAPH_NORM_HANDOFF", "1") != "0"
    fused_decode.HANDOFF_MIN_BUCKET = int(
        os.environ.get("STEPGRAPH_HANDOFF_MIN_BUCKET", fused_decode.HANDOFF_MIN_BUCKET_DEFAULT)
    )
    fused_decode.NO_PDL_ENV = buckets_env("STEPGRAPH_NO_PDL_BUCKETS", None)
    # (STEPGRAPH_PDL_TRIGGER: read at every launch)
    step_attention.ATTENTION_PDL = attention_pdl_env()
    step_attention.FOLD_MERGE = buckets_env("STEPGRAPH_FOLD_MERGE", None)
    splits.MIN_SPLIT_KEYS = splits.min_split_keys_env()
    splits.CAP2_MIN_SPLIT_KEYS = splits.cap2_min_split_keys_env()
    splits.PROGRAMS_PER_SM = splits.programs_per_sm_env()
    splits.WIDE_MIN_SPLIT_KEYS = splits.wide_min_split_keys_env()
    # (STEPGRAPH_ATTN_VARIANT: read at every launch)
    fused_decode.REFERENCE_ROWS = buckets_env(
        "STEPGRAPH_REFERENCE_ROWS", fused_decode.REFERENCE_ROWS_DEFAULT
    )
    fused_mlp.CUBLAS_HANDOFF = os.environ.get("STEPGRAPH_CUBLAS_HANDOFF", "1") != "0"
    # STEPGRAPH_PROJ_TILES (a sweep's tiles), STEPGRAPH_PROJ_CUBLAS, STEPGRAPH_SEPARATE_NORM
    proj_tiles.reload_env_tiles()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-3.2-1b")
    ap.add_argument("--batch-sizes", default="8,32")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--variant", action="append", required=True, help="name:VAR=V;VAR2=V2")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json")
    args = ap.parse_args()
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    variants = [parse_variant(v) for v in args.variant]
    mr = build_model_runner(args.model, "cuda", torch.bfloat16, max(sizes), args.context + 64)
    gbps = copy_bandwidth_gbps()
    wbytes = weight_bytes(mr)
    saved: dict[str, str | None] = {}
    ms: dict[tuple[str, int], list[float]] = {}
    kernels: dict[tuple[str, int], float] = {}
    logits_of: dict[int, torch.Tensor] = {}  # the first variant's logits at each bs
    diff: dict[tuple[str, int], float] = {}  # each variant's max |logits - the first's|
    for _ in range(args.rounds):
        for name, env in variants:
            apply(env, saved)
            for bs in sizes:
                point = Point(bs, args.context)
                cfg = RunnerConfig(capture_bs=(bs,), max_bs=bs, show_progress=False)
                runner = CudaGraphRunner(mr, cfg)
                batch, pages = decode_batch(mr, point)
                try:
                    step = lambda b=batch, r=runner: r.replay(b)  # noqa: E731 - the timed call
                    ms.setdefault((name, bs), []).append(time_step(step, args.iters))
                    if (name, bs) not in kernels:
                        kernels[(name, bs)] = kernels_per_step(step)
                        logits = step().float().clone()  # same batch: same K/V, same bits
                        first = logits_of.setdefault(bs, logits)
                        diff[(name, bs)] = (logits - first).abs().max().item()
                finally:
                    runner.shutdown()
                    for p in pages:
                        mr.kv_cache.release(p)
    apply({}, saved)
    print(f"{args.model}, ctx {args.context}, graph, copy bandwidth {gbps:.0f} GB/s")
    print(f"{'variant':<16}{'bs':>4}{'ms (each round)':>28}{'median':>9}{'floor':>7}{'kern':>6}"
          f"{'logits vs first':>17}")  # fmt: skip
    rows = []
    for name, _ in variants:
        for bs in sizes:
            t = ms[(name, bs)]
            floor = (wbytes + kv_bytes(mr, Point(bs, args.context))) / (gbps * 1e9) * 1e3
            med = statistics.median(t)
            each = " ".join(f"{x:.3f}" for x in t)
            d = diff[(name, bs)]
            same = "same bits" if d == 0 else f"max diff {d:.2e}"
            print(f"{name:<16}{bs:>4}{each:>28}{med:>9.3f}{floor / med:>7.0%}"
                  f"{kernels[(name, bs)]:>6.0f}{same:>17}")  # fmt: skip
            rows.append(dict(variant=name, bs=bs, ms=t, median=med, of_floor=floor / med,
                             kernels=kernels[(name, bs)], logits_max_diff=d))  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(model=args.model, context=args.context, gbps=gbps, rows=rows), f)


if __name__ == "__main__":
    main()
