"""The norm handoff: the RMSNorm before a projection split between the kernel that writes the
residual stream and the projection, so that neither a norm kernel nor a pass over x is needed.

    RMSNorm(r) @ W.T = (1 / rms(r)) * ((r * norm_w) @ W.T)        (rows scale; up to rounding)

``gemv_residual(x, w, r, next_norm=norm_w)`` (o_proj and down) writes, beside each column tile of
``y = r + x @ w.T``, that tile of ``xw = y * norm_w`` rounded to the dtype (the next projection's
x) and every row's float32 sum of squares of the tile as stored (``handoff_out``: ``ssq [M,
tiles]``, one column per program, so no atomics and no zeroing: every step overwrites every
entry). The consumer (``qkv_rope``, ``gate_up_silu``, the LM head, given ``xw``, no norm weight
and ``ssq``) runs the plain K loop of a normed x, so the tiles of ``proj_tiles``' ``_normed``
kernels serve it, and scales each row of the products by ``rsqrt(sum(ssq) / K + eps)`` (summed
in tile order: ``ssq_inv_rms``) before its epilogue. The order of every sum is fixed by the tiles,
so eager and graph (and exact) steps, which launch the same tiles, give the same bits; against
``RMSNorm`` the products differ by rounding: ``r * norm_w`` is rounded where the reference rounds
``r / rms`` and then its product with the weight.

A first version normed x inside the consumer's K loop instead (x from r, the RMS from the sums):
slower on the H200 than the norm as its own kernel (docs/experiments.md#the-norm-inside-the-k-loop):
the loop's operand then passes through registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...errors import ConfigError
from ..launch_math import next_pow2


@triton.jit
def ssq_inv_rms(
    ssq_ptr,
    stride_sm,
    M,
    n_parts,
    K,
    eps,
    BLOCK_M: tl.constexpr,
    SSQ_PAD: tl.constexpr,
):
    # -> rsqrt(sum(ssq[m, :n_parts]) / K + eps) in float32, as gemv_tiles.row_inv_rms returns
    # it (a scalar when BLOCK_M == 1, else [BLOCK_M]; padded rows get rsqrt(eps))
    offs_p = tl.arange(0, SSQ_PAD)
    if BLOCK_M == 1:
        s1 = tl.load(ssq_ptr + offs_p, mask=offs_p < n_parts, other=0.0)
        inv_rms = tl.rsqrt(tl.sum(s1, axis=0) / K + eps)
    else:
        offs_m = tl.arange(0, BLOCK_M)
        mask = (offs_m < M)[:, None] & (offs_p < n_parts)[None, :]
        s = tl.load(ssq_ptr + offs_m[:, None] * stride_sm + offs_p[None, :], mask=mask, other=0.0)
        inv_rms = tl.rsqrt(tl.sum(s, axis=1) / K + eps)
    return inv_rms


@triton.jit
def handoff_out(
    y,
    mask_m,
    mask_n,
    offs_n,
    pid_n,
    nw_ptr,
    xw_ptr,
    stride_xw,
    ssq_ptr,
    stride_sm,
    BLOCK_M: tl.constexpr,
):
    # y [BLOCK_M, BLOCK_N] as stored (the model dtype), columns offs_n (under mask_n), rows
    # under mask_m: each row's float32 sum of squares into ssq[m, pid_n], and y * norm_w
    # rounded to the dtype into xw (the next projection's x)
    mask = mask_m[:, None] & mask_n[None, :]
    yf = tl.where(mask, y.to(tl.float32), 0.0)
    offs_m = tl.arange(0, BLOCK_M)
    tl.store(ssq_ptr + offs_m * stride_sm + pid_n, tl.sum(yf * yf, axis=1), mask=mask_m)
    nw = tl.load(nw_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    xw = (yf * nw[None, :]).to(y.dtype)
    tl.store(xw_ptr + offs_m[:, None] * stride_xw + offs_n[None, :], xw, mask=mask)


@triton.jit
def residual_out(
    acc,
    mask_m,
    mask_n,
    offs_n,
    pid_n,
    res_ptr,
    stride_rm,
    y_ptr,
    stride_ym,
    nw_ptr,
    xw_ptr,
    stride_xw,
    ssq_ptr,
    stride_sm,
    RESIDUAL: tl.constexpr,
    SSQ_OUT: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    # The projections' epilogue: acc [BLOCK_M, BLOCK_N] float32 (+ residual when RESIDUAL: the
    # projection rounded to the dtype, then proj + residual in the dtype, as `x + residual`),
    # stored to y under the masks; with SSQ_OUT the handoff beside it (handoff_out). -> y as
    # stored, in y's dtype
    offs_m = tl.arange(0, BLOCK_M)
    mask = mask_m[:, None] & mask_n[None, :]
    if RESIDUAL:
        r = tl.load(res_ptr + offs_m[:, None] * stride_rm + offs_n[None, :], mask=mask, other=0.0)
        acc = acc.to(r.dtype).to(tl.float32) + r.to(tl.float32)
    y = acc.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], y, mask=mask)
    if SSQ_OUT:
        handoff_out(
            y, mask_m, mask_n, offs_n, pid_n, nw_ptr, xw_ptr, stride_xw, ssq_ptr, stride_sm, BLOCK_M
        )
    return y


def ssq_args(ssq: torch.Tensor | None, m: int, fallback: torch.Tensor) -> tuple:
    """``(tensor, row stride, parts, SSQ_PAD)`` of a consumer's sums of squares ``ssq``
    (``[>= m, parts]`` float32, what ``gemv_residual(..., next_norm=w)`` returned with x), or
    ``(fallback, 0, 0, 0)`` for None. Refuses any other tensor."""
    if ssq is None:
        return fallback, 0, 0, 0
    if (
        not isinstance(ssq, torch.Tensor)
        or ssq.dtype != torch.float32
        or ssq.dim() != 2
        or ssq.shape[0] < m
        or ssq.shape[1] < 1
        or ssq.stride(1) != 1
    ):
        got = (
            (tuple(ssq.shape), ssq.dtype, tuple(ssq.stride()))
            if isinstance(ssq, torch.Tensor)
            else type(ssq).__name__
        )
        raise ConfigError(
            f"ssq must be a [rows >= {m}, parts >= 1] float32 tensor with contiguous rows (the "
            f"sums of squares gemv_residual(..., next_norm=w) returns with x), got {got}"
        )
    return ssq, ssq.stride(0), ssq.shape[1], next_pow2(ssq.shape[1])


def check_handoff(norm_w, ssq, kernel: str, need_norm: bool = False) -> None:
    """A consumer takes its norm one way: ``norm_w`` (the prologue) or ``ssq`` (x is already
    ``r * norm_w``), never both; ``need_norm``: one of them is required (the LM head's)."""
    if norm_w is not None and ssq is not None:
        raise ConfigError(
            f"{kernel}: pass norm_w or ssq, not both (with ssq, x is r * norm_w already: the "
            "xw that gemv_residual(..., next_norm=norm_w) returns)"
        )
    if need_norm and norm_w is None and ssq is None:
        raise ConfigError(f"{kernel}: needs norm_w (the RMSNorm weight) or ssq (norm_handoff)")


__all__ = ["check_handoff", "handoff_out", "residual_out", "ssq_args", "ssq_inv_rms"]
