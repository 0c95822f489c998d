"""Residual add + RMSNorm in one Triton kernel, and its torch reference.

    residual' = x + residual                      (rounded to the model dtype, as torch does)
    out       = weight * (residual' * rsqrt(mean(residual'^2) + eps)).to(dtype)

One program per token row (``hidden`` up to 8k fits one block). With ``residual=None`` it is a
plain RMSNorm and the "new residual" is ``x`` itself (the first layer's input).
``embed_rmsnorm`` is the same kernel reading its rows out of the embedding table by token id:
the fused decode step's embedding and its first norm in one launch, each output bit for bit
what ``embedding`` then ``add_rmsnorm`` give.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..launch_math import next_pow2


@triton.jit
def _add_rmsnorm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    ids_ptr,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    N,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    GATHER: tl.constexpr,  # x's row is ids[row] of x (an embedding table), copied to res_out
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    src = tl.load(ids_ptr + row).to(tl.int64) if GATHER else row
    x = tl.load(x_ptr + src * stride_x + cols, mask=mask, other=0.0)
    if GATHER:  # the embedding: the residual stream's first value
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
    # -- residual add, rounded to the model dtype before the norm reads it --
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
    # -- RMSNorm in float32, back to the dtype, then the weight --
    xf = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)
    y = (xf * inv_rms).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * y).to(out_ptr.dtype.element_ty), mask=mask)


def add_rmsnorm_reference(
    x: torch.Tensor,  # [T, hidden]
    residual: torch.Tensor | None,  # [T, hidden] or None
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # (normed [T, hidden], new residual [T, hidden])
    """The torch ops the model ran before fusion (transformers' RMSNorm, bit for bit)."""
    if residual is not None:
        x = x + residual
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype), x


def add_rmsnorm(
    x: torch.Tensor,  # [T, hidden]
    residual: torch.Tensor | None,  # [T, hidden] or None
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # (normed [T, hidden], new residual [T, hidden])
    """``(rmsnorm(x + residual), x + residual)`` in one launch; both outputs are new tensors
    (``residual=None``: ``(rmsnorm(x), x)``). Rows must be contiguous in the hidden dim."""
    t, n = x.shape
    out = torch.empty_like(x)
    has_res = residual is not None
    res_out = torch.empty_like(x) if has_res else x
    res = residual if has_res else x
    if t:
        _add_rmsnorm_kernel[(t,)](
            x,
            res,
            weight,
            out,
            res_out,
            x,
            x.stride(0),
            res.stride(0),
            out.stride(0),
            res_out.stride(0),
            n,
            eps,
            HAS_RESIDUAL=has_res,
            GATHER=False,
            BLOCK_N=next_pow2(n),
            num_warps=8 if n >= 2048 else 4,
        )
    return out, res_out


def embed_rmsnorm(
    ids: torch.Tensor,  # [T] int64 token ids, each in [0, vocab)
    table: torch.Tensor,  # [vocab, hidden], the embedding weight, rows contiguous
    weight: torch.Tensor,  # [hidden], the norm's weight
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # (normed [T, hidden], the embedded rows [T, hidden])
    """``(rmsnorm(table[ids]), table[ids])`` in one launch."""
    t, n = ids.shape[0], table.shape[1]
    out = table.new_empty(t, n)
    rows = table.new_empty(t, n)
    if t:
        _add_rmsnorm_kernel[(t,)](
            table,
            table,
            weight,
            out,
            rows,
            ids,
            table.stride(0),
            0,
            out.stride(0),
            rows.stride(0),
            n,
            eps,
            HAS_RESIDUAL=False,
            GATHER=True,
            BLOCK_N=next_pow2(n),
            num_warps=8 if n >= 2048 else 4,
        )
    return out, rows


__all__ = ["add_rmsnorm", "add_rmsnorm_reference", "embed_rmsnorm"]
