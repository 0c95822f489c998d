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
- ``gemv_loop`` accumulates ``acc[m, n] = sum_k xn[m, k] w[n, k]`` in float32: the first chunk
  from the tile loaded before the wait, then a plain loop over the rest, as ``gemv.py``.
  ``xn`` is the activation rounded the way the unfused torch path rounds:
  ``norm_w * (x * inv_rms).to(dtype)``, in the model dtype. One row (``BLOCK_M == 1``, the
  case that matters) keeps x 1-D and the products in a ``[BLOCK_N, BLOCK_K]`` tile. The first
  version (x as ``[1, BLOCK_K]``, a hand-written one-tile-ahead prefetch) ran gate-up at 64% of
  copy bandwidth on the H200 where ``gemv.py`` reaches ~93%: its PTX had a layout conversion
  with barriers in every iteration and 168 registers a thread.
- Several rows (``BLOCK_M >= 16``: M padded to 16, 32 or 64, ``block_m``) take tensor cores:
  ``acc = tl.dot(x, w^T, acc)`` with ``x`` in the model dtype (float32 inputs at "ieee"
  precision, no TF32). The same prologues and epilogues serve both paths. (Folding the norm
  into the K loop lost: docs/experiments.md#the-norm-inside-the-k-loop.)
- Split-K (``k_lo``/``k_hi`` of ``gemv_loop``, ``splitk_reduce``): ``SPLIT_K`` programs per
  column tile each take one K range, store float32 partials, and the last to arrive (an atomic
  ticket per tile) sums them in split order, so the result is deterministic, runs the epilogue
  and resets the ticket. For narrow outputs (o_proj, down: N = 2048), where column tiles alone
  leave SMs idle.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

from ..launch_math import next_pow2
from .block_scales import k_scales, scaled_x

# fences are inline PTX: compiled kernels only (the interpreter has no inline asm)
FENCE = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") != "1")
# compiled, float32 -> e4m3 is the hardware's cvt.rn.satfinite (round to nearest, ties to even);
# the interpreter's cast rounds otherwise, so there the rounding is done in float32 first
E4M3_CAST = FENCE
MAX_M = 64  # batch rows one launch takes (M padded to BLOCK_M = 16, 32 or 64 for tl.dot)


ROW_RUN = tl.constexpr(8)  # one row of e4m3 weights: products summed in runs of this many


@triton.jit
def row_products(acc, wf, x):
    # one row: acc += wf * x[None, :], wf [BLOCK_N, BLOCK_K] float32. e4m3 weights (acc
    # [BLOCK_N, BLOCK_K // ROW_RUN]): each run of ROW_RUN products, all in one thread
    # (w_cols), summed there first, so the accumulator holds an eighth of the chunk's registers
    # and a thread streams twice the weights at the same occupancy: the 8B's one-row gate-up
    # went from 90% to 100% of copy bandwidth (docs/experiments.md#fp8-one-row-loads)
    p = wf * x[None, :]
    if acc.shape[1] == wf.shape[1]:
        acc = acc + p
    else:
        acc = acc + tl.sum(tl.reshape(p, (wf.shape[0], acc.shape[1], ROW_RUN)), axis=2)
    return acc


@triton.jit
def row_acc(BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, W_FP8: tl.constexpr):
    # the one-row accumulator: [BLOCK_N, BLOCK_K] float32, or with e4m3 weights one value per
    # run of ROW_RUN products (row_products)
    if W_FP8 and BLOCK_K >= ROW_RUN:
        acc = tl.zeros((BLOCK_N, BLOCK_K // ROW_RUN), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    return acc


@triton.jit
def w_cols(BLOCK_K: tl.constexpr, W_FP8: tl.constexpr, BLOCK_M: tl.constexpr):
    # The weight tile's column offsets, [BLOCK_K]. One row of x against e4m3 weights: the same
    # values, contiguous in runs of 8 only, so that each thread loads 8 weights (8
    # bytes) beside the 8 bf16 of x (16 bytes) it multiplies them by. With runs of 16 (16 bytes
    # of e4m3, Triton's widest load) the weight tile took a layout x's does not slice, and x
    # went through shared memory with barriers in every K iteration; with 8, and BLOCK_K >= 8 x
    # 32 lanes x the warps, the loop has no barrier (docs/experiments.md#fp8-one-row-loads).
    offs = tl.arange(0, BLOCK_K)
    if W_FP8 and BLOCK_M == 1:
        offs = (offs // 8) * 8 + offs % 8
    return offs


@triton.jit
def first_w_tile(w_ptrs, mask_n, k_lo, k_hi, BLOCK_K: tl.constexpr):
    # w_ptrs: [BLOCK_N, BLOCK_K] pointers at k = 0 -> the tile at k_lo (columns from k_hi on
    # read as 0), [BLOCK_N, BLOCK_K] in the weight dtype
    offs_k = k_lo + tl.arange(0, BLOCK_K)
    return tl.load(
        w_ptrs + k_lo,
        mask=mask_n[:, None] & (offs_k < k_hi)[None, :],
        other=0.0,
        eviction_policy="evict_first",
    )


@triton.jit
def gpu_fence():
    """``fence.acq_rel.gpu`` in every thread (compiled only: the interpreter runs programs one
    after another). A split-K partial stored by one thread is visible device-wide before the
    CTA's ticket is taken; the last program fences again before it reads the partials."""
    if FENCE:
        tl.inline_asm_elementwise(
            "fence.acq_rel.gpu; mov.u32 $0, $1;",
            "=r,r",
            [tl.program_id(0)],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )


@triton.jit
def splitk_reduce(
    acc1,
    acc2,
    ws_ptr,
    ticket_ptr,
    pid_n,
    pid_k,
    PAIRED: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # acc1 (and acc2 when PAIRED): this program's [BLOCK_M, BLOCK_N] float32 partials of column
    # tile pid_n. Stores them in ws [tiles, SPLIT_K, 1 or 2, BLOCK_M, BLOCK_N], takes a ticket;
    # -> (sum1, sum2, rows): the sums over the SPLIT_K partials in split order. Only the program
    # that drew the last ticket holds them (the others get zeros) and rows = BLOCK_M (else 0:
    # mask its stores with offs_m < rows); it resets the ticket for the next launch. (Masks
    # come from tl.where of the ticket: the interpreter's `&` of a block with that scalar
    # gives ints.) Ordering: every thread stores, fences (gpu scope), the CTA syncs, then one
    # atomic (acq_rel) takes the ticket; the last CTA syncs and fences before its loads, which
    # bypass L1 (.cg).
    TILE: tl.constexpr = BLOCK_M * BLOCK_N
    PARTS: tl.constexpr = 2 if PAIRED else 1
    offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    base = ws_ptr + pid_n.to(tl.int64) * (SPLIT_K * PARTS * TILE)
    tl.store(base + pid_k * (PARTS * TILE) + offs, acc1)
    if PAIRED:
        tl.store(base + pid_k * (PARTS * TILE) + TILE + offs, acc2)
    gpu_fence()
    tl.debug_barrier()  # every thread's partial is stored and fenced before the ticket
    ticket = tl.atomic_add(ticket_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
    rows = tl.where(ticket == SPLIT_K - 1, BLOCK_M, 0)
    tl.debug_barrier()
    gpu_fence()
    sum1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    sum2 = sum1
    mine = offs < rows * BLOCK_N  # [BLOCK_M, BLOCK_N]: all or nothing
    for s in tl.static_range(SPLIT_K):  # a fixed order: the sum does not depend on arrival
        part = base + s * (PARTS * TILE) + offs
        sum1 += tl.load(part, mask=mine, other=0.0, cache_modifier=".cg")
        if PAIRED:
            sum2 += tl.load(part + TILE, mask=mine, other=0.0, cache_modifier=".cg")
    tl.atomic_xchg(ticket_ptr + pid_n, 0, mask=rows > 0, sem="relaxed", scope="gpu")
    return sum1, sum2, rows


@triton.jit
def k_range(K, SPLIT_K: tl.constexpr, BLOCK_K: tl.constexpr):
    # -> (k_lo, k_hi, pid_k): this program's K range of a split-K launch (whole BLOCK_K chunks;
    # grid axis 1 is the split), or (0, K, 0)
    if SPLIT_K == 1:
        k_lo = 0
        k_hi = K
        pid_k = 0
    else:
        pid_k = tl.program_id(1)
        k_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
        k_lo = pid_k * k_split
        k_hi = tl.minimum(K, k_lo + k_split)
    return k_lo, k_hi, pid_k


@triton.jit
def row_inv_rms(
    x_ptr,
    stride_xm,
    M,
    K,
    eps,
    BLOCK_M: tl.constexpr,
    NORM_BLOCK: tl.constexpr,
):
    # -> rsqrt(mean(x[m, :K]^2) + eps) in float32: a scalar when BLOCK_M == 1, else [BLOCK_M]
    # (padded rows get rsqrt(eps))
    # (one return statement: the compiler checks every return, constexpr branches included)
    offs_k = tl.arange(0, NORM_BLOCK)
    if BLOCK_M == 1:
        ss1 = tl.zeros((NORM_BLOCK,), dtype=tl.float32)
        for k0 in range(0, K, NORM_BLOCK):
            x = tl.load(x_ptr + k0 + offs_k, mask=(k0 + offs_k) < K, other=0.0).to(tl.float32)
            ss1 += x * x
        inv_rms = tl.rsqrt(tl.sum(ss1, axis=0) / K + eps)
    else:
        offs_m = tl.arange(0, BLOCK_M)
        ss = tl.zeros((BLOCK_M, NORM_BLOCK), dtype=tl.float32)
        for k0 in range(0, K, NORM_BLOCK):
            mask = (offs_m < M)[:, None] & ((k0 + offs_k) < K)[None, :]
            x = tl.load(
                x_ptr + offs_m[:, None] * stride_xm + k0 + offs_k[None, :], mask=mask, other=0.0
            )
            xf = x.to(tl.float32)
            ss += xf * xf
        inv_rms = tl.rsqrt(tl.sum(ss, axis=1) / K + eps)
    return inv_rms


@triton.jit
def x_tile(
    x_ptr,
    nw_ptr,
    stride_xm,
    k0,
    M,
    K,
    inv_rms,
    NORM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # -> x[:, k0:k0 + BLOCK_K], normed and weighted when NORM: [BLOCK_K] float32 when
    # BLOCK_M == 1 (1-D, so that x[None, :] is a slice of the weight tile's layout: no layout
    # conversion through shared memory in the loop), else [BLOCK_M, BLOCK_K] in x's dtype
    # (the tl.dot operand)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    mask_k = offs_k < K
    if BLOCK_M == 1:
        x = tl.load(x_ptr + offs_k, mask=mask_k, other=0.0)
    else:
        offs_m = tl.arange(0, BLOCK_M)
        mask = (offs_m < M)[:, None] & mask_k[None, :]
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mask, other=0.0)
    if NORM:
        # -- as torch: (x * inv_rms) in float32, to the dtype, times the weight, to the dtype --
        nw = tl.load(nw_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        if BLOCK_M == 1:
            xn = (x.to(tl.float32) * inv_rms).to(x.dtype).to(tl.float32)
            x = (xn * nw).to(x.dtype)
        else:
            xn = (x.to(tl.float32) * inv_rms[:, None]).to(x.dtype).to(tl.float32)
            x = (xn * nw[None, :]).to(x.dtype)
    if BLOCK_M == 1:
        x = x.to(tl.float32)
    return x


@triton.jit
def mul_acc(acc, w, x, BLOCK_M: tl.constexpr):
    # BLOCK_M == 1: acc [BLOCK_N, BLOCK_K] += w * x[None, :] (one reduction after the loop);
    # else acc [BLOCK_M, BLOCK_N] += x @ w^T on tensor cores (BLOCK_M >= 16). An e4m3 w
    # (FP8 weights, scales applied by the caller after the loop) is converted to x's dtype in
    # registers, exactly
    if BLOCK_M == 1:
        acc = row_products(acc, w.to(tl.float32), x)
    elif w.dtype == tl.float8e4nv:
        if x.dtype == tl.float32:
            acc = tl.dot(x, tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)
    elif w.dtype == tl.float32:
        acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
    else:
        acc = tl.dot(x.to(w.dtype), tl.trans(w), acc)
    return acc


@triton.jit
def dot_t(acc, w, x):
    # swap-AB: acc [BLOCK_N, BLOCK_M] += w [BLOCK_N, BLOCK_K] @ x^T, the weight the MMA's A
    # operand (on Hopper from registers), float32 inputs at "ieee" (no TF32). An e4m3 w (FP8
    # weights, scales applied by the caller after the loop) is converted to x's dtype, exactly
    if w.dtype == tl.float8e4nv:
        if x.dtype == tl.float32:
            acc = tl.dot(w.to(tl.float32), tl.trans(x), acc, input_precision="ieee")
        else:
            acc = tl.dot(w.to(x.dtype), tl.trans(x), acc)
    elif w.dtype == tl.float32:
        acc = tl.dot(w, tl.trans(x), acc, input_precision="ieee")
    else:
        acc = tl.dot(w, tl.trans(x.to(w.dtype)), acc)
    return acc


@triton.jit
def quantize_rows_e4m3(x):
    # x [BLOCK_M, BLOCK_K] (bf16/fp16, one K chunk) -> (xq [BLOCK_M, BLOCK_K] e4m3, sx [BLOCK_M]
    # float32), x ~ xq * sx per row: a power-of-two scale 2^(e - 7) for a row absmax in
    # [2^e, 2^(e + 1)), so |x / sx| < 256 <= 448 and the scaling is exact; then each value
    # rounded to the nearest e4m3 (ties to even). Compiled: the hardware's cast (E4M3_CAST),
    # 1-6 us a call less than rounding in float32 at 8-64 rows (docs/experiments.md, FP8
    # weight tiles). The interpreter's own cast rounds otherwise, so there the rounding is
    # done in float32 by the magic-constant add (v + c) - c, c = 1.5 * 2^(ulp exponent + 23),
    # exact at these magnitudes, and the cast converts an e4m3 value as it is. Same values.
    # A row of zeros: sx = 2^-107, xq = 0.
    xf = x.to(tl.float32)
    amax = tl.max(tl.abs(xf), axis=1)
    e = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    e = tl.minimum(tl.maximum(e, -100), 127)
    inv = ((134 - e) << 23).to(tl.float32, bitcast=True)  # 2^(7 - e)
    sx = ((120 + e) << 23).to(tl.float32, bitcast=True)  # 2^(e - 7)
    v = xf * inv[:, None]
    if E4M3_CAST:
        xq = v.to(tl.float8e4nv)
    else:
        ev = ((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        u = tl.maximum(ev, -6) - 3  # the e4m3 ulp at v: 2^u (subnormals: 2^-9)
        c = (((u + 150) << 23) | 0x400000).to(tl.float32, bitcast=True)
        xq = ((v + c) - c).to(tl.float8e4nv)
    return xq, sx


@triton.jit
def dot_a8(acc, w, x, SWAP: tl.constexpr):
    # W8A8: w [BLOCK_N, BLOCK_K] e4m3 times x [BLOCK_M, BLOCK_K] quantized per row for this
    # chunk (quantize_rows_e4m3) on FP8 tensor cores, the chunk's float32 sums times the rows'
    # scales added to acc ([BLOCK_N, BLOCK_M] when SWAP, else [BLOCK_M, BLOCK_N]): the
    # promotion to float32 every chunk (the MMA's own accumulator keeps fewer bits)
    xq, sx = quantize_rows_e4m3(x)
    if SWAP:
        acc += tl.dot(w, tl.trans(xq)) * sx[None, :]
    else:
        acc += tl.dot(xq, tl.trans(w)) * sx[:, None]
    return acc


@triton.jit
def chunk_acc(
    a1,
    a2,
    w1,
    w2,
    x,
    s1,
    s2,
    A8: tl.constexpr,
    SWAP: tl.constexpr,
    PAIRED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    KS: tl.constexpr,
):
    # one K chunk's multiply-accumulate, as both K loops (gemv_loop, tma_tiles.tma_loop) run it:
    # A8 (W8A8) x quantized per row for this chunk, FP8 tensor cores (dot_a8); SWAP w @ x^T
    # (dot_t); else x @ w^T or one row's products (mul_acc). w2 and a2 only when PAIRED.
    # KS (e4m3 weights with block scales): x times w1's column scales s1 (w2's: s2) first
    # (block_scales.scaled_x). -> (a1, a2)
    x1 = x
    x2 = x
    if KS:
        x1 = scaled_x(x, s1, A8, BLOCK_M)
        x2 = x1
        if PAIRED:
            x2 = scaled_x(x, s2, A8, BLOCK_M)
    if A8:
        a1 = dot_a8(a1, w1, x1, SWAP)
        if PAIRED:
            a2 = dot_a8(a2, w2, x2, SWAP)
    elif SWAP:
        a1 = dot_t(a1, w1, x1)
        if PAIRED:
            a2 = dot_t(a2, w2, x2)
    else:
        a1 = mul_acc(a1, w1, x1, BLOCK_M)
        if PAIRED:
            a2 = mul_acc(a2, w2, x2, BLOCK_M)
    return a1, a2


@triton.jit
def gemv_loop(
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
    NORM: tl.constexpr,
    PAIRED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    sp1,
    sp2,
    SWAP: tl.constexpr,
    A8: tl.constexpr,
    KS: tl.constexpr,
    SCALE_BK: tl.constexpr,
):
    # w1_ptrs, w2_ptrs: [BLOCK_N, BLOCK_K] pointers at k = 0; w1, w2: their tiles at k_lo,
    # loaded before the PDL wait. Sums over k in [k_lo, k_hi) (the whole row: 0, K).
    # KS: block scales, each chunk's column scales from the scale rows at sp1 (and sp2) of
    # SCALE_BK columns a block (block_scales.k_scales).
    # SWAP (BLOCK_M >= 16, Tile.tma == 3): acc [BLOCK_N, BLOCK_M] = w @ x^T (dot_t), the weight
    # tile the MMA's register operand, transposed after the loop. A8 (e4m3 w, BLOCK_M >= 16,
    # x bf16/fp16): x quantized per row per chunk, FP8 tensor cores (dot_a8).
    # -> (acc1, acc2), [BLOCK_M, BLOCK_N] float32 each (acc2 = acc1 unless PAIRED)
    offs_k = tl.arange(0, BLOCK_K)
    if BLOCK_M == 1:
        a1 = row_acc(BLOCK_N, BLOCK_K, w1.dtype == tl.float8e4nv)
    elif SWAP:
        a1 = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        a1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    a2 = a1
    # -- the first chunk: its weight tile is already here --
    x = x_tile(x_ptr, nw_ptr, stride_xm, k_lo, M, k_hi, inv_rms, NORM, BLOCK_M, BLOCK_K)
    s1 = k_scales(sp1, k_lo, k_hi, KS, SCALE_BK, BLOCK_K)
    s2 = k_scales(sp2, k_lo, k_hi, KS, SCALE_BK, BLOCK_K)
    a1, a2 = chunk_acc(a1, a2, w1, w2, x, s1, s2, A8, SWAP, PAIRED, BLOCK_M, KS)
    # -- the rest: a plain stream of weight tiles (evict_first: never re-read this step) --
    for k0 in range(k_lo + BLOCK_K, k_hi, BLOCK_K):
        mask_w = mask_n[:, None] & ((k0 + offs_k) < k_hi)[None, :]
        w1 = tl.load(w1_ptrs + k0, mask=mask_w, other=0.0, eviction_policy="evict_first")
        if PAIRED:
            w2 = tl.load(w2_ptrs + k0, mask=mask_w, other=0.0, eviction_policy="evict_first")
        x = x_tile(x_ptr, nw_ptr, stride_xm, k0, M, k_hi, inv_rms, NORM, BLOCK_M, BLOCK_K)
        s1 = k_scales(sp1, k0, k_hi, KS, SCALE_BK, BLOCK_K)
        s2 = k_scales(sp2, k0, k_hi, KS, SCALE_BK, BLOCK_K)
        a1, a2 = chunk_acc(a1, a2, w1, w2, x, s1, s2, A8, SWAP, PAIRED, BLOCK_M, KS)
    if SWAP:
        a1 = tl.trans(a1)
        if PAIRED:
            a2 = tl.trans(a2)
    return finish_acc(a1, a2, PAIRED, BLOCK_M)


@triton.jit
def finish_acc(a1, a2, PAIRED: tl.constexpr, BLOCK_M: tl.constexpr):
    # the K loop's accumulators as the epilogues take them: one row's [BLOCK_N, BLOCK_K]
    # products (or their runs' sums: row_acc) summed to [1, BLOCK_N]; acc2 = acc1 unless PAIRED
    if BLOCK_M == 1:
        a1 = tl.sum(a1, axis=1)[None, :]  # [1, BLOCK_N]
        a2 = tl.sum(a2, axis=1)[None, :]
    if not PAIRED:
        a2 = a1
    return a1, a2


def proj_blocks(m: int, n_rows: int, k: int) -> tuple[int, int, int]:
    """``(BLOCK_N, BLOCK_K, num_warps)`` of one row (``m == 1``) for ``n_rows`` weight rows per
    launch (the paired kernels count both sets; they take ``BLOCK_N // 2`` pairs). Several rows
    take ``proj_tiles.tile_for``'s tensor-core tiles.

    One row: 8k weight elements a program (16 KB of bf16), shorter K chunks as the output
    grows, so that the 2k-wide projections keep long row segments and the wide ones more
    programs in flight (docs/experiments.md#one-row-the-gemv)."""
    if m != 1:
        raise ValueError(f"proj_blocks is the one-row rule (m = {m}); use proj_tiles.tile_for")
    block_k = 2048 if n_rows <= 2048 else 1024 if n_rows <= 4096 else 512
    block_k = max(32, min(block_k, next_pow2(k)))
    return max(1, min(8192 // block_k, next_pow2(n_rows))), block_k, 4


def norm_block(m: int, k: int) -> int:
    """Chunk of the sum-of-squares pass: the whole row up to 4k elements of ``[BLOCK_M, K]``
    (one load from L2 per program, not a loop of dependent loads)."""
    block_m = max(1, next_pow2(m))
    return max(16, min(next_pow2(k), 4096 // block_m))


__all__ = [
    "MAX_M",
    "dot_a8",
    "dot_t",
    "finish_acc",
    "first_w_tile",
    "gemv_loop",
    "gpu_fence",
    "norm_block",
    "proj_blocks",
    "quantize_rows_e4m3",
    "row_inv_rms",
    "k_range",
    "mul_acc",
    "splitk_reduce",
    "x_tile",
]
