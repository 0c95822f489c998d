"""FP8 weights past 64 rows (a large decode bucket, a prefill): which way through a projection of
64 to 4096 rows is fastest, against bf16 weights, at the projection shapes of a preset.

    PYTHONPATH=. python3 benchmarks/fp8_rows.py [--preset llama-3.1-8b] [--chunks 0,8,16] [--json F]

Per (rows, projection), µs a call (4 weights in turn, one CUDA graph, ``graph_call_us``):
  gemv       ``fp8_gemv``, 64 rows a launch, the weight read each time (``Fp8Linear`` up to 64
             rows)
  dq+mm      ``dequant_linear(..., chunk_bytes=0)``: the whole weight dequantized in one pass,
             then cuBLAS bf16
  dq C MiB   ``dequant_linear``: the same C MiB of dequantized weight at a time, each chunk's GEMM
             into its columns of one output (``Fp8Linear`` past 64 rows; one per ``--chunks``)
  torch dq   the same dequantization in torch ops through float32 (three passes), then cuBLAS
  w8a8       cuBLAS FP8 (``torch._scaled_mm``, row-wise scales) with x quantized per row in
             torch first: FP8 tensor cores, x rounded to 4 significant bits
  bf16       cuBLAS bf16 on bf16 weights: the model-dtype baseline
and a layer's sum of the four projections, each way over bf16's. The W8A8 error (relative to
float64 over the dequantized weight, x unquantized) is printed beside it.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from benchmarks import proj_sweep as ps
from stepgraph.bench.timing import graph_call_us
from stepgraph.kernels.proj.fp8_dequant import dequant_linear
from stepgraph.kernels.proj.fp8_gemv import MAX_M, dequantize_reference, fp8_gemv
from stepgraph.model.fp8_weight import quantize_per_channel

E4M3_MAX = 448.0
CASES = ("qkv", "o_proj", "gate_up", "down")
WAYS = ("gemv", "dq+mm", "torch dq", "w8a8", "bf16")
COPIES = 4


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 scale [M, 1]): each row scaled to the e4m3 range."""
    amax = x.abs().amax(-1, keepdim=True).float().clamp_min(1e-12)
    scale = amax / E4M3_MAX
    return (x.float() / scale).to(torch.float8_e4m3fn), scale


def scaled_mm(xq, xs, w, ws):
    """``(xq * xs) @ (w * ws[:, None]).T`` in bf16 through cuBLAS, row-wise scales."""
    return torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=ws[None, :], out_dtype=torch.bfloat16)


def gemv_rows(x, w, s) -> torch.Tensor:
    """``fp8_gemv`` over any rows, 64 (``MAX_M``) a launch into one output."""
    y = x.new_empty(x.shape[0], w.shape[0])
    for r0 in range(0, x.shape[0], MAX_M):
        fp8_gemv(x[r0 : r0 + MAX_M], w, s, out=y[r0 : r0 + MAX_M])
    return y


def chunk_way(mib: int) -> str:
    return f"dq {mib} MiB"


def ways(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, bw: torch.Tensor, chunks=()) -> dict:
    """Each way's call for one weight (e4m3 ``w`` with scales ``s``; ``bw`` the bf16 one)."""
    chunked = {
        chunk_way(c): (lambda c=c: dequant_linear(x, w, s, chunk_bytes=c << 20)) for c in chunks
    }
    return chunked | {
        "gemv": lambda: gemv_rows(x, w, s),
        "dq+mm": lambda: dequant_linear(x, w, s, chunk_bytes=0),
        "torch dq": lambda: F.linear(
            x, dequantize_reference(w, s, None, torch.float32).to(x.dtype)
        ),
        "w8a8": lambda: scaled_mm(*quantize_rows(x), w, s),
        "bf16": lambda: F.linear(x, bw),
    }


def one(name: str, m: int, g: torch.Generator, chunks=()) -> dict:
    _, n, k = ps.SHAPES[name]
    weights = []
    for _ in range(COPIES):
        bw = (torch.randn(n, k, device="cuda", generator=g) * k**-0.5).to(torch.bfloat16)
        q = quantize_per_channel(bw)
        weights.append((q.data, q.scale, bw))
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    row = dict(case=name, m=m, n=n, k=k)
    for way in (*map(chunk_way, chunks), *WAYS):
        try:
            row[way] = graph_call_us([ways(x, *wt, chunks)[way] for wt in weights])
        except RuntimeError as e:  # a shape or layout cuBLAS refuses
            row[way] = None
            row["error"] = f"{way}: {type(e).__name__}: {e}"[:160]
    w, s, _ = weights[0]
    want = F.linear(x.double(), dequantize_reference(w, s))
    got = scaled_mm(*quantize_rows(x), w, s).double()
    row["w8a8_err"] = ((got - want).norm() / want.norm()).item()
    del weights
    torch.cuda.empty_cache()
    return row


def layer_sums(rows: list[dict], all_ways=WAYS) -> dict[int, dict[str, float | None]]:
    """Rows -> per row count, each way's µs summed over the projections (None where one failed)."""
    out: dict[int, dict[str, float | None]] = {}
    for r in rows:
        acc = out.setdefault(r["m"], dict.fromkeys(all_ways, 0.0))
        for way in all_ways:
            acc[way] = None if acc[way] is None or r[way] is None else acc[way] + r[way]
    return out


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama-3.2-1b")
    ap.add_argument("--rows", default="64,128,256,512,1024,2048,4096")
    ap.add_argument("--chunks", default="8,16,32", help="dequant_linear's MiB, comma list")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    ps.use_preset(args.preset)
    g = torch.Generator(device="cuda").manual_seed(0)
    chunks = [int(c) for c in args.chunks.split(",") if c]
    all_ways = (*map(chunk_way, chunks), *WAYS)
    rows = [one(c, int(m), g, chunks) for m in args.rows.split(",") for c in CASES]
    fmt = lambda v: f"{v:9.1f}" if v is not None else f"{'-':>9}"  # noqa: E731
    print(f"{args.preset}: µs a call")
    print(f"{'case':>8} {'m':>5} " + " ".join(f"{w:>9}" for w in all_ways) + "  w8a8 err")
    for r in rows:
        print(f"{r['case']:>8} {r['m']:>5} " + " ".join(fmt(r[w]) for w in all_ways), end="")
        print(f"  {r['w8a8_err']:8.1e}" + (f"  {r['error']}" if "error" in r else ""))
    print("a layer (the four projections), µs, and over bf16's:")
    for m, acc in layer_sums(rows, all_ways).items():
        base = acc["bf16"]
        cells = [
            f"{w} {v:.1f} ({v / base:.2f}x)" if v is not None and base else f"{w} -"
            for w, v in acc.items()
        ]
        print(f"  {m:>5} rows: " + ", ".join(cells))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
