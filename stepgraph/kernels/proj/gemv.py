"""A Triton GEMV for small batches: ``y = x @ w.T (+ bias)`` for ``x [M <= 8, K]``, ``w [N, K]``.

At decode batch sizes a projection is a stream over its weights; the kernel only has to keep
enough loads in flight. Grid ``(cdiv(N, BLOCK_N),)``: program ``pid_n`` owns ``BLOCK_N`` output
features and walks K in ``BLOCK_K`` chunks, loading each weight tile once (``evict_first``: it is
never re-read this step) and every batch row against it: ``acc[m, n] += sum_k x[m, k] w[n, k]``
in float32 (one row: a ``[BLOCK_N, BLOCK_K]`` tile of products, reduced once at the end).
``out_dtype`` lets the LM head write float32 logits directly (no cast kernel).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..launch_math import cdiv, next_pow2

MAX_M = 8  # batch rows one launch takes; larger batches belong to cuBLAS


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = (
        w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    )  # [BLOCK_N, BLOCK_K]
    if BLOCK_M == 1:
        # -- one row: elementwise products in a [BLOCK_N, BLOCK_K] tile, one reduction at the end --
        acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            mask_k = (k0 + offs_k) < K
            x = tl.load(x_ptr + k0 + offs_k, mask=mask_k, other=0.0)  # [BLOCK_K]
            w = tl.load(
                w_ptrs,
                mask=mask_n[:, None] & mask_k[None, :],
                other=0.0,
                eviction_policy="evict_first",
            )
            acc2 += w.to(tl.float32) * x.to(tl.float32)[None, :]
            w_ptrs += BLOCK_K
        acc = tl.sum(acc2, axis=1)[None, :]  # [1, BLOCK_N]
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            mask_k = (k0 + offs_k) < K
            x = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            w = tl.load(
                w_ptrs,
                mask=mask_n[:, None] & mask_k[None, :],
                other=0.0,
                eviction_policy="evict_first",
            )
            # -- acc[m, n] += sum_k x[m, k] * w[n, k] --
            acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def gemv_blocks(m: int, n: int, k: int) -> tuple[int, int, int]:
    """Default ``(BLOCK_N, BLOCK_K, num_warps)``: at least ~4 programs per SM of an H200 for
    the 2k-wide projections, and a ``BLOCK_M * BLOCK_N * BLOCK_K`` product of 8k elements per
    iteration (64 float32 registers a thread at 4 warps; fewer K per row as the batch grows)."""
    block_m = max(1, next_pow2(m))
    max_n = max(1, 8192 // (block_m * 256))  # keep >= 256 K per row: 512-byte row segments
    block_n = min(4, max_n)
    while block_n < max_n and cdiv(n, block_n * 2) >= 512:
        block_n *= 2
    block_k = max(32, min(next_pow2(k), 8192 // (block_n * block_m)))
    return block_n, block_k, 4


def gemv(
    x: torch.Tensor,  # [M, K], M <= MAX_M, rows contiguous
    weight: torch.Tensor,  # [N, K], rows contiguous
    bias: torch.Tensor | None = None,  # [N]
    out_dtype: torch.dtype | None = None,
    *,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:  # [M, N], out_dtype (default x.dtype)
    """``x @ weight.T + bias`` for a small batch, float32 accumulation, one launch."""
    m, k = x.shape
    n = weight.shape[0]
    dbn, dbk, dnw = gemv_blocks(m, n, k)
    block_n, block_k, num_warps = block_n or dbn, block_k or dbk, num_warps or dnw
    y = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    if m:
        _gemv_kernel[(cdiv(n, block_n),)](
            x,
            weight,
            bias if bias is not None else weight,
            y,
            m,
            n,
            k,
            x.stride(0),
            weight.stride(0),
            y.stride(0),
            HAS_BIAS=bias is not None,
            BLOCK_M=max(1, next_pow2(m)),
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            num_warps=num_warps,
        )
    return y


__all__ = ["MAX_M", "gemv", "gemv_blocks"]
