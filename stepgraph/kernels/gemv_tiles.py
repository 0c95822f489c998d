"""The pieces every fused projection kernel is built from (``norm_gemv``, ``gate_up_silu``,
``qkv_rope``): the RMSNorm prologue, the weight stream, the launch geometry.

A projection at decode batch sizes (``M <= 8`` rows) is a stream over its weight ``[N, K]``.
Program ``pid`` owns ``BLOCK_N`` weight rows (or two sets of ``BLOCK_N`` rows for the *paired*
epilogues: gate and up, or the two halves of a RoPE head) and walks K in ``BLOCK_K`` chunks.

- ``first_w_tile`` loads the first weight tile. The kernels call it *before* ``gdc_wait()``:
  weights are never written during a step, so under PDL the first tile streams while the
  previous kernel finishes (for K = 2048 it is the whole of the program's rows).
- ``row_inv_rms`` recomputes ``rsqrt(mean(x^2) + eps)`` of each activation row in every program:
  the row (4 KB at hidden 2048) comes from L2, and no norm kernel or launch is needed.
- ``gemv_loop`` accumulates ``acc[m, n] = sum_k xn[m, k] w[n, k]`` in float32, loading the next
  weight tile before it multiplies the current one (one tile ahead, by hand: the first tile
  already came before the wait). ``xn`` is the activation rounded the way the unfused torch path
  rounds: ``norm_w * (x * inv_rms).to(dtype)``, in the model dtype.
"""

from __future__ import annotations

import triton
import triton.language as tl

MAX_M = 8  # batch rows one launch takes; larger batches take the unfused path (cuBLAS)


@triton.jit
def first_w_tile(w_ptrs, mask_n, K, BLOCK_K: tl.constexpr):
    # w_ptrs: [BLOCK_N, BLOCK_K] pointers at k = 0 -> tile [BLOCK_N, BLOCK_K] in the weight dtype
    offs_k = tl.arange(0, BLOCK_K)
    return tl.load(
        w_ptrs, mask=mask_n[:, None] & (offs_k < K)[None, :], other=0.0,
        eviction_policy="evict_first",
    )  # fmt: skip


@triton.jit
def row_inv_rms(
    x_ptr, stride_xm, M, K, eps,
    BLOCK_M: tl.constexpr, NORM_BLOCK: tl.constexpr,
):  # fmt: skip
    # -> [BLOCK_M] float32, rsqrt(mean(x[m, :K]^2) + eps); padded rows get rsqrt(eps)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, NORM_BLOCK)
    ss = tl.zeros((BLOCK_M, NORM_BLOCK), dtype=tl.float32)
    for k0 in range(0, K, NORM_BLOCK):
        mask = (offs_m < M)[:, None] & ((k0 + offs_k) < K)[None, :]
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + k0 + offs_k[None, :], mask=mask, other=0.0
        )
        xf = x.to(tl.float32)
        ss += xf * xf
    return tl.rsqrt(tl.sum(ss, axis=1) / K + eps)


@triton.jit
def x_tile(
    x_ptr, nw_ptr, stride_xm, k0, M, K, inv_rms,
    NORM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # -> [BLOCK_M, BLOCK_K] float32: x[:, k0:k0 + BLOCK_K], normed and weighted when NORM
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    mask_k = offs_k < K
    mask = (offs_m < M)[:, None] & mask_k[None, :]
    x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mask, other=0.0)
    if NORM:
        # -- as torch: (x * inv_rms) in float32, to the dtype, times the weight, to the dtype --
        xn = (x.to(tl.float32) * inv_rms[:, None]).to(x.dtype).to(tl.float32)
        nw = tl.load(nw_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        x = (xn * nw[None, :]).to(x.dtype)
    return x.to(tl.float32)


@triton.jit
def gemv_loop(
    w1_ptrs, w2_ptrs, w1, w2, mask_n,
    x_ptr, nw_ptr, stride_xm, M, K, inv_rms,
    NORM: tl.constexpr, PAIRED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # w1_ptrs, w2_ptrs: [BLOCK_N, BLOCK_K] pointers at k = 0; w1, w2: their first tiles.
    # -> (acc1, acc2), [BLOCK_M, BLOCK_N] float32 each (acc2 = acc1 unless PAIRED)
    offs_k = tl.arange(0, BLOCK_K)
    if BLOCK_M == 1:
        # -- one row: products in a [BLOCK_N, BLOCK_K] tile, one reduction at the end --
        p1 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        p2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    else:
        a1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        a2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        # -- the next weight tile is in flight while this one is multiplied --
        mask_next = mask_n[:, None] & ((k0 + BLOCK_K + offs_k) < K)[None, :]
        w1_next = tl.load(
            w1_ptrs + (k0 + BLOCK_K), mask=mask_next, other=0.0, eviction_policy="evict_first"
        )
        if PAIRED:
            w2_next = tl.load(
                w2_ptrs + (k0 + BLOCK_K), mask=mask_next, other=0.0,
                eviction_policy="evict_first",
            )  # fmt: skip
        x = x_tile(x_ptr, nw_ptr, stride_xm, k0, M, K, inv_rms, NORM, BLOCK_M, BLOCK_K)
        if BLOCK_M == 1:
            p1 += w1.to(tl.float32) * x  # [BLOCK_N, BLOCK_K] * [1, BLOCK_K]
            if PAIRED:
                p2 += w2.to(tl.float32) * x
        else:
            # -- acc[m, n] += sum_k x[m, k] * w[n, k] --
            a1 += tl.sum(x[:, None, :] * w1.to(tl.float32)[None, :, :], axis=2)
            if PAIRED:
                a2 += tl.sum(x[:, None, :] * w2.to(tl.float32)[None, :, :], axis=2)
        w1 = w1_next
        if PAIRED:
            w2 = w2_next
    if BLOCK_M == 1:
        a1 = tl.sum(p1, axis=1)[None, :]  # [1, BLOCK_N]
        a2 = tl.sum(p2, axis=1)[None, :]
    if not PAIRED:
        a2 = a1
    return a1, a2


def proj_blocks(m: int, n_rows: int, k: int) -> tuple[int, int, int]:
    """``(BLOCK_N, BLOCK_K, num_warps)`` for ``n_rows`` weight rows per launch (the paired
    kernels count both sets): as ``gemv.gemv_blocks``, at least ~4 programs per SM of an H200 on
    the 2k-wide projections and 8k elements of ``BLOCK_M * BLOCK_N * BLOCK_K`` per iteration."""
    block_m = max(1, triton.next_power_of_2(m))
    max_n = max(1, 8192 // (block_m * 256))  # keep >= 256 K per row: 512-byte row segments
    block_n = min(4, max_n)
    while block_n < max_n and triton.cdiv(n_rows, block_n * 2) >= 512:
        block_n *= 2
    block_k = max(32, min(triton.next_power_of_2(k), 8192 // (block_n * block_m)))
    return block_n, block_k, 4


def norm_block(m: int, k: int) -> int:
    """Chunk of the sum-of-squares pass: the whole row up to 4k elements of ``[BLOCK_M, K]``
    (one load from L2 per program, not a loop of dependent loads)."""
    block_m = max(1, triton.next_power_of_2(m))
    return max(16, min(triton.next_power_of_2(k), 4096 // block_m))


__all__ = [
    "MAX_M",
    "first_w_tile",
    "gemv_loop",
    "norm_block",
    "proj_blocks",
    "row_inv_rms",
    "x_tile",
]
