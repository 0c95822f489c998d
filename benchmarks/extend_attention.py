"""Prefill ("extend") attention: our Triton kernel over the paged KV cache against torch SDPA.

    PYTHONPATH=. python benchmarks/extend_attention.py [--sweep] [--json out/extend.json]

Per shape (bs requests, each a chunk of q_len new tokens over a cached prefix, 32 query heads,
8 KV heads, bf16, page size 16, pages shuffled over the cache): CUDA-event medians after warm-up
of ``extend_attention`` and of the peer, ``F.scaled_dot_product_attention`` under the flash and
memory-efficient backends, one batched call ``[bs, H, L, hd]`` on the same keys gathered into
contiguous tensors (gather not timed), ``is_causal`` and ``enable_gqa`` (with a prefix: the
lower-right causal bias). TFLOP/s count the causal FLOPs (``causal_flops``); "x SDPA" is SDPA's
time over ours (above 1: we are faster). Each output is checked against SDPA's before timing.

``--sweep`` also times every candidate tile of ``SWEEP`` on every shape and prints, per
head_dim, "x SDPA" per tile and shape and its geomean over the shapes: the figures behind
``DEFAULT_TILES`` in ``stepgraph/kernels/prefill/extend_attention.py``.

Target (reported, not tested): >= 0.9x SDPA's speed at 8 x 2048 for head_dim 64 and 128.
Measured on the H200 (2026-12-01, torch 2.11, Triton 3.6, tile m64n64w4s2): 8 x 2048 hd 64
421 us, 326 TFLOP/s, 1.24x SDPA; hd 128 821 us, 335 TFLOP/s, 1.09x.
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from stepgraph.bench.timing import cuda_time_ms
from stepgraph.kernels.prefill.extend_attention import (
    ExtendTile,
    causal_flops,
    default_tile,
    extend_attention,
)

N_HEADS, N_KV, PAGE_SIZE, DTYPE = 32, 8, 16, torch.bfloat16
SHAPES = [  # (bs, prefix, q_len, head_dim); the first two carry the target
    (8, 0, 2048, 64),
    (8, 0, 2048, 128),
    (1, 0, 512, 64),
    (32, 0, 512, 64),
    (1, 3584, 512, 64),
    (1, 0, 2048, 64),
    (4, 1024, 1024, 64),
    (1, 0, 512, 128),
    (32, 0, 512, 128),
    (1, 3584, 512, 128),
    (1, 0, 2048, 128),
    (4, 1024, 1024, 128),
]
_T = ExtendTile
SWEEP = {  # candidate tiles per head_dim: (block_m, block_n, num_warps, num_stages)
    64: [
        _T(64, 64, 4, 2),
        _T(128, 128, 4, 2),
        _T(128, 64, 8, 3),
        _T(128, 64, 4, 3),
        _T(64, 128, 4, 3),
        _T(64, 64, 4, 3),
        _T(64, 32, 4, 2),
        _T(64, 128, 4, 2),
        _T(32, 64, 4, 2),
        _T(64, 64, 4, 1),
    ],
    128: [
        _T(64, 64, 4, 2),
        _T(128, 32, 4, 3),
        _T(64, 64, 4, 3),
        _T(128, 64, 8, 2),
        _T(64, 32, 4, 3),
        _T(128, 64, 8, 3),
        _T(64, 32, 4, 2),
        _T(64, 128, 4, 2),
        _T(32, 64, 4, 2),
        _T(64, 64, 4, 1),
    ],
}
PEER_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]


def time_us(fn) -> float:
    """Median µs per call; enough calls per event pair that each sample spans about 0.5 ms."""
    probe = cuda_time_ms(fn, warmup=3, iters=3)
    inner = max(1, min(200, math.ceil(0.5 / max(probe, 1e-4))))
    return cuda_time_ms(fn, warmup=5, iters=15, inner=inner) * 1e3


class Work:
    """One shape's inputs: the paged cache for the kernel, contiguous copies for SDPA."""

    def __init__(self, bs: int, prefix: int, q_len: int, head_dim: int) -> None:
        g = torch.Generator(device="cuda").manual_seed(bs * 7 + prefix + q_len + head_dim)
        kv_len = prefix + q_len
        n_per = -(-kv_len // PAGE_SIZE)
        n_pages = bs * n_per + 1  # page 0: scratch
        shape = (n_pages, PAGE_SIZE, N_KV, head_dim)
        self.k = torch.randn(shape, generator=g, device="cuda").to(DTYPE)
        self.v = torch.randn(shape, generator=g, device="cuda").to(DTYPE)
        perm = torch.randperm(n_pages - 1, generator=g, device="cuda") + 1
        self.bt = perm.to(torch.int32).view(bs, n_per)
        self.q = torch.randn(bs * q_len, N_HEADS, head_dim, generator=g, device="cuda").to(DTYPE)
        self.indptr = torch.arange(0, bs * q_len + 1, q_len, dtype=torch.int32, device="cuda")
        self.kv_lens = torch.full((bs,), kv_len, dtype=torch.int32, device="cuda")
        self.out = torch.empty_like(self.q)
        self.bs, self.prefix, self.q_len, self.kv_len, self.hd = bs, prefix, q_len, kv_len, head_dim
        self.scale = head_dim**-0.5
        # SDPA's inputs: [bs, H, L, hd]; keys gathered page by page into [bs, n_kv, kv_len, hd]
        self.q4 = self.q.view(bs, q_len, N_HEADS, head_dim).transpose(1, 2)
        rows = self.bt.long()
        self.k4 = self.k[rows].flatten(1, 2)[:, :kv_len].transpose(1, 2).contiguous()
        self.v4 = self.v[rows].flatten(1, 2)[:, :kv_len].transpose(1, 2).contiguous()
        self.flops = causal_flops([q_len] * bs, [kv_len] * bs, N_HEADS, head_dim)

    def ours(self, tile: ExtendTile | None):
        return lambda: extend_attention(
            self.q,
            self.k,
            self.v,
            self.indptr,
            self.kv_lens,
            self.bt,
            max_q_len=self.q_len,
            sm_scale=self.scale,
            out=self.out,
            tile=tile,
        )

    def peer(self):
        """SDPA on the gathered keys; where no backend takes GQA with the lower-right causal
        bias, the KV heads are expanded beforehand (not timed) and ``self.peer_gqa`` is False."""
        if self.prefix == 0:
            mask = dict(is_causal=True)
        else:
            mask = dict(attn_mask=causal_lower_right(self.q_len, self.kv_len))

        def sdpa(k4, v4, gqa):
            with sdpa_kernel(PEER_BACKENDS):
                return F.scaled_dot_product_attention(
                    self.q4, k4, v4, **mask, scale=self.scale, enable_gqa=gqa
                )

        kv = (self.k4, self.v4, True)
        try:
            sdpa(*kv)
        except RuntimeError:
            group = N_HEADS // N_KV
            kv = (self.k4.repeat_interleave(group, 1), self.v4.repeat_interleave(group, 1), False)
        self.peer_gqa = kv[2]
        return lambda: sdpa(*kv)

    def name(self) -> str:
        pre = f" over {self.prefix}" if self.prefix else ""
        return f"{self.bs}x{self.q_len}{pre} hd{self.hd}"


def check(w: Work, ours_out: torch.Tensor, peer_out: torch.Tensor) -> float:
    ref = peer_out.transpose(1, 2).reshape_as(ours_out).double()
    err = ((ours_out.double() - ref).norm() / ref.norm()).item()
    if not err < 2e-2 or ours_out.isnan().any():
        raise ValueError(f"{w.name()}: our output differs from SDPA's, rel err {err:.2e}")
    return err


def bench_shape(w: Work, tiles: list[ExtendTile]) -> list[dict]:
    """One row per tile: ours against the peer, timed after a correctness check."""
    peer = w.peer()
    peer_us, peer_out = time_us(peer), peer()
    rows = []
    for tile in tiles:
        try:
            err = check(w, w.ours(tile)(), peer_out)
        except Exception as e:  # a wrong answer, or a tile that does not compile here
            print(f"{w.name()} {tile.name}: failed: {type(e).__name__}: {e}"[:300], flush=True)
            continue
        us = time_us(w.ours(tile))
        rows.append(
            dict(
                shape=w.name(),
                tile=tile.name,
                default=tile == default_tile(w.hd, DTYPE),
                us=us,
                sdpa_us=peer_us,
                tflops=w.flops / us / 1e6,
                sdpa_tflops=w.flops / peer_us / 1e6,
                x_sdpa=peer_us / us,
                rel_err_vs_sdpa=err,
                sdpa_gqa=w.peer_gqa,
            )
        )
        print(f"row {rows[-1]}", flush=True)
    return rows


def print_sweep(rows: list[dict]) -> None:
    """x SDPA of every tile on every shape, per head_dim, and the geomean over the shapes."""
    for hd in SWEEP:
        sub = [r for r in rows if r["shape"].endswith(f"hd{hd}")]
        shapes = list(dict.fromkeys(r["shape"] for r in sub))
        print(f"\nsweep hd{hd}: x SDPA per tile ('*': the default)")
        print(
            f"{'tile':>14} " + " ".join(f"{s[: -len(f' hd{hd}')]:>13}" for s in shapes) + " geomean"
        )
        for tile in dict.fromkeys(r["tile"] for r in sub):
            x = {r["shape"]: r["x_sdpa"] for r in sub if r["tile"] == tile}
            star = "*" if any(r["default"] for r in sub if r["tile"] == tile) else " "
            gm = math.exp(sum(map(math.log, x.values())) / len(x)) if len(x) == len(shapes) else 0
            cells = " ".join(f"{x[s]:13.2f}" if s in x else f"{'-':>13}" for s in shapes)
            print(f"{star + tile:>14} {cells} {gm:7.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write every figure here")
    ap.add_argument("--sweep", action="store_true", help="also time every tile of SWEEP")
    args = ap.parse_args()

    rows = []
    for bs, prefix, q_len, hd in SHAPES:
        w = Work(bs, prefix, q_len, hd)
        tiles = [default_tile(hd, DTYPE)]
        if args.sweep:
            tiles += [t for t in SWEEP[hd] if t != tiles[0]]
        rows += bench_shape(w, tiles)
        del w
        torch.cuda.empty_cache()

    if args.sweep:
        print_sweep(rows)
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, page {PAGE_SIZE}")
    print(
        f"{'shape':>22} {'tile':>12} {'us':>8} {'TFLOP/s':>8} {'SDPA us':>8} {'SDPA TF/s':>9} "
        f"{'x SDPA':>7}"
    )
    for r in (r for r in rows if r["default"]):
        print(
            f"{r['shape']:>22} {r['tile']:>12} {r['us']:8.1f} {r['tflops']:8.1f} "
            f"{r['sdpa_us']:8.1f} {r['sdpa_tflops']:9.1f} {r['x_sdpa']:7.2f}"
        )
    if args.json:
        import triton

        meta = dict(
            device=torch.cuda.get_device_name(),
            torch=torch.__version__,
            triton=triton.__version__,
            dtype="bf16",
            page_size=PAGE_SIZE,
        )
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
