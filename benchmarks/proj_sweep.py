"""Tile sweep of the fused projections at several rows (``tl.dot``, M padded to 16/32/64,
split-K), Llama-3.2-1B shapes (``--preset`` another model's), bf16, PDL on, against cuBLAS
``F.linear`` of the same shape.

    PYTHONPATH=. python3 benchmarks/proj_sweep.py --json $OUT/proj_sweep.json
    (--compile-only --shard i/n first, in parallel processes, fills Triton's cache)

Per (kernel, bs): every candidate ``Tile`` is checked against torch on one weight (a wrong one
is reported, never timed), then 16 calls over 16 weights (more than the 50 MB L2) are captured
in one graph and replayed: µs per call, GB/s of weight bytes. The best tile per
``(kernel, n, k, BLOCK_M)`` is printed as the ``tile_table.TILES`` literal.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F

from stepgraph.bench.timing import copy_bandwidth_gbps, graph_call_us
from stepgraph.kernels.elementwise.rope_kv import rope_kv_reference
from stepgraph.kernels.proj.gate_up_silu import gate_up_silu, gate_up_silu_reference
from stepgraph.kernels.proj.norm_gemv import gemv_residual
from stepgraph.kernels.proj.proj_tiles import Tile, block_m, tile_for
from stepgraph.kernels.proj.qkv_rope import qkv_rope, qkv_rope_reference
from stepgraph.kernels.sampling.lm_head_argmax import lm_head_argmax, lm_head_argmax_reference

H, Q, KV, INTER, VOCAB, HD = 2048, 2048, 512, 8192, 128256, 64  # llama-3.2-1b; --preset
DT = torch.bfloat16
ROWS = (8, 32, 64)  # one per BLOCK_M bucket: 16, 32, 64
COPIES = 16
T = Tile
CANDIDATES = {  # (block_n, block_k, num_warps, num_stages, split_k[, tma]); block_n: the kernel's
    # pointer tiles (among them one-chunk tiles, the program's whole K range loaded before the
    # PDL wait), then TMA tiles of both kinds (tma 1: swap-AB, x by descriptor; 2: x from
    # pointers) near the best of a plain skinny GEMM (docs/experiments.md#tma-swap-ab)
    "o_proj": [
        T(32, 128, 4, 4, 2),
        T(16, 512, 4, 1, 4),
        T(32, 512, 4, 1, 4),
        *(
            T(*t, mode)
            for mode in (1, 2)
            for t in (
                (64, 128, 4, 3, 4),
                (64, 128, 4, 3, 8),
                (64, 256, 4, 3, 4),
                (32, 128, 4, 4, 4),
            )
        ),
    ],
    "down": [
        T(32, 128, 4, 4, 4),
        T(32, 128, 4, 3, 4),
        T(16, 1024, 4, 1, 8),
        *(
            T(*t, mode)
            for mode in (1, 2)
            for t in (
                (64, 128, 4, 3, 8),
                (64, 256, 4, 3, 4),
                (64, 128, 4, 5, 4),
                (32, 128, 4, 4, 4),
            )
        ),
    ],
    "gate_up": [
        T(64, 128, 8, 4, 1),
        T(64, 128, 8, 3, 1),
        T(16, 512, 4, 1, 4),
        *(
            T(*t, mode)
            for mode in (1, 2)
            for t in (
                (32, 128, 4, 3, 1),
                (64, 128, 4, 3, 1),
                (64, 128, 8, 4, 1),
                (32, 128, 4, 5, 1),
            )
        ),
    ],
    "qkv": [
        T(32, 256, 4, 3, 4),
        T(16, 128, 4, 3, 4),
        T(32, 128, 4, 3, 4),
        T(16, 512, 4, 1, 4),
        *(
            T(*t, mode)
            for mode in (1, 2)
            for t in (
                (32, 128, 4, 3, 4),
                (32, 256, 4, 3, 4),
                (32, 128, 4, 4, 8),
                (16, 128, 4, 3, 4),
            )
        ),
    ],
    "lm_head": [
        T(256, 64, 8, 3),
        T(128, 128, 8, 3),
        T(128, 64, 4, 4),
        T(128, 128, 4, 4),
        *(
            T(*t, mode)
            for mode in (1, 2)
            for t in (
                (128, 128, 4, 3, 1),
                (256, 64, 8, 3, 1),
                (128, 64, 4, 4, 1),
                (64, 128, 4, 3, 1),
            )
        ),
    ],
    # the _normed variants (x normed by its own kernel before: tile_table.SEPARATE_NORM)
    "qkv_normed": [
        T(32, 256, 4, 3, 4),
        T(32, 128, 4, 3, 4, 1),
        T(32, 128, 4, 3, 8, 1),
        T(32, 256, 4, 3, 4, 1),
        T(32, 128, 4, 3, 4, 2),
        T(16, 128, 4, 3, 4, 1),
    ],
    "gate_up_normed": [
        T(64, 128, 8, 4, 1),
        T(32, 128, 4, 5, 1, 1),
        T(32, 128, 4, 3, 1, 1),
        T(64, 128, 4, 3, 1, 1),
        T(64, 128, 8, 4, 1, 2),
        T(32, 128, 4, 3, 2, 1),
    ],
}
# One split or two, 16-32 weight rows a program, deeper TMA pipelines: no split-K reduce tail
# for the narrow projections (docs/experiments.md#tensor-core-tiles-with-split-k)
_FEW_SPLIT_TILES = {
    "o_proj": [
        (16, 128, 4, 6, 1, 1),
        (16, 256, 4, 4, 1, 1),
        (16, 128, 4, 8, 1, 1),
        (16, 128, 4, 6, 1, 2),
        (16, 256, 4, 4, 2, 1),
        (32, 256, 4, 4, 1, 1),
    ],
    "down": [
        (16, 256, 4, 4, 1, 1),
        (16, 128, 4, 8, 1, 1),
        (16, 256, 4, 6, 1, 1),
        (16, 256, 4, 4, 2, 1),
        (32, 256, 4, 4, 2, 1),
    ],
    "qkv_normed": [
        (16, 128, 4, 6, 1, 1),
        (16, 256, 4, 4, 1, 1),
        (16, 128, 4, 4, 2, 1),
        (32, 128, 4, 4, 1, 1),
    ],
    "gate_up_normed": [(32, 128, 4, 6, 1, 1), (32, 256, 4, 4, 1, 1)],
}
for _name, _tiles in _FEW_SPLIT_TILES.items():
    CANDIDATES[_name] += [T(*t) for t in _tiles]


def shapes() -> dict[str, tuple[str, int, int]]:
    """Case -> (proj_tiles kernel name, n, k) at the current model sizes."""
    return {
        "o_proj": ("gemv_residual", H, Q),
        "down": ("gemv_residual", H, INTER),
        "gate_up": ("gate_up_silu", 2 * INTER, H),
        "qkv": ("qkv_rope", Q + 2 * KV, H),
        "lm_head": ("lm_head", VOCAB, H),
        "qkv_normed": ("qkv_rope_normed", Q + 2 * KV, H),
        "gate_up_normed": ("gate_up_silu_normed", 2 * INTER, H),
    }


SHAPES = shapes()


def use_preset(name: str) -> None:
    """Sweep the projection shapes of ``name``, a model preset (e.g. llama-3.1-8b) or a local
    Hugging Face directory (its config.json; no weights are read), instead of llama-3.2-1b's."""
    global H, Q, KV, INTER, VOCAB, HD, SHAPES
    from stepgraph.cli_args import model_config

    c = model_config(name)
    H, INTER, VOCAB, HD = c.hidden_size, c.intermediate_size, c.vocab_size, c.head_dim
    Q, KV = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    SHAPES = shapes()


def case(name: str, m: int, g: torch.Generator, copies: int):
    """(ws, call(w, tile) -> output, reference(w) -> output) for kernel ``name`` at ``m`` rows."""
    _, n, k = SHAPES[name]
    dev = "cuda"
    ws = [(torch.randn(n, k, device=dev, generator=g) * k**-0.5).to(DT) for _ in range(copies)]
    x = torch.randn(m, k, device=dev, generator=g).to(DT)
    nw = (1 + 0.1 * torch.randn(k, device=dev, generator=g)).to(DT)
    res = torch.randn(m, n, device=dev, generator=g).to(DT)
    if name in ("o_proj", "down"):
        return (
            ws,
            (lambda w, t: gemv_residual(x, w, res, blocks=t)),
            (lambda w: F.linear(x, w) + res),
        )
    if name == "gate_up_normed":
        return (
            ws,
            (lambda w, t: gate_up_silu(x, None, w, 1e-5, blocks=t)),
            (lambda w: F.silu(F.linear(x, w).chunk(2, -1)[0]) * F.linear(x, w).chunk(2, -1)[1]),
        )
    if name == "gate_up":
        return (
            ws,
            (lambda w, t: gate_up_silu(x, nw, w, 1e-5, blocks=t)),
            (lambda w: gate_up_silu_reference(x, nw, w, 1e-5)),
        )
    if name == "lm_head":
        return (
            ws[:1],
            (lambda w, t: lm_head_argmax(x, nw, w, 1e-5, blocks=t)[0]),
            (lambda w: lm_head_argmax_reference(x, nw, w, 1e-5)[0]),
        )
    pos = torch.randint(0, 4096, (m,), device=dev, generator=g)
    cos = torch.randn(4096, HD, device=dev, generator=g).to(DT)
    sin = torch.randn(4096, HD, device=dev, generator=g).to(DT)
    kc = torch.zeros(m + 8, 64, KV // HD, HD, device=dev, dtype=DT)
    vc = torch.zeros_like(kc)
    slots = torch.arange(m, device=dev) * 64 + 3

    normed = name == "qkv_normed"

    def call(w, t):
        return qkv_rope(
            x,
            None if normed else nw,
            w,
            None,
            1e-5,
            pos,
            cos,
            sin,
            kc,
            vc,
            slots,
            Q // HD,
            blocks=t,
        )

    def ref(w):
        if normed:
            return rope_kv_reference(F.linear(x, w), pos, cos, sin, kc, vc, slots, Q // HD)[0]
        return qkv_rope_reference(x, nw, w, None, 1e-5, pos, cos, sin, kc, vc, slots, Q // HD)

    return ws, call, ref


def jobs(cases: str = "", rows=ROWS):
    names = [c for c in cases.split(",") if c] or list(CANDIDATES)
    return [(name, m) for name in names for m in rows]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--shard", default="0/1")
    ap.add_argument("--tiles-out", help="write the best tiles here ($STEPGRAPH_PROJ_TILES)")
    ap.add_argument("--cases", default="", help=f"comma list of {', '.join(CANDIDATES)}")
    ap.add_argument(
        "--rows",
        default=",".join(map(str, ROWS)),
        help="comma list of batch rows (one per BLOCK_M: 8, 32, 64)",
    )
    ap.add_argument(
        "--preset",
        default="llama-3.2-1b",
        help="the model whose shapes to sweep (a preset or a local HF directory)",
    )
    args = ap.parse_args(argv)
    use_preset(args.preset)
    i, n_shards = map(int, args.shard.split("/"))
    g = torch.Generator(device="cuda").manual_seed(0)
    gbps = None if args.compile_only else copy_bandwidth_gbps()
    rows, best = [], {}
    rows_list = [int(r) for r in args.rows.split(",") if r]
    for j, (name, m) in enumerate(jobs(args.cases, rows_list)):
        if j % n_shards != i:
            continue
        kern, n, k = SHAPES[name]
        ws, call, ref = case(name, m, g, 1 if args.compile_only else COPIES)
        want = ref(ws[0]).double()
        cands = [tile_for(kern, m, n, k), *CANDIDATES[name]]
        xk = torch.randn(m, k, device="cuda", generator=g).to(DT)
        cublas = None
        if not args.compile_only:
            cublas = graph_call_us([lambda w=w, xk=xk: F.linear(xk, w) for w in ws])
        for t in dict.fromkeys(cands):
            row = dict(
                kernel=name,
                m=m,
                block_m=block_m(m),
                n=n,
                k=k,
                tile=list(t.__dict__.values()),
                default=t == cands[0],
            )
            try:
                out = call(ws[0], t).double()
                row["rel_err"] = ((out - want).norm() / want.norm()).item()
                if args.compile_only:
                    continue
                if not row["rel_err"] < 2e-2:
                    rows.append(row)
                    continue
                us = graph_call_us([lambda w=w, t=t, c=call: c(w, t) for w in ws])
                row.update(
                    us=us,
                    gbps=n * k * 2 / us / 1e3,
                    floor_us=n * k * 2 / gbps / 1e3,
                    cublas_us=cublas,
                )
                key = (kern, n, k, block_m(m))
                if us < best.get(key, (float("inf"), None))[0]:
                    best[key] = (us, t)
            except Exception as e:  # out of shared memory, registers, ...
                row["error"] = f"{type(e).__name__}: {e}"[:160]
            rows.append(row)
        del ws
        torch.cuda.empty_cache()
    if args.compile_only:
        return {}
    result = dict(
        copy_gbps=gbps,
        rows=rows,
        best={str(k): [us, list(t.__dict__.values())] for k, (us, t) in best.items()},
    )
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.tiles_out:
        with open(args.tiles_out, "w") as f:
            json.dump(
                {",".join(map(str, k)): list(t.__dict__.values()) for k, (_, t) in best.items()}, f
            )
    print(f"copy bandwidth {gbps:.0f} GB/s")
    print(
        f"{'kernel':>8} {'m':>3} {'tile (bn,bk,w,s,split)':>24} {'us':>7} {'GB/s':>6} "
        f"{'floor':>6} {'cuBLAS':>7} err"
    )
    for r in rows:
        if "us" in r:
            print(
                f"{r['kernel']:>8} {r['m']:>3} {str(r['tile']):>24} {r['us']:7.2f} "
                f"{r['gbps']:6.0f} {r['floor_us']:6.2f} {r['cublas_us']:7.2f} "
                f"{r['rel_err']:.1e}{' default' if r['default'] else ''}"
            )
        else:
            print(
                f"{r['kernel']:>8} {r['m']:>3} {str(r['tile']):>24} "
                f"{r.get('error') or 'WRONG rel err ' + format(r['rel_err'], '.2e')}"
            )
    print("TILES = {")
    for (kern, n, k, bm), (us, t) in sorted(best.items()):
        print(f'    ("{kern}", {n}, {k}, {bm}): Tile{tuple(t.__dict__.values())},  # {us:.2f} us')
    print("}")
    return result


if __name__ == "__main__":
    main()
