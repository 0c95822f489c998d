"""Tile sweep of the fused projections at several rows (``tl.dot``, M padded to 16/32/64,
split-K), Llama-3.2-1B shapes (``--preset`` another model's), bf16, PDL on, against cuBLAS
``F.linear`` of the same shape.

    PYTHONPATH=. python3 benchmarks/proj_sweep.py --json $OUT/proj_sweep.json
    (--compile-only --shard i/n first, in parallel processes, fills Triton's cache: shard i
    takes every n-th tile)
    PYTHONPATH=. python3 benchmarks/proj_sweep.py --quantization fp8 --json $OUT/fp8.json
    (e4m3 weights, per-channel scales, rows 1, 8, 32, 64: FP8_CANDIDATES and the FP8 step's
    kernels; bf16's own tile on bf16 weights and cuBLAS bf16 timed beside each; the check is
    against float64 over the dequantized weights; prints the FP8_TILES literal)

Per (kernel, bs): every candidate ``Tile`` is checked against torch on one weight (a wrong one
is reported, never timed), then 16 calls over 16 weights (more than the 50 MB L2) are captured
in one graph and replayed: µs per call, GB/s of weight bytes. The best tile per
``(kernel, n, k, BLOCK_M)`` is printed as the ``tile_table.TILES`` literal.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import torch
import torch.nn.functional as F

from benchmarks.proj_candidates import CANDIDATES, FP8_CANDIDATES, FP8_ONE_ROW
from stepgraph.bench.timing import copy_bandwidth_gbps, graph_call_us
from stepgraph.kernels.elementwise.rope_kv import rope_kv_reference
from stepgraph.kernels.proj.gate_up_silu import gate_up_silu, gate_up_silu_reference
from stepgraph.kernels.proj.norm_gemv import gemv_residual
from stepgraph.kernels.proj.proj_tiles import Tile, block_m, tile_for
from stepgraph.kernels.proj.qkv_rope import qkv_rope, qkv_rope_reference, qkv_tile
from stepgraph.kernels.sampling.lm_head_argmax import lm_head_argmax, lm_head_argmax_reference
from stepgraph.model.fp8_weight import quantize_per_channel

H, Q, KV, INTER, VOCAB, HD = 2048, 2048, 512, 8192, 128256, 64  # llama-3.2-1b; --preset
DT = torch.bfloat16
ROWS = (8, 32, 64)  # one per BLOCK_M bucket: 16, 32, 64
COPIES = 16
T = Tile
FP8_ROWS = (1, 8, 32, 64)
# The kernels the FP8 step runs (step_plan): at one row the norm in each prologue (the handoff
# starts at 2 rows); from 2 rows qkv and gate-up on the norm handoff (the _normed tiles)
FP8_STEP_CASES = {
    True: ("o_proj", "down", "gate_up", "qkv"),
    False: ("o_proj", "down", "gate_up_normed", "qkv_normed"),
}
DEVICE = "cuda"


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


def case(name: str, m: int, g: torch.Generator, copies: int, fp8: bool = False):
    """(ws, call(w, tile) -> output, reference(w) -> output) for kernel ``name`` at ``m`` rows.
    Each w is ``(weight, w_scale)``: bf16 and None, or with ``fp8`` e4m3 data and its float32
    scales per channel (``quantize_per_channel``); the reference then runs in float64 over the
    dequantized weight (scale x data) and the inputs in float64."""
    _, n, k = SHAPES[name]
    dev = DEVICE
    ws = []
    for _ in range(copies):
        w = torch.randn(n, k, device=dev, generator=g) * k**-0.5
        if fp8:
            q = quantize_per_channel(w)
            ws.append((q.data, q.scale))
        else:
            ws.append((w.to(DT), None))
        del w
    x = torch.randn(m, k, device=dev, generator=g).to(DT)
    nw = (1 + 0.1 * torch.randn(k, device=dev, generator=g)).to(DT)
    res = torch.randn(m, n, device=dev, generator=g).to(DT)
    rt = torch.float64 if fp8 else DT  # the reference's dtype

    def full(w):  # the reference's weight: as stored, or dequantized in float64
        return w[0] if w[1] is None else w[0].double() * w[1].double()[:, None]

    xr, nwr, resr = x.to(rt), nw.to(rt), res.to(rt)
    if name in ("o_proj", "down"):
        return (
            ws,
            (lambda w, t: gemv_residual(x, w[0], res, blocks=t, w_scale=w[1])),
            (lambda w: F.linear(xr, full(w)) + resr),
        )
    if name == "gate_up_normed":

        def silu_mul(w):
            gate, up = F.linear(xr, full(w)).chunk(2, -1)
            return F.silu(gate) * up

        return (
            ws,
            (lambda w, t: gate_up_silu(x, None, w[0], 1e-5, blocks=t, w_scale=w[1])),
            silu_mul,
        )
    if name == "gate_up":
        return (
            ws,
            (lambda w, t: gate_up_silu(x, nw, w[0], 1e-5, blocks=t, w_scale=w[1])),
            (lambda w: gate_up_silu_reference(xr, nwr, full(w), 1e-5)),
        )
    if name == "lm_head":
        return (
            ws[:1],
            (lambda w, t: lm_head_argmax(x, nw, w[0], 1e-5, blocks=t)[0]),
            (lambda w: lm_head_argmax_reference(x, nw, w[0], 1e-5)[0]),
        )
    pos = torch.randint(0, 4096, (m,), device=dev, generator=g)
    cos = torch.randn(4096, HD, device=dev, generator=g).to(DT)
    sin = torch.randn(4096, HD, device=dev, generator=g).to(DT)
    kc = torch.zeros(m + 8, 64, KV // HD, HD, device=dev, dtype=DT)
    vc = torch.zeros_like(kc)
    kcr, vcr = kc.to(rt), vc.to(rt)
    cosr, sinr = cos.to(rt), sin.to(rt)
    slots = torch.arange(m, device=dev) * 64 + 3

    normed = name == "qkv_normed"

    def call(w, t):
        return qkv_rope(
            x,
            None if normed else nw,
            w[0],
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
            w_scale=w[1],
        )

    def ref(w):
        if normed:
            qkv = F.linear(xr, full(w))
            return rope_kv_reference(qkv, pos, cosr, sinr, kcr, vcr, slots, Q // HD)[0]
        return qkv_rope_reference(
            xr, nwr, full(w), None, 1e-5, pos, cosr, sinr, kcr, vcr, slots, Q // HD
        )

    return ws, call, ref


def launched_tile(name: str, m: int, fp8: bool = False) -> Tile:
    """The tile the launcher takes at ``m`` rows with no ``blocks`` (the tables' or the rule's;
    ``fp8``: ``FP8_TILES`` or ``fp8_default_tile``), as the step does."""
    kern, n, k = SHAPES[name]
    if kern.startswith("qkv_rope"):
        return qkv_tile(kern == "qkv_rope", m, n, k, HD // 2, 2, None, fp8)
    return tile_for(kern, m, n, k, 2, None, fp8)


def candidates(name: str, m: int, fp8: bool) -> list[Tile]:
    """The tiles swept for ``name`` at ``m`` rows: bf16's ``CANDIDATES``; with ``fp8`` the
    launcher's own (``FP8_TILES`` or the rule's), bf16's tile through the pointer loop (what
    FP8 weights ran before tiles of their own), then ``FP8_ONE_ROW`` at one row, else the
    case's ``FP8_CANDIDATES`` (qkv: tiles wider than head_dim / 2 left out)."""
    if not fp8:
        return [launched_tile(name, m), *CANDIDATES[name]]
    bf16 = launched_tile(name, m)
    tiles = [launched_tile(name, m, True), dataclasses.replace(bf16, tma=0)]
    tiles += [T(*t) for t in (FP8_ONE_ROW if m <= 1 else FP8_CANDIDATES[name])]
    if name.startswith("qkv"):
        tiles = [t for t in tiles if t.block_n <= HD // 2]
    return list(dict.fromkeys(tiles))


def jobs(cases: str = "", rows=ROWS, fp8: bool = False):
    """(case, rows) pairs: ``cases`` (a comma list) at every row count, or by default every
    case; with ``fp8`` the ones the FP8 step runs (``FP8_STEP_CASES``)."""
    names = [c for c in cases.split(",") if c]
    if names or not fp8:
        return [(name, m) for name in names or list(CANDIDATES) for m in rows]
    return [(name, m) for m in rows for name in FP8_STEP_CASES[m <= 1]]


def work_items(cases: str, rows, fp8: bool) -> list[tuple[str, int, list[tuple[str, Tile]]]]:
    """Per (case, rows): its tiles to check and time, each ``("fp8" or "bf16", tile)``; with
    ``fp8`` also bf16's own tile on bf16 weights (the reference beside each row)."""
    out = []
    for name, m in jobs(cases, rows, fp8):
        items = [("fp8" if fp8 else "bf16", t) for t in candidates(name, m, fp8)]
        if fp8:
            items.append(("bf16", launched_tile(name, m)))
        out.append((name, m, items))
    return out


def weight_bytes(n: int, k: int, fp8: bool) -> int:
    """Bytes one call reads of its weight: bf16, or e4m3 plus float32 scales."""
    return n * k + 4 * n if fp8 else n * k * 2


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument(
        "--shard",
        default="0/1",
        help="i/n: this process takes every n-th tile from the i-th (with --compile-only)",
    )
    ap.add_argument(
        "--tiles-out",
        help="write the best tiles here ($STEPGRAPH_PROJ_TILES; with --quantization fp8 the "
        "FP8 ones, keys fp8:kernel,n,k,block_m)",
    )
    ap.add_argument("--cases", default="", help=f"comma list of {', '.join(CANDIDATES)}")
    ap.add_argument(
        "--rows",
        default=None,
        help="comma list of batch rows (default 8,32,64: one per BLOCK_M; "
        "with --quantization fp8 1,8,32,64)",
    )
    ap.add_argument(
        "--preset",
        default="llama-3.2-1b",
        help="the model whose shapes to sweep (a preset or a local HF directory)",
    )
    ap.add_argument(
        "--quantization",
        choices=("fp8",),
        default=None,
        help="fp8: e4m3 weights with per-channel scales (FP8_TILES); bf16's tile and cuBLAS "
        "bf16 timed beside each",
    )
    args = ap.parse_args(argv)
    fp8 = args.quantization == "fp8"
    rows_list = [
        int(r) for r in (args.rows or ",".join(map(str, FP8_ROWS if fp8 else ROWS))).split(",") if r
    ]
    if fp8 and "lm_head" in args.cases.split(","):
        ap.error("--quantization fp8 has no lm_head case: the LM head stays in the model dtype")
    use_preset(args.preset)
    i, n_shards = map(int, args.shard.split("/"))
    g = torch.Generator(device=DEVICE).manual_seed(0)
    gbps = None if args.compile_only else copy_bandwidth_gbps()
    rows, best, result = [], {}, {}
    idx = -1
    for name, m, items in work_items(args.cases, rows_list, fp8):
        mine = []
        for item in items:
            idx += 1
            if not args.compile_only or idx % n_shards == i:
                mine.append(item)
        if not mine:
            continue
        kern, n, k = SHAPES[name]
        copies = 1 if args.compile_only else COPIES
        runs = {}  # "fp8" / "bf16" -> (ws, call, ref)
        for kind in dict.fromkeys(kind for kind, _ in mine):
            runs[kind] = case(name, m, g, copies, fp8=kind == "fp8")
        want = {}
        if not args.compile_only:
            want = {kind: r[2](r[0][0]).double() for kind, r in runs.items()}
        cublas = bf16_us = None
        if not args.compile_only:
            xk = torch.randn(m, k, device=DEVICE, generator=g).to(DT)
            bws = runs["bf16"][0] if "bf16" in runs else case(name, m, g, COPIES)[0]
            cublas = graph_call_us([lambda w=w, xk=xk: F.linear(xk, w[0]) for w in bws])
            del bws
        for kind, t in mine:
            ws, call, _ = runs[kind]
            is_fp8 = kind == "fp8"
            row = dict(
                kernel=name,
                m=m,
                block_m=block_m(m),
                n=n,
                k=k,
                weights=kind,
                tile=list(t.__dict__.values()),
                default=t == launched_tile(name, m, is_fp8),
            )
            try:
                out = call(ws[0], t).double()
                if args.compile_only:
                    continue
                want_k = want[kind]
                row["rel_err"] = ((out - want_k).norm() / want_k.norm()).item()
                # W8A8 (a8): x in e4m3 keeps 4 significant bits, ~3% of the output's norm
                if not row["rel_err"] < (8e-2 if is_fp8 and t.a8 else 2e-2):
                    rows.append(row)
                    continue
                us = graph_call_us([lambda w=w, t=t, c=call: c(w, t) for w in ws])
                nbytes = weight_bytes(n, k, is_fp8)
                row.update(
                    us=us,
                    gbps=nbytes / us / 1e3,
                    floor_us=nbytes / gbps / 1e3,
                    cublas_us=cublas,
                )
                if fp8 and not is_fp8:  # bf16's own tile: the reference, not a candidate
                    bf16_us = us
                    row["reference"] = True
                else:
                    key = (kern, n, k, block_m(m))
                    if us < best.get(key, (float("inf"), None))[0]:
                        best[key] = (us, t)
            except Exception as e:  # out of shared memory, registers, ...
                row["error"] = f"{type(e).__name__}: {e}"[:160]
            rows.append(row)
        if fp8:
            for r in rows:
                if r["kernel"] == name and r["m"] == m:
                    r["bf16_us"] = bf16_us
        del runs
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
        if not args.compile_only:
            result = save(args, gbps, rows, best)  # after every case: a cut-off run keeps them
            top = best.get((kern, n, k, block_m(m)))
            print(
                f"{name} m={m}: best {top[1] if top else None} {top[0] if top else 0:.2f} us, "
                f"bf16 {bf16_us or 0:.2f} us, cuBLAS bf16 {cublas:.2f} us",
                flush=True,
            )
    if args.compile_only:
        return {}
    if args.tiles_out:  # FP8 keys "fp8:kernel,n,k,block_m" (ProjTables.with_tiles_file)
        with open(args.tiles_out, "w") as f:
            pre = "fp8:" if fp8 else ""
            json.dump(
                {
                    pre + ",".join(map(str, k)): list(t.__dict__.values())
                    for k, (_, t) in best.items()
                },
                f,
            )
    report(rows, best, gbps, fp8)
    return result


def save(args: argparse.Namespace, gbps: float, rows: list[dict], best: dict) -> dict:
    """The sweep so far as a dict, written to ``args.json`` when given."""
    result = dict(
        copy_gbps=gbps,
        quantization=args.quantization,
        preset=args.preset,
        rows=rows,
        best={str(k): [us, list(t.__dict__.values())] for k, (us, t) in best.items()},
    )
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


def report(rows: list[dict], best: dict, gbps: float, fp8: bool) -> None:
    """The sweep's table, then the best tiles as the ``TILES`` (``FP8_TILES``) literal."""
    print(f"copy bandwidth {gbps:.0f} GB/s")
    extra = f" {'bf16':>7}" if fp8 else ""
    print(
        f"{'kernel':>8} {'m':>3} {'tile (bn,bk,w,s,split,tma)':>28} {'us':>7} {'GB/s':>6} "
        f"{'floor':>6}{extra} {'cuBLAS':>7} err"
    )
    for r in rows:
        tag = " bf16-ref" if r.get("reference") else " default" if r["default"] else ""
        if "us" in r:
            bf = f" {r['bf16_us']:7.2f}" if fp8 and r.get("bf16_us") else (" " * 8 if fp8 else "")
            print(
                f"{r['kernel']:>8} {r['m']:>3} {str(r['tile']):>28} {r['us']:7.2f} "
                f"{r['gbps']:6.0f} {r['floor_us']:6.2f}{bf} {r['cublas_us']:7.2f} "
                f"{r['rel_err']:.1e}{tag}"
            )
        else:
            print(
                f"{r['kernel']:>8} {r['m']:>3} {str(r['tile']):>28} "
                f"{r.get('error') or 'WRONG rel err ' + format(r['rel_err'], '.2e')}{tag}"
            )
    print("FP8_TILES = {" if fp8 else "TILES = {")
    for (kern, n, k, bm), (us, t) in sorted(best.items()):
        print(f'    ("{kern}", {n}, {k}, {bm}): Tile{tuple(t.__dict__.values())},  # {us:.2f} us')
    print("}")


if __name__ == "__main__":
    main()
