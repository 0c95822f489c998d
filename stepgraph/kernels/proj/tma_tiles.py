"""The weight stream of the fused projections through TMA: host tensor descriptors, and the
swap-AB K loop (``acc[BLOCK_N, BLOCK_M] = w @ x^T``) that the tensor-core tiles take with
``Tile.tma``.

At 8 rows the weight stream through host tensor descriptors beat pointer loads and cuBLAS at
every 1B shape (docs/experiments.md#tma-swap-ab).

The weight rows are the MMA's M (64 of them fill a Hopper warpgroup MMA) and the batch its N
(16 to 64). Descriptor loads read zeros out of bounds: the activation's rows past ``M`` (the
padding to ``BLOCK_M``), columns past ``K``, weight rows past ``N``. A program's K range starts
and ends on ``BLOCK_K`` chunks (``gemv_tiles.k_range``), so no chunk crosses a split.

``weights_before_wait`` and ``proj_loop`` are the two halves every projection kernel runs around
its PDL wait, for the TMA loop and the pointer loop alike.

TMA needs 16-byte aligned bases and row strides (``tma_ready``); anything else, the interpreter
aside, takes the pointer loop of ``gemv_tiles`` with the same tile; so does every tile where
``DecodeTuning.tma`` is off (``STEPGRAPH_TMA=0``).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..launch_math import cdiv
from ..pdl import hopper_or_later
from .block_scales import k_scales
from .gemv_tiles import (
    FENCE,
    chunk_acc,
    dot_t,
    first_w_tile,
    gemv_loop,
    row_inv_rms,
    x_tile,
)
from .norm_handoff import ssq_inv_rms

try:  # Triton >= 3.4
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: tma_ready() is False
    TensorDescriptor = None

MAX_BOX = 256  # elements per dimension of one TMA box
# Bytes a program asks L2 for before the PDL wait (``DecodeTuning.l2_prefetch_bytes``): 16 KB
# (of both row sets when paired; 0 turns it off). Behind the late trigger the next kernel
# launches during its predecessor's split-K reduce and epilogue, and its programs' first lines
# then come from L2 (docs/experiments.md#l2-prefetch).
PREFETCH_BYTES = 16384


def tma_ready(*tensors: torch.Tensor) -> bool:
    """Whether every tensor can back a TMA descriptor: 2-D, last dimension contiguous, base and
    row stride 16-byte aligned, on a Hopper-or-later GPU (or under ``TRITON_INTERPRET=1``).
    ``DecodeTuning.tma`` is checked before it (``proj_tiles.tma_descriptors``)."""
    if TensorDescriptor is None:
        return False
    interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
    for t in tensors:
        if t.dim() != 2 or t.stride(1) != 1 or t.shape[0] == 0:
            return False
        if t.data_ptr() % 16 or (t.stride(0) * t.element_size()) % 16:
            return False
        if not interpret and (t.device.type != "cuda" or not hopper_or_later(t.device.index or 0)):
            return False
    return True


def descriptor(t: torch.Tensor, rows: int, cols: int):
    """A host descriptor of the 2-D tensor ``t`` whose box is ``[rows, cols]``."""
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [rows, cols])


def box_fits(block_n: int, block_k: int, bm: int) -> bool:
    """Whether a tile's boxes (weight ``[block_n, block_k]``, activation ``[bm, block_k]``) are
    TMA boxes: powers of two, at most 256 a side."""
    sides = (block_n, block_k, bm)
    return all(0 < s <= MAX_BOX and s & (s - 1) == 0 for s in sides)


@triton.jit
def l2_prefetch(
    w_ptr,
    stride_wn,
    row0,
    n_rows,
    k_lo,
    k_hi,
    BLOCK_N: tl.constexpr,
    LINES: tl.constexpr,
):
    # Before the PDL wait: ask L2 for the first LINES 128-byte lines of this program's weight
    # rows [row0, row0 + BLOCK_N) from k_lo, chunk by chunk across the rows (the order the K
    # loop reads them), rows past n_rows and columns past k_hi clamped to the last valid one.
    # Fire and forget: nothing is held, so the waiting program takes no registers for it.
    # (Compiled only: the interpreter has no inline asm.)
    if FENCE and LINES > 0:
        ELEM: tl.constexpr = w_ptr.dtype.element_ty.primitive_bitwidth // 8
        per_row = tl.maximum((k_hi - k_lo) * ELEM // 128, 1)
        idx = tl.arange(0, LINES)
        r = tl.minimum(row0 + idx % BLOCK_N, n_rows - 1)
        c = tl.minimum(idx // BLOCK_N, per_row - 1)
        ptrs = w_ptr + r.to(tl.int64) * stride_wn + k_lo + c * (128 // ELEM)
        tl.inline_asm_elementwise(
            "prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;",
            "=r,l",
            [ptrs],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )


@triton.jit
def tma_x_tile(x_desc, nw_ptr, k0, K, inv_rms, NORM: tl.constexpr, BLOCK_K: tl.constexpr):
    # -> x[:, k0:k0 + BLOCK_K] ([BLOCK_M, BLOCK_K], x's dtype; zeros past M and K), normed and
    # weighted when NORM with the roundings of gemv_tiles.x_tile
    x = x_desc.load([0, k0])
    if NORM:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        nw = tl.load(nw_ptr + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
        xn = (x.to(tl.float32) * inv_rms[:, None]).to(x.dtype).to(tl.float32)
        x = (xn * nw[None, :]).to(x.dtype)
    return x


@triton.jit
def tma_loop(
    w_desc,
    row1,
    row2,
    x_desc,
    x_ptr,
    nw_ptr,
    stride_xm,
    M,
    K,
    k_lo,
    k_hi,
    inv_rms,
    NORM: tl.constexpr,
    PAIRED: tl.constexpr,
    SWAP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    sp1,
    sp2,
    A8: tl.constexpr,
    KS: tl.constexpr,
    SCALE_BK: tl.constexpr,
):
    # gemv_tiles.gemv_loop with the weight through its descriptor, every load inside the loop
    # (the software pipeliner keeps num_stages of them in flight; a tile loaded into registers
    # before the loop was slower: docs/experiments.md#tma-swap-ab). SWAP: acc [BLOCK_N, BLOCK_M] =
    # w @ x^T with x through its descriptor (Tile.tma == 1); else acc [BLOCK_M, BLOCK_N] =
    # x @ w^T with x from pointers, normed in registers: the MMA's register operand
    # (Tile.tma == 2). -> (acc1, acc2), [BLOCK_M, BLOCK_N] float32 (acc2 = acc1 unless PAIRED)
    if SWAP:
        a1 = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        a1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    a2 = a1
    for k0 in range(k_lo, k_hi, BLOCK_K):
        w1 = w_desc.load([row1, k0])
        w2 = w1  # read only when PAIRED
        if PAIRED:
            w2 = w_desc.load([row2, k0])
        if SWAP:
            x = tma_x_tile(x_desc, nw_ptr, k0, K, inv_rms, NORM, BLOCK_K)
        else:
            x = x_tile(x_ptr, nw_ptr, stride_xm, k0, M, k_hi, inv_rms, NORM, BLOCK_M, BLOCK_K)
        s1 = k_scales(sp1, k0, k_hi, KS, SCALE_BK, BLOCK_K)
        s2 = k_scales(sp2, k0, k_hi, KS, SCALE_BK, BLOCK_K)
        a1, a2 = chunk_acc(a1, a2, w1, w2, x, s1, s2, A8, SWAP, PAIRED, BLOCK_M, KS)
    if SWAP:
        a1 = tl.trans(a1)
        if PAIRED:
            a2 = tl.trans(a2)
    if not PAIRED:
        a2 = a1
    return a1, a2


@triton.jit
def weights_before_wait(
    w_ptr,
    stride_wn,
    w1_ptrs,
    w2_ptrs,
    mask_n,
    row1,
    row2,
    n1,
    n2,
    k_lo,
    k_hi,
    TMA: tl.constexpr,
    PAIRED: tl.constexpr,
    PREFETCH: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # The part of every projection kernel before the PDL wait: weights only (never written
    # during a step). Pointer loop: the first tile at k_lo of rows w1_ptrs (and w2_ptrs),
    # held in registers -> (w1, w2). TMA tiles: the L2 prefetch of rows [row1, +BLOCK_N) (and
    # row2's) when PREFETCH lines are asked for, rows past n1 (n2) clamped; nothing held (the
    # returned zero tiles are never read: tma_loop loads its own). TMA 3 (swap-AB through
    # pointers) holds the first tile as the pointer loop does.
    if TMA % 3 != 0:
        l2_prefetch(w_ptr, stride_wn, row1, n1, k_lo, k_hi, BLOCK_N, PREFETCH)
        if PAIRED:
            l2_prefetch(w_ptr, stride_wn, row2, n2, k_lo, k_hi, BLOCK_N, PREFETCH)
        w1 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.int8)  # never read (any weight dtype)
        w2 = w1
    else:
        w1 = first_w_tile(w1_ptrs, mask_n, k_lo, k_hi, BLOCK_K)
        w2 = w1
        if PAIRED:
            w2 = first_w_tile(w2_ptrs, mask_n, k_lo, k_hi, BLOCK_K)
    return w1, w2


@triton.jit
def proj_loop(
    w_desc,
    row1,
    row2,
    x_desc,
    w1_ptrs,
    w2_ptrs,
    w1,
    w2,
    mask_n,
    x_ptr,
    nw_ptr,
    stride_xm,
    M,
    K,
    k_lo,
    k_hi,
    eps,
    ssq_ptr,
    stride_sm,
    n_parts,
    s_ptr,
    stride_sn,
    TMA: tl.constexpr,
    NORM: tl.constexpr,
    PAIRED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NORM_BLOCK: tl.constexpr,
    SSQ_PAD: tl.constexpr,
    W_FP8: tl.constexpr,
    A8: tl.constexpr,
    SCALE_BN: tl.constexpr,
    SCALE_BK: tl.constexpr,
):
    # The part after the wait: each row's 1 / RMS when NORM (ones for an x that needs no norm:
    # o_proj, down, or x normed by its own kernel), then the K loop through descriptors
    # (tma_loop) or pointers (gemv_tiles.gemv_loop, from the tiles weights_before_wait held).
    # SSQ_PAD > 0 (the norm handoff, NORM False): x is r * norm_w already, rounded, and the
    # 1 / RMS of r comes from the sums of squares its writer left (norm_handoff.ssq_inv_rms),
    # a scale of each row of the products after the loop: the loop is a normed x's.
    # W_FP8: the weight is e4m3 (any loop: converted to x's dtype in registers, exactly) with
    # float32 scales at s_ptr. 1 (W_CHANNEL): a scale per output channel, applied to the sums
    # of rows row1.. (and row2..) after the loop. 2 (W_BLOCK): a scale per (SCALE_BN,
    # SCALE_BK) block, stride_sn between block rows, applied to x chunk by chunk inside the
    # loop (block_scales; each row set inside one block: block_scales.rows_fit). TMA 3: the
    # pointer loop swap-AB (gemv_loop's SWAP). A8 (e4m3 weights, bf16/fp16 x, BLOCK_M >= 16):
    # W8A8, x quantized per row per chunk (dot_a8).
    # -> (acc1, acc2), [BLOCK_M, BLOCK_N] float32 (acc2 = acc1 unless PAIRED)
    if NORM:
        inv_rms = row_inv_rms(x_ptr, stride_xm, M, K, eps, BLOCK_M, NORM_BLOCK)  # [BLOCK_M]
    else:
        inv_rms = tl.full((BLOCK_M,), 1.0, dtype=tl.float32)
    KS: tl.constexpr = W_FP8 == 2
    sp1 = s_ptr + (row1 // SCALE_BN) * stride_sn  # the block rows' scales (KS only)
    sp2 = s_ptr + (row2 // SCALE_BN) * stride_sn
    if TMA % 3 != 0:
        a1, a2 = tma_loop(
            w_desc,
            row1,
            row2,
            x_desc,
            x_ptr,
            nw_ptr,
            stride_xm,
            M,
            K,
            k_lo,
            k_hi,
            inv_rms,
            NORM,
            PAIRED,
            TMA == 1,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
            sp1,
            sp2,
            A8,
            KS,
            SCALE_BK,
        )
    else:
        a1, a2 = gemv_loop(
            w1_ptrs,
            w2_ptrs,
            w1,
            w2,
            mask_n,
            x_ptr,
            nw_ptr,
            stride_xm,
            M,
            k_lo,
            k_hi,
            inv_rms,
            NORM,
            PAIRED,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
            sp1,
            sp2,
            TMA == 3,
            A8,
            KS,
            SCALE_BK,
        )
    if W_FP8 == 1:
        offs_s = tl.arange(0, BLOCK_N)
        a1 = a1 * tl.load(s_ptr + row1 + offs_s, mask=mask_n, other=0.0)[None, :]
        if PAIRED:
            a2 = a2 * tl.load(s_ptr + row2 + offs_s, mask=mask_n, other=0.0)[None, :]
        else:
            a2 = a1
    if SSQ_PAD > 0:
        scale = ssq_inv_rms(ssq_ptr, stride_sm, M, n_parts, K, eps, BLOCK_M, SSQ_PAD)
        if BLOCK_M == 1:
            a1 = a1 * scale
            a2 = a2 * scale
        else:
            a1 = a1 * scale[:, None]
            a2 = a2 * scale[:, None]
    return a1, a2


def prefetch_lines(
    block_n: int,
    k: int,
    split_k: int,
    block_k: int,
    elem: int,
    paired: bool,
    budget: int = PREFETCH_BYTES,
) -> int:
    """``LINES`` of ``l2_prefetch`` for one row set of a program: ``budget`` bytes
    (``DecodeTuning.l2_prefetch_bytes``, of both row sets when paired) or the program's whole
    range if smaller, as a power of two of 128-byte lines, 0 when ``budget`` is 0."""
    return l2_lines(budget // (2 if paired else 1), block_n, k, split_k, block_k, elem)


def l2_lines(budget: int, block_n: int, k: int, split_k: int, block_k: int, elem: int) -> int:
    """``budget`` bytes, or all of a program's ``block_n`` rows over its split of ``k`` if less,
    as a power of two of 128-byte lines (0 below one line): ``l2_prefetch``'s ``LINES``."""
    span = cdiv(cdiv(k, split_k), block_k) * block_k
    lines = min(budget, block_n * span * elem) // 128
    return 0 if lines < 1 else 1 << (lines.bit_length() - 1)


__all__ = [
    "PREFETCH_BYTES",
    "box_fits",
    "descriptor",
    "dot_t",
    "l2_lines",
    "l2_prefetch",
    "prefetch_lines",
    "proj_loop",
    "tma_loop",
    "tma_ready",
    "tma_x_tile",
    "weights_before_wait",
]
