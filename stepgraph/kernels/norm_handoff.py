"""The norm handoff: the RMSNorm's sum of squares computed by the kernel that writes the
residual stream, so that the next projection needs neither a norm kernel nor a pass over x.

``gemv_residual(x, w, r, ssq=True)`` (o_proj and down) stores, beside each column tile of
``r + x @ w.T`` it writes, every row's float32 sum of squares of that tile as stored (``row_ssq``:
``ssq [M, tiles]``, one column per program, so no atomics and no zeroing: every step overwrites
every entry). The consumer (``qkv_rope``, ``gate_up_silu``, the LM head) sums the row in tile
order (``ssq_inv_rms``) for ``rsqrt(mean(r^2) + eps)`` and norms its x tiles in the K loop as the
norm prologue does. The order of that sum is fixed by the tiles, so eager and graph (and exact)
steps, which launch the same tiles, give the same bits; against ``RMSNorm`` it differs by float32
rounding of the mean alone.

Without it, the tensor-core rows ran the norm as its own kernel (``proj_tiles.SEPARATE_NORM``,
measured faster than the prologue's pass over ``[BLOCK_M, K]`` in every program): 32 launches
a step for Llama-3.2-1B.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..errors import ConfigError


@triton.jit
def ssq_inv_rms(
    ssq_ptr, stride_sm, M, n_parts, K, eps, BLOCK_M: tl.constexpr, SSQ_PAD: tl.constexpr,
):  # fmt: skip
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
def row_ssq(y, mask, ssq_ptr, stride_sm, pid_n, mask_m, BLOCK_M: tl.constexpr):
    # y [BLOCK_M, BLOCK_N] as stored (the model dtype): each row's float32 sum of squares over
    # the columns under mask, into ssq[m, pid_n] for the rows under mask_m
    yf = tl.where(mask, y.to(tl.float32), 0.0)
    ss = tl.sum(yf * yf, axis=1)  # [BLOCK_M]
    offs_m = tl.arange(0, BLOCK_M)
    tl.store(ssq_ptr + offs_m * stride_sm + pid_n, ss, mask=mask_m)


def ssq_args(ssq: torch.Tensor | None, m: int, fallback: torch.Tensor) -> tuple:
    """``(tensor, row stride, parts, SSQ_PAD)`` of a consumer's sums of squares ``ssq``
    (``[>= m, parts]`` float32, what ``gemv_residual(..., ssq=True)`` returned with x), or
    ``(fallback, 0, 0, 0)`` for None: the norm from x itself. Refuses any other tensor."""
    if ssq is None:
        return fallback, 0, 0, 0
    if (
        not isinstance(ssq, torch.Tensor) or ssq.dtype != torch.float32 or ssq.dim() != 2
        or ssq.shape[0] < m or ssq.shape[1] < 1 or ssq.stride(1) != 1
    ):  # fmt: skip
        got = (tuple(ssq.shape), ssq.dtype, tuple(ssq.stride())) if isinstance(
            ssq, torch.Tensor) else type(ssq).__name__  # fmt: skip
        raise ConfigError(
            f"ssq must be a [rows >= {m}, parts >= 1] float32 tensor with contiguous rows (the "
            f"sums of squares gemv_residual(..., ssq=True) returns with x), got {got}"
        )
    return ssq, ssq.stride(0), ssq.shape[1], triton.next_power_of_2(ssq.shape[1])


__all__ = ["row_ssq", "ssq_args", "ssq_inv_rms"]
