"""Greedy sampling inside the step: the final RMSNorm, the LM head and the argmax in one
launch; and the torch reference.

``norm_gemv`` with ``ARGMAX``: each program writes its float32 logits and the (max, first index
of max) of its ``BLOCK_N`` columns into ``part_val`` / ``part_idx`` ``[M, P]`` (``P`` =
programs: 8016 at vocab 128256 and one row, 501 at 16 rows); the last program to finish
reduces them to the first index of the largest partial (``argmax_parts.fold_argmax``), from two
rows on. Ties go to the smaller index at both levels, so the token is ``torch.argmax``'s (first
occurrence). One row, or ``DecodeTuning.argmax.fold`` off, runs the reduce as a second
launch (``_argmax_reduce_kernel``, grid ``(M,)``). Folded, it tied the two launches with a
kernel fewer from two rows; one row keeps its second launch, since its 8016 programs each
fence and take the ticket (docs/experiments.md#argmax-folding).

The float32 logits stay in their buffer for sampling at temperature > 0 and parity checks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...tuning import DecodeTuning, default_tuning
from ..launch_math import next_pow2
from ..pdl import launch_options, pdl_wait_then_trigger_short, resolve_pdl
from ..proj.norm_gemv import argmax_programs, norm_gemv, norm_gemv_reference
from .argmax_parts import parts_argmax


@triton.jit
def _argmax_reduce_kernel(
    part_val_ptr,
    part_idx_ptr,
    out_ptr,
    P,
    stride_pm,
    USE_PDL: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    row = tl.program_id(0)
    pdl_wait_then_trigger_short(USE_PDL)  # the partials are the predecessor's output
    parts_argmax(part_val_ptr, part_idx_ptr, stride_pm, row, row + 1, P, out_ptr, 1, BLOCK_P)


def lm_head_argmax_reference(
    x: torch.Tensor,  # [M, K], the residual stream after the last layer
    norm_w: torch.Tensor,  # [K], the final norm's weight
    weight: torch.Tensor,  # [vocab, K]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # (logits [M, vocab] float32, tokens [M] int64)
    logits = norm_gemv_reference(x, norm_w, weight, None, eps, torch.float32)
    return logits, logits.argmax(-1)


def lm_head_argmax(
    x: torch.Tensor,  # [M, K], M <= 64, rows contiguous
    norm_w: torch.Tensor,  # [K]
    weight: torch.Tensor,  # [vocab, K], rows contiguous
    eps: float,
    *,
    logits_out: torch.Tensor | None = None,  # [M, vocab] float32, rows contiguous
    tokens_out: torch.Tensor | None = None,  # [M] int64
    use_pdl: bool | None = None,
    blocks: tuple[int, int, int] | None = None,  # norm_gemv's (BLOCK_N, BLOCK_K, num_warps)
    ssq: torch.Tensor | None = None,  # x's sums of squares (norm_handoff): the norm from them
    tuning: DecodeTuning | None = None,  # its tiles, PDL, TMA, fold; None: the default
) -> tuple[torch.Tensor, torch.Tensor]:  # (logits [M, vocab] float32, tokens [M] int64)
    """Float32 logits of ``rmsnorm(x) @ weight.T`` and their argmax per row in one launch (two
    for one row or with ``tuning.argmax.fold`` off), into ``logits_out`` / ``tokens_out`` when
    given (a graph's static buffers)."""
    m, k = x.shape
    vocab = weight.shape[0]
    t = default_tuning(tuning)
    n_prog = argmax_programs(m, vocab, k, blocks, weight.element_size(), t.tables)
    part_val = torch.empty(m, n_prog, dtype=torch.float32, device=x.device)
    part_idx = torch.empty(m, n_prog, dtype=torch.int32, device=x.device)
    tokens = tokens_out if tokens_out is not None else x.new_empty(m, dtype=torch.int64)
    fold = m > 1 and t.argmax.fold  # one row: two launches (above)
    logits = norm_gemv(
        x,
        norm_w,
        weight,
        None,
        eps,
        torch.float32,
        argmax_parts=(part_val, part_idx),
        argmax_tokens=tokens if fold else None,
        out=logits_out,
        use_pdl=use_pdl,
        blocks=blocks,
        ssq=ssq,
        tuning=t,
    )
    if m and not fold:
        pdl = resolve_pdl(use_pdl, x.device, t)
        _argmax_reduce_kernel[(m,)](
            part_val,
            part_idx,
            tokens,
            n_prog,
            part_val.stride(0),
            USE_PDL=pdl,
            BLOCK_P=min(1024, next_pow2(n_prog)),
            num_warps=4,
            **launch_options(pdl),
        )
    return logits, tokens


__all__ = ["lm_head_argmax", "lm_head_argmax_reference"]
