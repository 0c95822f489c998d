"""The second half of a layer alone: o_proj, gate-up and down (and the next layer's qkv) as the
step launches them today against one persistent ``mlp_block`` launch, at Llama-3.2-1B's shapes.

    PYTHONPATH=. python3 benchmarks/mlp_block.py --rows 8,16,32,64 --json $OUT/mlp_block.json

Each way runs over 16 layers' weights (more than the H200's 50 MB of L2) in one CUDA graph, as
inside a decode step: µs per layer (CUDA events after warm-up, medians), the time its weight
bytes take at copy bandwidth, and whether the block's outputs (r2, the handoff, with qkv also q
and both caches) equal the separate launches' bit for bit. Variants are the block's switches
(``kernels/mlp_block_plan``); PDL as the step would choose it at that bucket (``--pdl``). At
one row the block runs its own tiles (``one_row_tiles``): its bits are compared with the
separate launches at those tiles, its time with theirs at their own.
``--tile o=32,128,4,4,2,2`` sets a tile of the block (``--same-tiles``: the separate launches
take the block's tiles too, the fair comparison of the launch structure alone).
``--device cpu --small`` runs the same code at small fp16 shapes under the interpreter,
checking the bits without timing (the CPU test of this script).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os

import torch

from stepgraph.kernels import mlp_block as mb
from stepgraph.kernels import mlp_block_plan as plan
from stepgraph.kernels.gate_up_silu import gate_up_silu
from stepgraph.kernels.norm_gemv import gemv_residual
from stepgraph.kernels.proj_tiles import Tile, prefer_cublas
from stepgraph.kernels.qkv_rope import qkv_rope

VARIANTS = {
    "block": {},
    "stride": {plan.SCHEDULE_ENV: "stride"},
    "no-prefetch": {plan.PREFETCH_ENV: "0"},
    "2-per-sm": {plan.PER_SM_ENV: "2", plan.MAXNREG_ENV: "224"},
}
EPS = 1e-5
LAYERS = 16


def shapes(small: bool) -> dict:
    """Hidden, intermediate, heads, kv heads, head_dim: Llama-3.2-1B's, or small ones."""
    if small:
        return dict(h=256, inter=512, heads=4, kv=2, hd=64)
    return dict(h=2048, inter=8192, heads=32, kv=8, hd=64)


def layer(s: dict, m: int, dtype, device, g) -> dict:
    """One layer's weights and inputs (random, scaled as a trained model's)."""

    def rnd(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g, device=device)).to(dtype)

    h, inter, rows = s["h"], s["inter"], (s["heads"] + 2 * s["kv"]) * s["hd"]
    ang = torch.rand(640, s["hd"] // 2, generator=g, device=device) * 6.0
    cos, sin = (torch.cat([f(ang)] * 2, dim=-1).to(dtype) for f in (torch.cos, torch.sin))
    return dict(
        o=rnd(m, h), r=rnd(m, h), wo=rnd(h, h, scale=h**-0.5), n2=1 + rnd(h, scale=0.1),
        w_gu=rnd(2 * inter, h, scale=h**-0.5), wd=rnd(h, inter, scale=inter**-0.5),
        nn=1 + rnd(h, scale=0.1), wq=rnd(rows, h, scale=h**-0.5), cos=cos, sin=sin,
        kc=rnd(12, 64, s["kv"], s["hd"]), vc=rnd(12, 64, s["kv"], s["hd"]),
        pos=torch.randint(0, 640, (m,), generator=g, device=device),
        slots=torch.randperm(768, generator=g, device=device)[:m],
    )  # fmt: skip


def separate(w: dict, s: dict, qkv: bool, pdl, t=None):
    """The launches the step makes without the block, with the norm handoff between them (at
    one row the step's gate-up norms in its prologue instead): (r2, xw2, ssq2[, q]). ``t``: the
    block's tiles (the bits check), else each kernel's own."""
    t = t or mb.BlockTiles(None, None, None)
    r1, xw1, ssq1 = gemv_residual(w["o"], w["wo"], w["r"], next_norm=w["n2"], use_pdl=pdl,
                                  blocks=t.o)  # fmt: skip
    a = gate_up_silu(xw1, None, w["w_gu"], EPS, ssq=ssq1, use_pdl=pdl, blocks=t.gate_up)
    out = gemv_residual(a, w["wd"], r1, next_norm=w["nn"], use_pdl=pdl, blocks=t.down)
    if not qkv:
        return out
    q = qkv_rope(out[1], None, w["wq"], None, EPS, w["pos"], w["cos"], w["sin"], w["kc"],
                 w["vc"], w["slots"], s["heads"], use_pdl=pdl, ssq=out[2],
                 blocks=t.qkv)  # fmt: skip
    return (*out, q)


def block(w: dict, s: dict, qkv: bool, pdl, t=None):
    nq = plan.NextQkv(w["wq"], None, EPS, w["pos"], w["cos"], w["sin"], w["kc"], w["vc"],
                      w["slots"], s["heads"]) if qkv else None  # fmt: skip
    return mb.mlp_block(w["o"], w["r"], w["wo"], w["n2"], w["w_gu"], EPS, w["wd"], w["nn"],
                        qkv=nq, use_pdl=pdl, tiles=t)  # fmt: skip


def block_tiles(w: dict, s: dict, qkv: bool, overrides: dict, always: bool = False):
    """The block's tiles at these rows with ``--tile`` overrides, or None (its own choice)
    where there are none and not ``always``."""
    if not overrides and not always:
        return None
    rows = (s["heads"] + 2 * s["kv"]) * s["hd"]
    t = mb.block_tiles(w["o"].shape[0], s["h"], s["h"], s["inter"], w["o"].element_size(),
                       (rows, s["hd"] // 2) if qkv else None)  # fmt: skip
    return dataclasses.replace(t, **overrides)


def same_bits(w: dict, s: dict, qkv: bool, pdl, t=None) -> bool:
    """The block's outputs (and caches) against the separate launches' on one layer, both at
    the block's tiles (``t``, else its own choice)."""
    caches = [w["kc"].clone(), w["vc"].clone()]
    rows = (s["heads"] + 2 * s["kv"]) * s["hd"]
    t = t or mb.block_tiles(w["o"].shape[0], s["h"], s["h"], s["inter"], w["o"].element_size(),
                            (rows, s["hd"] // 2) if qkv else None)  # fmt: skip
    want = separate(w, s, qkv, pdl, t)
    kv_want = [w["kc"].clone(), w["vc"].clone()]
    w["kc"].copy_(caches[0])
    w["vc"].copy_(caches[1])
    got = block(w, s, qkv, pdl, t)
    same = all(torch.equal(a, b) for a, b in zip(got, want))
    return same and torch.equal(w["kc"], kv_want[0]) and torch.equal(w["vc"], kv_want[1])


def with_env(env: dict, fn, *args):
    """``fn(*args)`` with the switches ``env`` set, the environment restored after."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return fn(*args)
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,8,16,32,64")
    ap.add_argument("--pdl", choices=("step", "on", "off"), default="step")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="small fp16 shapes (the CPU check)")
    ap.add_argument(
        "--tile",
        action="append",
        default=[],
        metavar="KIND=N,K,W,S,SPLIT,TMA",
        help="the block's tile for o, gate_up, down or qkv (repeatable)",
    )
    ap.add_argument(
        "--same-tiles",
        action="store_true",
        help="time the separate launches at the block's tiles too",
    )
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    overrides = {}
    for item in args.tile:
        kind, _, fields = item.partition("=")
        overrides[kind] = Tile(*(int(f) for f in fields.split(",")))
    s = shapes(args.small)
    cuda = args.device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float16
    g = torch.Generator(args.device).manual_seed(0)
    gbps = None
    if cuda:
        from stepgraph.bench.timing import copy_bandwidth_gbps

        gbps = copy_bandwidth_gbps()
    rows_out = []
    for m in [int(x) for x in args.rows.split(",")]:
        layers = [layer(s, m, dtype, args.device, g) for _ in range(LAYERS if cuda else 1)]
        qkv_rows = (s["heads"] + 2 * s["kv"]) * s["hd"]
        qkv_ok = not prefer_cublas("qkv_rope", m, qkv_rows, s["h"], 2)
        pdl = {"on": True, "off": False}.get(args.pdl)
        if args.pdl == "step":
            from stepgraph.model.fused_decode import kernel_class, no_pdl

            pdl = False if no_pdl(qkv_rows, s["h"], kernel_class(m), 2) else None
        for qkv in (False, True) if qkv_ok else (False,):
            nbytes = 2 * (s["h"] ** 2 + 3 * s["h"] * s["inter"] + qkv * qkv_rows * s["h"])
            floor = nbytes / gbps / 1e3 if gbps else None
            ways = [("separate", {}, separate)] + [(n, e, block) for n, e in VARIANTS.items()]
            t = block_tiles(layers[0], s, qkv, overrides, always=args.same_tiles)
            for name, env, fn in ways:
                if not cuda and name == "stride":  # the interpreter runs programs in turn
                    continue
                row = dict(rows=m, qkv=qkv, way=name, floor_us=floor)
                row["same_bits"] = None if fn is separate else with_env(
                    env, same_bits, layers[0], s, qkv, pdl, t)  # fmt: skip
                if cuda:
                    from stepgraph.bench.timing import graph_call_us

                    tiles = t if fn is block or args.same_tiles else None
                    calls = [functools.partial(fn, w, s, qkv, pdl, tiles) for w in layers]
                    row["us"] = with_env(env, graph_call_us, calls)
                    row["of_floor"] = floor / row["us"]
                rows_out.append(row)
                us = f"{row['us']:8.2f} µs {row['of_floor']:5.0%}" if cuda else "  (not timed)"
                bits = {None: "", True: "  same bits", False: "  BITS DIFFER"}[row["same_bits"]]
                print(f"rows {m:>2} {'+qkv' if qkv else '    '} {name:<12}{us}{bits}",
                      flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(copy_gbps=gbps, rows=rows_out), f, indent=1)
    return rows_out


if __name__ == "__main__":
    main()
