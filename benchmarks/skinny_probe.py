"""Issue 21 probe: how fast can a plain Triton skinny GEMM stream its weight at decode batch sizes?

    PYTHONPATH=. python3 benchmarks/skinny_probe.py --json $OUT/skinny_probe.json
    (--compile-only --shard i/n first, in parallel processes, fills Triton's cache)

``y[M, N] = x[M, K] @ w[N, K]^T`` with no prologue or epilogue, at Llama-3.2-1B's projection
shapes, three ways against cuBLAS ``F.linear``:

- ``normal``: ``acc[BM, BN] = dot(x, w^T)`` (the fused kernels' orientation today);
- ``swap``: ``acc[BN, BM] = dot(w, x^T)`` (swap-AB: the weight rows are the MMA's M, so that 64
  or 128 of them fill a Hopper warpgroup MMA and the batch is its small N);
- ``tma``: swap-AB with both operands through host tensor descriptors (TMA loads).

Split-K programs store float32 partials and skip the reduction (the fused kernels' ticket
reduce adds about a microsecond): the probe measures the weight stream alone. 16 calls over 16
weights (more than the 50 MB L2) in one graph; µs per call and the fraction of the copy-bandwidth
floor. Decides whether swap-AB is worth porting into ``gemv_tiles`` (see docs/results.md).
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from stepgraph.bench.timing import copy_bandwidth_gbps, graph_call_us

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None

SHAPES = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048),
          "down": (2048, 8192), "head": (128256, 2048)}  # fmt: skip
ROWS = (8, 32, 64)
COPIES = 16
DT = torch.bfloat16


@triton.jit
def _probe_kernel(
    x_ptr, w_ptr, xd, wd, y_ptr, M, N, K,
    SWAP: tl.constexpr, TMA: tl.constexpr, SPLIT_K: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    k_split = K // SPLIT_K
    k_lo = pid_k * k_split
    offs_m = tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    if SWAP:
        acc = tl.zeros((BN, BM), dtype=tl.float32)
    else:
        acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(k_lo, k_lo + k_split, BK):
        if TMA:
            w = wd.load([pid_n * BN, k0])  # [BN, BK]
            x = xd.load([0, k0])  # [BM, BK], rows past M read as 0
        else:
            w = tl.load(
                w_ptr + offs_n[:, None].to(tl.int64) * K + (k0 + offs_k)[None, :],
                mask=(offs_n < N)[:, None], other=0.0, eviction_policy="evict_first",
            )  # fmt: skip
            x = tl.load(
                x_ptr + offs_m[:, None] * K + (k0 + offs_k)[None, :],
                mask=(offs_m < M)[:, None], other=0.0,
            )  # fmt: skip
        if SWAP:
            acc = tl.dot(w, tl.trans(x), acc)
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    if SWAP:
        out = tl.trans(acc)
    else:
        out = acc
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    ptrs = y_ptr + pid_k.to(tl.int64) * M * N + offs_m[:, None] * N + offs_n[None, :]
    if SPLIT_K == 1:
        tl.store(ptrs, out.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(ptrs, out, mask=mask)


def _alloc(size: int, alignment: int, stream):  # device-side scratch Triton may ask for
    return torch.empty(size, dtype=torch.int8, device="cuda")


def probe(x, w, variant: str, bn: int, bk: int, warps: int, stages: int, split: int, y=None):
    m, k = x.shape
    n = w.shape[0]
    bm = max(16, triton.next_power_of_2(m))
    if y is None:
        y = (torch.empty(m, n, dtype=x.dtype, device=x.device) if split == 1
             else torch.empty(split, m, n, dtype=torch.float32, device=x.device))  # fmt: skip
    tma = variant == "tma"
    xd = TensorDescriptor.from_tensor(x, [bm, bk]) if tma else x
    wd = TensorDescriptor.from_tensor(w, [bn, bk]) if tma else w
    _probe_kernel[(triton.cdiv(n, bn), split)](
        x, w, xd, wd, y, m, n, k, SWAP=variant != "normal", TMA=tma, SPLIT_K=split,
        BM=bm, BN=bn, BK=bk, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return y


def candidates(shape: str, m: int):
    n, k = SHAPES[shape]
    out = []
    for variant, bn, bk, stages in itertools.product(
        ("normal", "swap", "tma"), (64, 128), (128, 256), (3, 5)
    ):
        if m > 8 and (bk, stages) != (128, 3) and variant != "tma":
            continue  # fewer tiles past bs 8
        for split in (1, 2, 4, 8, 16, 32):
            programs = triton.cdiv(n, bn) * split
            wide = split == 1 and programs > 1200  # the head: one split, many tiles
            if k % (split * bk) or not (100 <= programs <= 1200 or wide):
                continue
            out.append((variant, bn, bk, 4, stages, split))
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--shard", default="0/1")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    args = ap.parse_args(argv)
    triton.set_allocator(_alloc)
    i, n_shards = map(int, args.shard.split("/"))
    gbps = None if args.compile_only else copy_bandwidth_gbps()
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    jobs = [(s, m, c) for s in args.shapes.split(",") for m in ROWS for c in candidates(s, m)]
    by_case: dict = {}
    for j, (s, m, c) in enumerate(jobs):
        if j % n_shards == i:
            by_case.setdefault((s, m), []).append(c)
    for (s, m), cands in by_case.items():
        n, k = SHAPES[s]
        copies = 1 if args.compile_only else (4 if s == "head" else COPIES)
        ws = [(torch.randn(n, k, device="cuda", generator=g) * k**-0.5).to(DT)
              for _ in range(copies)]  # fmt: skip
        x = torch.randn(m, k, device="cuda", generator=g).to(DT)
        want = F.linear(x.double(), ws[0].double())
        floor = n * k * 2 / gbps / 1e3 if gbps else None
        cublas = None
        if not args.compile_only:
            cublas = graph_call_us([lambda w=w, x=x: F.linear(x, w) for w in ws])
        if not args.compile_only:
            rows.append(dict(shape=s, m=m, variant="cublas", us=cublas, of_floor=floor / cublas))
        for c in cands:
            row = dict(shape=s, m=m, variant=c[0], tile=list(c[1:]))
            try:
                y = probe(x, ws[0], *c)
                got = y.double() if c[-1] == 1 else y.double().sum(0)
                row["rel_err"] = ((got - want).norm() / want.norm()).item()
                if not args.compile_only:
                    ys = [torch.empty_like(y) for _ in ws]
                    us = graph_call_us([lambda w=w, yy=yy, c=c, x=x: probe(x, w, *c, y=yy)
                                   for w, yy in zip(ws, ys)])  # fmt: skip
                    row.update(us=us, of_floor=floor / us, cublas_us=cublas)
            except Exception as e:  # out of resources, unsupported layout, ...
                row["error"] = f"{type(e).__name__}: {e}"[:200]
            rows.append(row)
        del ws
        torch.cuda.empty_cache()
    if args.compile_only:
        return {}
    result = dict(copy_gbps=gbps, rows=rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print(f"copy bandwidth {gbps:.0f} GB/s")
    for s, m in by_case:
        case = [r for r in rows if r["shape"] == s and r["m"] == m and "us" in r]
        best = {}
        for r in case:
            if r["variant"] == "cublas" or r.get("rel_err", 1) < 1e-2:
                if r["us"] < best.get(r["variant"], {"us": 1e9})["us"]:
                    best[r["variant"]] = r
        bad = [r for r in rows if r["shape"] == s and r["m"] == m
               and ("error" in r or r.get("rel_err", 0) >= 1e-2)]  # fmt: skip
        line = "  ".join(f"{v} {r['us']:.2f} ({r['of_floor']:.0%}) {r.get('tile', '')}"
                         for v, r in sorted(best.items()))  # fmt: skip
        print(f"{s:>8} m={m:<3} {line}  [{len(bad)} failed]")
    return result


if __name__ == "__main__":
    main()
