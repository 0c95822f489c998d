"""FP8-weight GEMV (``kernels/proj/fp8_gemv``, scales per channel and per 128x128 block) against our
bf16 GEMV (``kernels/proj/gemv``) at Llama-3.2-1B's and Llama-3.1-8B's projection shapes, 1 and 8
rows of bf16 activations.

    PYTHONPATH=. python3 benchmarks/fp8_gemv.py --json $OUT/fp8_gemv.json [--sweep]

Each case is checked against a float64 reference first (a wrong one is reported, never timed);
then calls over enough weight copies to exceed the 50 MB L2 are captured in one CUDA graph and
replayed: median µs per call (CUDA events), GB/s of the bytes read (weights, scales), and the
share of the copy bandwidth measured in the same run (``of bw``: the floor over the time).
``--sweep`` also times a few other FP8 tiles per case and prints the best (for the tile rule).
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from stepgraph.bench.timing import copy_bandwidth_gbps, graph_call_us
from stepgraph.kernels.proj.fp8_gemv import fp8_gemv, fp8_gemv_reference, fp8_tile
from stepgraph.kernels.proj.gemv import gemv
from stepgraph.kernels.proj.tile_table import Tile
from stepgraph.model.fp8_weight import Fp8Weight, quantize_per_block, quantize_per_channel

SHAPES = {  # (N, K) of the fused projections
    "1b qkv": (3072, 2048),
    "1b o": (2048, 2048),
    "1b gate_up": (16384, 2048),
    "1b down": (2048, 8192),
    "8b qkv": (6144, 4096),
    "8b o": (4096, 4096),
    "8b gate_up": (28672, 4096),
    "8b down": (4096, 14336),
}
ROWS = (1, 8)
L2_BYTES = 200 << 20  # read this much per replay: well past the H200's 50 MB L2
SWEEP = {  # --sweep: (block_n, block_k, num_warps, num_stages, split_k) beside the rule's tile
    1: [
        Tile(16, 512, 4),
        Tile(8, 1024, 4),
        Tile(32, 256, 4),
        Tile(64, 128, 4),
        Tile(32, 128, 4),
        Tile(16, 512, 8),
    ],
    8: [
        Tile(32, 128, 4, 3),
        Tile(64, 128, 4, 3),
        Tile(32, 128, 4, 4),
        Tile(16, 128, 4, 4),
        Tile(64, 128, 8, 3),
    ],
}


def copies_for(nbytes: int) -> int:
    return max(2, min(16, -(-L2_BYTES // nbytes)))


def with_split(t: Tile, m: int, n: int, k: int, block) -> Tile:
    """``t`` with the rule's split of K for its column tiles (block_k capped by the blocks)."""
    bk = min(t.block_k, block[1]) if block else t.block_k
    rule = fp8_tile(m, n, k, block)
    split = 1
    while -(-n // t.block_n) * split < 256 and k >= 4 * split * bk:
        split *= 2
    return Tile(t.block_n, bk, t.num_warps, t.num_stages or rule.num_stages, split)


def run_case(name, m, fmt, gbps, sweep, g) -> list[dict]:
    n, k = SHAPES[name]
    block = None if fmt in ("bf16", "channel") else (128, 128)
    w = torch.randn(n, k, device="cuda", generator=g) * k**-0.5
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    if fmt == "bf16":
        ws = [w.bfloat16()]
        nbytes = n * k * 2
    else:
        ws = [quantize_per_channel(w) if block is None else quantize_per_block(w, block)]
        nbytes = ws[0].nbytes
    copies = copies_for(nbytes)
    if fmt == "bf16":
        ws = [ws[0].clone() for _ in range(copies)]
        want = x.double() @ ws[0].double().T
        tiles = [None]
    else:
        ws = [Fp8Weight(ws[0].data.clone(), ws[0].scale.clone(), block) for _ in range(copies)]
        want = fp8_gemv_reference(x, ws[0].data, ws[0].scale, block)
        tiles = [None] + ([with_split(t, m, n, k, block) for t in SWEEP[m]] if sweep else [])
    rows = []
    for tile in dict.fromkeys(tiles):
        if fmt == "bf16":
            call = lambda w, t=tile: gemv(x, w)  # noqa: E731
        else:
            call = lambda w, t=tile: fp8_gemv(x, w.data, w.scale, block, tile=t)  # noqa: E731
        shown = (
            "gemv"
            if fmt == "bf16"
            else str(list((tile or fp8_tile(m, n, k, block)).__dict__.values())[:5])
        )
        row = dict(
            shape=name, m=m, format=fmt, n=n, k=k, tile=shown, bytes=nbytes, rule=tile is None
        )
        try:
            row["rel_err"] = ((call(ws[0]).double() - want).norm() / want.norm()).item()
            if row["rel_err"] < 2e-2:
                us = graph_call_us([lambda w=w, c=call: c(w) for w in ws])
                row.update(us=us, gbps=nbytes / us / 1e3, of_bw=nbytes / gbps / 1e3 / us)
        except Exception as e:  # out of registers, shared memory, ...
            row["error"] = f"{type(e).__name__}: {e}"[:160]
        rows.append(row)
    del ws
    torch.cuda.empty_cache()
    return rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    ap.add_argument("--sweep", action="store_true", help="also time other FP8 tiles")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma list of " + ", ".join(SHAPES))
    args = ap.parse_args(argv)
    g = torch.Generator(device="cuda").manual_seed(0)
    gbps = copy_bandwidth_gbps()
    rows = []
    for name in [s for s in args.shapes.split(",") if s]:
        for m in ROWS:
            for fmt in ("bf16", "channel", "block"):
                rows += run_case(name, m, fmt, gbps, args.sweep, g)
    print(f"copy bandwidth {gbps:.0f} GB/s ({torch.cuda.get_device_name()})")
    print(
        f"{'shape':>11} {'m':>2} {'format':>7} {'tile':>26} {'us':>7} {'GB/s':>6} {'of bw':>6} "
        f"{'x bf16':>6} err"
    )
    bf16 = {(r["shape"], r["m"]): r.get("us") for r in rows if r["format"] == "bf16"}
    for r in rows:
        head = f"{r['shape']:>11} {r['m']:>2} {r['format']:>7} {r['tile']:>26}"
        if "us" not in r:
            print(head, r.get("error") or f"wrong: rel_err {r['rel_err']:.1e}")
            continue
        base = bf16.get((r["shape"], r["m"]))
        r["speedup"] = base / r["us"] if base else None
        print(
            f"{head} {r['us']:7.2f} {r['gbps']:6.0f} {100 * r['of_bw']:5.1f}% "
            f"{r['speedup'] or 0:5.2f}x {r['rel_err']:.1e}{'' if r['rule'] else ' sweep'}"
        )
    result = dict(copy_gbps=gbps, rows=rows)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
