"""cuBLAS FP8 (``torch._scaled_mm``, row-wise scales) against the FP8 step's own kernels at 8,
32 and 64 rows, at the projection shapes of a preset: is cuBLAS worth a place in ``step_plan``
where the 1B's tiles lose to bf16 (docs/experiments.md#fp8-weight-tiles)?

    PYTHONPATH=. python3 benchmarks/fp8_scaled_mm.py [--preset llama-3.1-8b] [--json F]

Per (case, rows), µs a call (16 weights over the 50 MB L2, one graph, ``graph_call_us``):
  ours       the tile the step launches (``proj_sweep.launched_tile``), its epilogue included
  bf16       cuBLAS bf16 ``F.linear`` on bf16 weights (the projection alone)
  mm         ``_scaled_mm`` of x already in e4m3 (a float32 scale per row) and the e4m3 weight
             (its per-channel scales), bf16 out: the projection alone
  mm+q       the same with x's per-row quantization in torch first (amax, divide, cast)
and each one's error against float64 over the dequantized weight (x unquantized), so that the
rounding of x to e4m3 shows (W8A8 keeps 4 significant bits: a few % of the norm).
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from benchmarks import proj_sweep as ps
from stepgraph.bench.timing import graph_call_us

E4M3_MAX = 448.0
CASES = ("o_proj", "down", "gate_up_normed", "qkv_normed")


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 scale [M, 1]): each row scaled to the e4m3 range."""
    amax = x.abs().amax(-1, keepdim=True).float().clamp_min(1e-12)
    scale = amax / E4M3_MAX
    return (x.float() / scale).to(torch.float8_e4m3fn), scale


def scaled_mm(xq, xs, w, ws):
    """``(xq * xs) @ (w * ws[:, None]).T`` in bf16 through cuBLAS, row-wise scales."""
    return torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=ws[None, :], out_dtype=torch.bfloat16)


def one(name: str, m: int, g: torch.Generator) -> dict:
    _, n, k = ps.SHAPES[name]
    ws, call, _ = ps.case(name, m, g, ps.COPIES, fp8=True)
    tile = ps.launched_tile(name, m, True)
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    xq, xs = quantize_rows(x)
    bws = [(w.float() * s[:, None]).to(torch.bfloat16) for w, s in ws[:4]]
    want = F.linear(x.double(), ws[0][0].double() * ws[0][1].double()[:, None])

    def err(out):
        return ((out.double() - want).norm() / want.norm()).item()

    row = dict(case=name, m=m, n=n, k=k, tile=list(tile.__dict__.values()))
    row["ours_us"] = graph_call_us([lambda w=w: call(w, tile) for w in ws])
    row["bf16_us"] = graph_call_us([lambda w=w: F.linear(x, w) for w in bws * 4])
    try:
        row["mm_err"] = err(scaled_mm(xq, xs, *ws[0]))
        row["mm_us"] = graph_call_us([lambda w=w: scaled_mm(xq, xs, *w) for w in ws])
        row["mmq_us"] = graph_call_us([lambda w=w: scaled_mm(*quantize_rows(x), *w) for w in ws])
    except RuntimeError as e:  # a shape or layout cuBLAS refuses
        row["error"] = f"{type(e).__name__}: {e}"[:160]
    del ws, bws
    torch.cuda.empty_cache()
    return row


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama-3.2-1b")
    ap.add_argument("--rows", default="8,32,64")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    ps.use_preset(args.preset)
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = [one(c, int(m), g) for m in args.rows.split(",") for c in CASES]
    print(f"{args.preset}: µs a call (mm err: relative to float64, x unquantized)")
    print(f"{'case':>15} {'m':>3} {'ours':>7} {'bf16':>7} {'mm':>7} {'mm+q':>7} {'mm err':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r['case']:>15} {r['m']:>3} {r['ours_us']:7.2f} {r['bf16_us']:7.2f} "
                  f"{r['error']}")  # fmt: skip
            continue
        print(
            f"{r['case']:>15} {r['m']:>3} {r['ours_us']:7.2f} {r['bf16_us']:7.2f} "
            f"{r['mm_us']:7.2f} {r['mmq_us']:7.2f} {r['mm_err']:8.1e}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
