"""The argmax of the LM head's per-program partials: the greedy token of each row from the
(max, first index of max) that every program of ``norm_gemv`` with ``ARGMAX`` leaves for its
columns.

``parts_argmax`` is the reduce itself, over ``[BLOCK_M, BLOCK_P]`` blocks of the partials: a
lane keeps its earlier (smaller-index) partial on a tie, and the row's first index of the
largest value wins, so the token is ``torch.argmax``'s (first occurrence) at both levels.

``fold_argmax`` runs it inside the LM head's launch: every program, after its partials are
stored, fences (gpu scope) and takes a ticket; the program that draws the last one (every
partial is stored by then) reduces all rows and resets the ticket for the next launch. So
greedy sampling costs no launch of its own (``lm_head_argmax``); the reduce reads the partials
from L2 in blocks of ``PER_THREAD`` a thread (501 a row at 16 rows; one row keeps a launch).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..launch_math import next_pow2
from ..proj.gemv_tiles import gpu_fence

# Partials one reduce step holds per thread of the launch. The reduce's registers count for the
# whole kernel: at one row a block of 8192 partials (64 a thread) slowed the LM head, the
# streaming part running at a lower occupancy (docs/experiments.md#argmax-folding).
PER_THREAD = 8  # DecodeTuning.argmax.per_thread's default
_NO_INDEX = tl.constexpr(2**31 - 1)  # a global a kernel reads: a constexpr


def fold_block(m_block: int, parts: int, num_warps: int, per_thread: int = PER_THREAD) -> int:
    """``BLOCK_P`` of the folded reduce: a power of two, at least 2, at most a row's partials
    (rounded up), and ``BLOCK_M * BLOCK_P`` at most ``PER_THREAD`` a thread of the launch."""
    cap = 1 << (max(1, per_thread * 32 * num_warps // m_block).bit_length() - 1)  # pow2 <=
    return max(2, min(next_pow2(parts), cap))


@triton.jit
def parts_argmax(
    part_val_ptr,
    part_idx_ptr,
    stride_pm,
    row0,
    M,
    P,
    out_ptr,
    BLOCK_M: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    # Rows [row0, row0 + BLOCK_M) below M: the first index of each row's largest partial of P
    # into out_ptr (int64). Loads bypass L1 (.cg): other programs wrote them in this launch.
    offs_m = row0 + tl.arange(0, BLOCK_M)
    offs_p = tl.arange(0, BLOCK_P)
    mask_m = offs_m < M
    best_val = tl.full((BLOCK_M, BLOCK_P), float("-inf"), dtype=tl.float32)
    best_idx = tl.full((BLOCK_M, BLOCK_P), _NO_INDEX, dtype=tl.int32)
    for p0 in range(0, P, BLOCK_P):
        mask = mask_m[:, None] & ((p0 + offs_p) < P)[None, :]
        at = offs_m[:, None] * stride_pm + p0 + offs_p[None, :]
        v = tl.load(part_val_ptr + at, mask=mask, other=float("-inf"), cache_modifier=".cg")
        i = tl.load(part_idx_ptr + at, mask=mask, other=_NO_INDEX, cache_modifier=".cg")
        # -- strictly greater: a lane keeps its earlier (smaller-index) partial on a tie --
        better = v > best_val
        best_val = tl.where(better, v, best_val)
        best_idx = tl.where(better, i, best_idx)
    top = tl.max(best_val, axis=1)  # [BLOCK_M]
    idx = tl.min(tl.where(best_val == top[:, None], best_idx, _NO_INDEX), axis=1)
    tl.store(out_ptr + offs_m, idx.to(tl.int64), mask=mask_m)


@triton.jit
def fold_argmax(
    part_val_ptr,
    part_idx_ptr,
    stride_pm,
    M,
    P,
    out_ptr,
    ticket_ptr,
    BLOCK_M: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    # After this program's partials are stored: its ticket; the last of the launch's programs
    # reduces every row (ticket_ptr: int32, zero between launches; reset here).
    gpu_fence()
    tl.debug_barrier()  # every thread's partials are stored and fenced before the ticket
    total = tl.num_programs(0) * tl.num_programs(1)
    ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel", scope="gpu")
    tl.debug_barrier()
    gpu_fence()
    if ticket == total - 1:
        parts_argmax(part_val_ptr, part_idx_ptr, stride_pm, 0, M, P, out_ptr, BLOCK_M, BLOCK_P)
        tl.atomic_xchg(ticket_ptr, 0, sem="relaxed", scope="gpu")


__all__ = ["PER_THREAD", "fold_argmax", "fold_block", "parts_argmax"]
