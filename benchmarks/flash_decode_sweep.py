"""The split-KV kernel's sweep: every variant x ladder target, on Llama-3.2-1B attention (32 query
heads, 8 KV heads, head dim 64, bf16, page size 64), to choose the default after measuring.

    PYTHONPATH=. python3 benchmarks/flash_decode_sweep.py --json $OUT/sweep.json

A variant is a ``KernelVariant`` (tile, warps, pipelining depth, page-per-tile lookup, K layout,
tensor cores) and a ladder target ``programs_per_sm`` (which gives the split count ``ns``). Per
point, each (config, ns) is captured in a CUDA graph (main + combine) and replayed; the time is
the median of CUDA-event samples (``cuda_time_ms`` via ``benchmarks/flash_decode.time_us``).
"%copy" = K+V bytes of live tokens / time / copy bandwidth measured in the same run.

Correctness, never timed: each config runs once on a small mixed-length batch against the
float64 reference, and every timed output is compared for request 0 with an fp32 reference of
the point. A variant that fails either is flagged and never picked.

The last lines printed: per point the default next to the best variant, then the variant with
the best geometric mean over all points. To adopt it, edit ``DEFAULT_VARIANTS`` in
``stepgraph/kernels/decode/flash_decode.py`` and ``PROGRAMS_PER_SM`` in
``stepgraph/kernels/decode/splits.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time

import torch

from benchmarks.flash_decode import DTYPE, HEAD_DIM, N_HEADS, N_KV, PAGE_SIZE, graph_of, time_us
from stepgraph.bench.timing import copy_bandwidth_gbps
from stepgraph.kernels.decode.flash_decode import DecodeWorkspace, KernelVariant, flash_decode
from stepgraph.kernels.decode.flash_decode import default_variant as _default_variant
from stepgraph.kernels.decode.reference import paged_decode_reference
from stepgraph.kernels.decode.splits import PROGRAMS_PER_SM, num_splits_for

MAX_SPLITS = 64
POINTS = [
    (1, 512),
    (1, 4096),
    (1, 32768),
    (1, 131072),
    (8, 4096),
    (8, 32768),
    (8, 131072),
    (32, 4096),
    (32, 32768),
    (32, 131072),
]
LADDER_TARGETS = tuple(sorted({2, 4, 8, PROGRAMS_PER_SM}))  # programs_per_sm values tried
DEV = "cuda"
REL_TOL = 2e-2  # bf16 output against an fp32 / fp64 reference


def _variants() -> list[KernelVariant]:
    seed = KernelVariant(block_n=64, num_warps=4, num_stages=2, page_tile=False, k_rows=False)
    grid = [
        KernelVariant(block_n=n, num_warps=w, num_stages=s)
        for n in (64, 128)
        for w in (4, 8)
        for s in (2, 3, 4)
    ]
    one_off = [  # one factor changed from the predicted default (n64w4s3)
        KernelVariant(num_stages=3, k_rows=False),
        KernelVariant(num_stages=3, page_tile=False),
        KernelVariant(num_stages=3, use_dot=False),
        KernelVariant(num_stages=3, num_warps=8, use_dot=False),
    ]
    out = [seed, *grid, *one_off, _default_variant(HEAD_DIM, PAGE_SIZE, DTYPE)]
    return list(dict.fromkeys(out))  # dedupe, keep order


VARIANTS = _variants()  # also checked one by one in tests/gpu/test_flash_decode_gpu.py


def default_variant() -> KernelVariant:
    return _default_variant(HEAD_DIM, PAGE_SIZE, DTYPE)


def make_inputs(bs: int, lens: list[int], seed: int) -> tuple[torch.Tensor, ...]:
    """Paged caches with pages scattered over the pool; block-table width padded to 16 columns
    (so its stride specialises the same way at every point: one compile per variant)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    used = [-(-n // PAGE_SIZE) for n in lens]
    width = -(-max(used) // 16) * 16
    n_pages = sum(used)
    k = torch.randn(n_pages, PAGE_SIZE, N_KV, HEAD_DIM, generator=g, device=DEV).to(DTYPE)
    v = torch.randn_like(k)
    perm = torch.randperm(n_pages, generator=g, device=DEV).to(torch.int32)
    bt = torch.zeros(bs, width, dtype=torch.int32, device=DEV)
    first = 0
    for b, n in enumerate(used):
        bt[b, :n] = perm[first : first + n]
        first += n
    q = torch.randn(bs, N_HEADS, HEAD_DIM, generator=g, device=DEV).to(DTYPE)
    sl = torch.tensor(lens, dtype=torch.int32, device=DEV)
    return q, k, v, bt, sl


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    err = (got.double() - ref.double()).abs().max() / ref.double().abs().max()
    return float(err.nan_to_num(float("inf")))


def check_small(cfg: KernelVariant) -> float:
    """Relative error on a mixed-length batch (tile and page edges, several splits)."""
    lens = [1, 63, 65, 1000, 4097, 130]
    q, k, v, bt, sl = make_inputs(len(lens), lens, seed=5)
    ref = paged_decode_reference(q, k, v, bt, sl, compute_dtype=torch.float64)
    errs = []
    for ns in (1, 7, 64):
        ws = DecodeWorkspace.allocate(len(lens), N_HEADS, HEAD_DIM, MAX_SPLITS, DEV)
        got = flash_decode(q, k, v, bt, sl, num_splits=ns, workspace=ws, variant=cfg)
        errs.append(rel_err(got, ref))
    return max(errs)


def sweep_point(
    bs: int, t_kv: int, num_sms: int, copy_gbps: float, configs: list[KernelVariant], bad: set[str]
) -> dict:
    q, k, v, bt, sl = make_inputs(bs, [t_kv] * bs, seed=bs * 7 + t_kv)
    ws = DecodeWorkspace.allocate(bs, N_HEADS, HEAD_DIM, MAX_SPLITS, DEV)
    out = torch.empty_like(q)
    ref0 = paged_decode_reference(q[:1], k, v, bt[:1], sl[:1], compute_dtype=torch.float32)
    kv_bytes = 2 * bs * t_kv * N_KV * HEAD_DIM * k.element_size()
    frac = lambda us: kv_bytes / (us * 1e-6) / 1e9 / copy_gbps
    ns_of = {p: num_splits_for(t_kv, N_KV, bs, num_sms, MAX_SPLITS, p) for p in LADDER_TARGETS}

    rows = []
    for cfg in configs:
        by_ns: dict[int, tuple[float, float]] = {}
        for ns in sorted(set(ns_of.values())):
            run = lambda ns=ns, cfg=cfg: flash_decode(
                q, k, v, bt, sl, num_splits=ns, workspace=ws, out=out, variant=cfg
            )
            us = time_us(graph_of(run).replay)
            err = rel_err(out[:1], ref0)
            if err > REL_TOL:
                bad.add(cfg.name)
            by_ns[ns] = (us, err)
        for pps, ns in ns_of.items():
            us, err = by_ns[ns]
            rows.append(
                {
                    "variant": cfg.name,
                    "config": dataclasses.asdict(cfg),
                    "programs_per_sm": pps,
                    "ns": ns,
                    "us": us,
                    "frac_copy": frac(us),
                    "rel_err": err,
                }
            )
    torch.cuda.empty_cache()
    return {"bs": bs, "t_kv": t_kv, "kv_bytes": kv_bytes, "rows": rows}


def geomean(xs: list[float]) -> float:
    return math.exp(sum(map(math.log, xs)) / len(xs))


def summary(points: list[dict], bad: set[str], copy_gbps: float) -> str:
    dflt = (default_variant().name, PROGRAMS_PER_SM)
    key = lambda r: (r["variant"], r["programs_per_sm"])
    lines = [
        f"copy bandwidth {copy_gbps:.0f} GB/s; {len(VARIANTS)} configs x programs_per_sm "
        f"{LADDER_TARGETS}; default {dflt[0]} pps {dflt[1]}"
    ]
    head = f"{'bs':>3} {'t_kv':>7} | dflt ns {'us':>8} {'%copy':>6} | {'best variant':<18} "
    head += f"{'pps':>3} {'ns':>3} {'us':>8} {'%copy':>6} {'x_dflt':>6}"
    lines += [head, "-" * len(head)]
    per_key: dict[tuple, list[float]] = {}
    for p in points:
        by = {key(r): r for r in p["rows"]}
        for kk, r in by.items():
            per_key.setdefault(kk, []).append(r["us"])
        d = by[dflt]
        ok = [r for r in p["rows"] if r["variant"] not in bad]
        b = min(ok, key=lambda r: r["us"]) if ok else d
        lines.append(
            f"{p['bs']:>3} {p['t_kv']:>7} | {d['ns']:>7} {d['us']:>8.1f}"
            f" {100 * d['frac_copy']:>5.0f}%"
            f" | {b['variant']:<18} {b['programs_per_sm']:>3} {b['ns']:>3} {b['us']:>8.1f}"
            f" {100 * b['frac_copy']:>5.0f}% {d['us'] / b['us']:>6.2f}"
        )
    gm = {kk: geomean(v) for kk, v in per_key.items() if len(v) == len(points)}
    ranked = sorted((v, kk) for kk, v in gm.items() if kk[0] not in bad)
    lines.append(
        "geomean us over the points, best five: "
        + ", ".join(f"{n} pps {p}: {v:.1f}" for v, (n, p) in ranked[:5])
    )
    if ranked:
        v, (n, p) = ranked[0]
        lines.append(
            f"BEST OVERALL {n} pps {p}: geomean {v:.1f} us; DEFAULT {dflt[0]} pps "
            f"{dflt[1]}: {gm.get(dflt, float('nan')):.1f} us "
            f"(x{gm.get(dflt, float('nan')) / v:.2f})"
        )
    lines.append(f"flagged wrong (never picked): {sorted(bad) or 'none'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None, help="write every timing here")
    ap.add_argument("--points", default=None, help='e.g. "1:4096,32:131072" (default: all)')
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/flash_decode_sweep.py needs a CUDA GPU")
    points = POINTS
    if args.points:
        points = [tuple(map(int, p.split(":"))) for p in args.points.split(",")]

    t0 = time.perf_counter()
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    copy_gbps = copy_bandwidth_gbps()
    bad: set[str] = set()  # wrong against a reference: timed, never picked
    checks: dict[str, float | str] = {}
    configs = []
    for cfg in VARIANTS:  # compiles every variant, and checks it against float64
        try:
            checks[cfg.name] = check_small(cfg)
        except Exception as e:  # a variant that does not compile is reported, not timed
            checks[cfg.name] = f"{type(e).__name__}: {str(e)[:300]}"
            print(f"{cfg.name} failed: {checks[cfg.name]}")
            continue
        configs.append(cfg)
        if not checks[cfg.name] <= REL_TOL:
            bad.add(cfg.name)
    print(f"compiled and checked {len(VARIANTS)} configs in {time.perf_counter() - t0:.1f} s")
    results = []
    for bs, t_kv in points:
        results.append(sweep_point(bs, t_kv, num_sms, copy_gbps, configs, bad))
        print(f"  bs={bs} t_kv={t_kv} done at {time.perf_counter() - t0:.1f} s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "device": torch.cuda.get_device_name(0),
                    "num_sms": num_sms,
                    "copy_gbps": copy_gbps,
                    "default": default_variant().name,
                    "programs_per_sm_default": PROGRAMS_PER_SM,
                    "small_check": checks,
                    "flagged": sorted(bad),
                    "points": results,
                },
                f,
                indent=1,
            )
    print(summary(results, bad, copy_gbps))


if __name__ == "__main__":
    main()
