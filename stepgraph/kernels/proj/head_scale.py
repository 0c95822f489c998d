"""The cuBLAS LM head on the norm handoff: its rows scaled by 1 / RMS into the float32 logits,
and their greedy tokens, in one launch.

Where the step's LM head is a cuBLAS GEMM (33-64 rows of the 1B preset, ``tile_table.CUBLAS``)
it can take the handoff's ``x = r * norm_w`` (``kernels/proj/norm_handoff``) with no norm kernel
before it: the GEMM's bf16 rows then lack the 1 / RMS of ``r``, a positive scale per row.
``_head_scale_kernel``, grid ``(M, P)``: each program takes ``BLOCK_V`` columns of a row, scales
them by ``rsqrt(sum(ssq[m]) / hidden + eps)`` (``ssq_inv_rms``) in float32 and stores them
into the logits (in place of the copy to float32 that the plain head runs), and with
``tokens`` its largest value and the first column holding it; the last program by ticket
reduces every row's partials to its token (``argmax_parts.fold_argmax``, the fused LM head's
reduce, so ties go to the first column as ``torch.argmax``'s do). So the head is the GEMM and
this one launch, where the plain one runs a norm, the GEMM, a copy and two argmax launches.

The tokens are of the scaled float32 logits this launch writes. Rows must be finite (a NaN row
has no defined token here, unlike ``argmax_rows``, which follows torch's NaN rule).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...errors import ConfigError
from ...tuning import DecodeTuning, default_tuning
from ..launch_math import cdiv, next_pow2
from ..pdl import launch_options, pdl_wait_then_trigger_short, resolve_pdl
from ..sampling.argmax_parts import _NO_INDEX, fold_argmax, fold_block
from .norm_handoff import ssq_args, ssq_inv_rms
from .proj_tiles import splitk_workspace

BLOCK_V = 8192  # columns a program scales: 16 programs a row at vocab 128256
NUM_WARPS = 8


@triton.jit
def _head_scale_kernel(
    raw_ptr,
    stride_rm,
    out_ptr,
    stride_om,
    V,
    ssq_ptr,
    stride_sm,
    n_parts,
    hidden,
    eps,
    part_val_ptr,
    part_idx_ptr,
    stride_pm,
    tok_ptr,
    ticket_ptr,
    M,
    SSQ_PAD: tl.constexpr,
    ARGMAX: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_P: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    row = tl.program_id(0)
    part = tl.program_id(1)
    pdl_wait_then_trigger_short(USE_PDL)  # the GEMM's rows and the sums are the predecessors'
    cols = part * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = cols < V
    v = tl.load(raw_ptr + row * stride_rm + cols, mask=mask, other=0.0).to(tl.float32)
    inv_rms = ssq_inv_rms(ssq_ptr + row * stride_sm, 0, 1, n_parts, hidden, eps, 1, SSQ_PAD)
    v = v * inv_rms
    tl.store(out_ptr + row * stride_om + cols, v, mask=mask)
    if ARGMAX:
        vm = tl.where(mask, v, float("-inf"))
        top = tl.max(vm, axis=0)
        first = tl.min(tl.where(vm == top, cols, _NO_INDEX), axis=0)
        tl.store(part_val_ptr + row * stride_pm + part, top)
        tl.store(part_idx_ptr + row * stride_pm + part, first)
        fold_argmax(
            part_val_ptr,
            part_idx_ptr,
            stride_pm,
            M,
            tl.num_programs(1),
            tok_ptr,
            ticket_ptr,
            BLOCK_M,
            BLOCK_P,
        )


def head_scale(
    raw: torch.Tensor,  # [M, V] bf16 / fp16 / fp32: (r * norm_w) @ W^T, rows contiguous
    ssq: torch.Tensor,  # [>= M, parts] float32: r's sums of squares (norm_handoff)
    hidden: int,  # r's width
    eps: float,
    *,
    logits_out: torch.Tensor | None = None,  # [M, V] float32, rows contiguous
    tokens_out: torch.Tensor | None = None,  # [M] int64: the greedy tokens too
    use_pdl: bool | None = None,
    tuning: DecodeTuning | None = None,  # its PDL and the fold's per-thread; None: the default
) -> torch.Tensor:  # [M, V] float32 logits
    """``raw`` times each row's 1 / RMS into float32 logits (``logits_out`` when given), and
    with ``tokens_out`` their argmax per row, in one launch; M at most 64 rows."""
    if raw.dim() != 2 or raw.stride(-1) != 1 or not 1 <= raw.shape[0] <= 64:
        raise ConfigError(f"head_scale takes [1-64, V] rows, contiguous; got {tuple(raw.shape)}")
    if ssq is None:
        raise ConfigError("head_scale needs ssq, the sums of squares beside the handoff's x")
    if type(hidden) is not int or hidden < 1:
        raise ConfigError(f"head_scale: hidden (r's width) must be an int >= 1, got {hidden!r}")
    m, v = raw.shape
    logits = logits_out if logits_out is not None else raw.new_empty(m, v, dtype=torch.float32)
    if logits.shape != raw.shape or logits.dtype != torch.float32 or logits.stride(-1) != 1:
        raise ConfigError(
            f"head_scale: logits_out must be [{m}, {v}] float32 with contiguous rows, got "
            f"{tuple(logits.shape)} {logits.dtype}"
        )
    sums, stride_s, n_parts, ssq_pad = ssq_args(ssq, m, raw)
    parts = cdiv(v, BLOCK_V)
    argmax = tokens_out is not None
    part_val = torch.empty(m, parts, dtype=torch.float32, device=raw.device)
    part_idx = torch.empty(m, parts, dtype=torch.int32, device=raw.device)
    _, tickets = splitk_workspace(raw.device, 1, 1)  # one ticket, zero between launches
    block_m = next_pow2(m)
    t = default_tuning(tuning)
    pdl = resolve_pdl(use_pdl, raw.device, t)
    _head_scale_kernel[(m, parts)](
        raw,
        raw.stride(0),
        logits,
        logits.stride(0),
        v,
        sums,
        stride_s,
        n_parts,
        hidden,
        float(eps),
        part_val,
        part_idx,
        part_val.stride(0),
        tokens_out if argmax else part_idx,
        tickets,
        m,
        SSQ_PAD=ssq_pad,
        ARGMAX=argmax,
        BLOCK_V=BLOCK_V,
        BLOCK_M=block_m,
        BLOCK_P=fold_block(block_m, parts, NUM_WARPS, t.argmax.per_thread),
        USE_PDL=pdl,
        num_warps=NUM_WARPS,
        **launch_options(pdl),
    )
    return logits


__all__ = ["BLOCK_V", "head_scale"]
