"""An FP8 weight dequantized in one pass, for projections of more than 64 rows.

Past 64 rows (a large decode bucket, a prefill) a projection is compute-bound and cuBLAS's bf16
GEMM is the fastest way through it, so ``Fp8Linear`` hands cuBLAS a temporary ``weight * scale``
in x's dtype, a chunk of output rows at a time (``dequant_linear``), each freed after its GEMM.
Built with torch ops that temporary cost three passes over a float32 copy (convert, scale,
cast: about 6 bytes written and 10 read per weight); here each program loads a
``[BLOCK_N, BLOCK_K]`` tile of e4m3 values, multiplies by its scales in float32 and stores the
tile in the output dtype: one byte read and two written per weight (bf16).

The result equals ``dequantize_reference(weight, scale, block, torch.float32).to(dtype)`` bit
for bit: every e4m3 value is exact in float32, the product is one correctly rounded float32
multiply, and the cast rounds to nearest even as torch's does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.nn import functional as F

from ...errors import ConfigError
from ..launch_math import cdiv
from .fp8_gemv import dequantize_reference

BLOCK_N, BLOCK_K = 16, 256  # 4,096 weights a program: 32 a thread at 4 warps
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def bf16_nearest_even(y):
    # float32 -> bfloat16 rounded to nearest even in integer ops, the cast cuBLAS's operand gets
    # from torch; Triton's interpreter truncates a plain cast, so the CPU tier would test another
    # rounding than the GPU runs. NaN stays NaN (its carry could reach the sign bit).
    bits = y.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    r = bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return tl.where(y == y, r, y.to(tl.bfloat16))


@triton.jit
def _dequant_kernel(
    w_ptr,
    s_ptr,
    y_ptr,
    N,
    K,
    stride_wn,
    stride_sn,
    stride_yn,
    W_FORMAT: tl.constexpr,  # 1: a scale per output channel; 2: per (SCALE_BN, SCALE_BK) block
    SCALE_BN: tl.constexpr,
    SCALE_BK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (offs_n < N)[:, None] & (offs_k < K)[None, :]
    rows = offs_n[:, None].to(tl.int64)
    w = tl.load(w_ptr + rows * stride_wn + offs_k[None, :], mask=mask, other=0.0)
    if W_FORMAT == 2:
        s_ptrs = s_ptr + (offs_n // SCALE_BN)[:, None] * stride_sn + (offs_k // SCALE_BK)[None, :]
        s = tl.load(s_ptrs, mask=mask, other=0.0)
    else:
        s = tl.load(s_ptr + offs_n, mask=offs_n < N, other=0.0)[:, None]
    y = w.to(tl.float32) * s
    if y_ptr.dtype.element_ty == tl.bfloat16:
        y = bf16_nearest_even(y)
    tl.store(y_ptr + rows * stride_yn + offs_k[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


def dequantize_fp8(
    weight: torch.Tensor,  # [N, K] float8_e4m3fn, rows contiguous, on CUDA
    scale: torch.Tensor,  # float32 [N], or [ceil(N / bn), ceil(K / bk)] with block
    block: tuple[int, int] | None = None,  # (bn, bk): block scales; None: per channel
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:  # [N, K] in dtype
    """``weight * scale`` in ``dtype`` in one launch (see the module's note); inputs checked on
    the host with a ConfigError naming the fix."""
    if weight.dim() != 2 or weight.dtype != torch.float8_e4m3fn or weight.stride(-1) != 1:
        raise ConfigError(
            f"dequantize_fp8: weight must be an [N, K] torch.float8_e4m3fn tensor with "
            f"contiguous rows; got {weight.dtype} of shape {tuple(weight.shape)}"
        )
    if dtype not in OUT_DTYPES:
        raise ConfigError(f"dequantize_fp8: dtype must be one of {OUT_DTYPES}; got {dtype}")
    n, k = weight.shape
    want = (n,) if block is None else (cdiv(n, block[0]), cdiv(k, block[1]))
    if (
        scale.dtype != torch.float32
        or tuple(scale.shape) != want
        or scale.stride(-1) != 1
        or scale.device != weight.device
    ):
        raise ConfigError(
            f"dequantize_fp8: scale must be float32 of shape {want} with contiguous rows on "
            f"{weight.device}; got {scale.dtype} of shape {tuple(scale.shape)} on {scale.device}"
        )
    y = torch.empty(n, k, dtype=dtype, device=weight.device)
    if n == 0 or k == 0:
        return y
    _dequant_kernel[(cdiv(n, BLOCK_N), cdiv(k, BLOCK_K))](
        weight,
        scale,
        y,
        n,
        k,
        weight.stride(0),
        scale.stride(0) if block is not None else 1,
        y.stride(0),
        W_FORMAT=1 if block is None else 2,
        SCALE_BN=block[0] if block else 1,
        SCALE_BK=block[1] if block else 1,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        num_warps=4,
    )
    return y


CHUNK_BYTES = 16 << 20  # dequant_linear's default: dequantized weight bytes alive at once


def dequantize(weight, scale, block=None, dtype=torch.bfloat16) -> torch.Tensor:
    """``weight * scale`` in ``dtype``, the same bits on CUDA (``dequantize_fp8``, one pass) as
    on the CPU (torch ops through float32); float64 straight from the e4m3 values."""
    if weight.is_cuda and dtype in OUT_DTYPES:
        return dequantize_fp8(weight, scale, block, dtype)
    if dtype == torch.float64:
        return dequantize_reference(weight, scale, block)
    return dequantize_reference(weight, scale, block, torch.float32).to(dtype)


def chunk_rows(n: int, k: int, itemsize: int, block: tuple[int, int] | None, chunk_bytes: int):
    """Weight rows dequantized at once: ``chunk_bytes`` of the dequantized weight, whole scale
    blocks (a multiple of ``block[0]``, or of 128 per channel), at least one block; ``n`` (one
    chunk) when ``chunk_bytes`` is 0 or covers the weight."""
    if chunk_bytes <= 0 or chunk_bytes >= n * k * itemsize:
        return n
    unit = block[0] if block is not None else 128
    return min(n, max(unit, chunk_bytes // (k * itemsize) // unit * unit))  # k > 0 here


def dequant_linear(
    x: torch.Tensor,  # [M, K], rows contiguous
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    scale: torch.Tensor,
    block: tuple[int, int] | None = None,
    bias: torch.Tensor | None = None,
    chunk_bytes: int | None = None,  # None: CHUNK_BYTES; 0: the whole weight at once
) -> torch.Tensor:  # [M, N] in x.dtype
    """``x @ (weight * scale).T + bias`` through cuBLAS (torch's GEMM on the CPU) over the
    weight dequantized ``chunk_rows`` output rows at a time: each chunk's GEMM writes its
    columns of one output in place, and at most one chunk of dequantized weight (about
    ``chunk_bytes``) is alive, so a graph's pool holds a chunk, not a weight. Chunks fresh from
    the dequantization are still in L2 when the GEMM reads them."""
    n, k = weight.shape
    if x.shape[0] == 0:  # nothing to multiply: no weight dequantized
        return x.new_empty(0, n)
    chunk_bytes = CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    step = chunk_rows(n, k, x.element_size(), block, chunk_bytes)
    if step >= n:
        return F.linear(x, dequantize(weight, scale, block, x.dtype), bias)
    y = x.new_empty(x.shape[0], n)
    bn = block[0] if block is not None else 1
    for n0 in range(0, n, step):
        n1 = min(n, n0 + step)
        w = dequantize(weight[n0:n1], scale[n0 // bn : cdiv(n1, bn)], block, x.dtype)
        if bias is None:
            torch.mm(x, w.t(), out=y[:, n0:n1])
        else:
            torch.addmm(bias[n0:n1], x, w.t(), out=y[:, n0:n1])
        del w  # freed before the next chunk's: one chunk alive in a graph's pool
    return y


__all__ = ["CHUNK_BYTES", "chunk_rows", "dequant_linear", "dequantize", "dequantize_fp8"]
