"""The kinds of item of ``mlp_block``'s persistent launch, each one tile of a projection and its
epilogue: o_proj (``o_item``), gate-up (``gate_up_item``), down (``down_item``), the next
layer's qkv (``qkv_item``), and the K loop they share. The loops, the split-K reduce and the
epilogues are the kernels' own pieces (``gemv_tiles``, ``tma_tiles``, ``norm_handoff``,
``qkv_rope.rope_kv_out``), in the same order, so an item computes the bits its kernel's program
computes; only the waits and signals are new (``block_sync``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import block_sync as bs
from .gemv_tiles import finish_acc, mul_acc, splitk_reduce, x_tile
from .norm_handoff import residual_out, ssq_inv_rms
from .qkv_rope import rope_kv_out
from .tma_tiles import dot_t, l2_prefetch


@triton.jit
def _split(K, pid_k, SPLIT: tl.constexpr, BLOCK_K: tl.constexpr):
    # -> (k_lo, k_hi) of split pid_k: gemv_tiles.k_range's ranges, the split given
    k_span = tl.cdiv(tl.cdiv(K, SPLIT), BLOCK_K) * BLOCK_K
    k_lo = pid_k * k_span
    return k_lo, tl.minimum(K, k_lo + k_span)


@triton.jit
def _k_loop(
    w_desc, row1, row2, x_desc, w_ptr, stride_wn, offs_n, mask_n, x_ptr, stride_xm, M,
    k_lo, k_hi,
    TMA: tl.constexpr, PAIRED: tl.constexpr, STAGES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # tma_tiles.tma_loop (TMA 1, 2) and gemv_tiles.gemv_loop (0: tensor-core rows, or one row)
    # on an x that needs no norm, with this loop's own pipeline depth. -> (acc1, acc2) [BLOCK_M,
    # BLOCK_N] float32 (acc2 = acc1 unless PAIRED); row2: the second row set (PAIRED)
    offs_k = tl.arange(0, BLOCK_K)
    w1_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    w2_ptrs = w1_ptrs + (row2 - row1).to(tl.int64) * stride_wn
    if TMA == 1:
        a1 = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    elif BLOCK_M == 1:  # one row: the broadcast-multiply GEMV's products, summed after the loop
        a1 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    else:
        a1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    a2 = a1
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
        if TMA:
            w1 = w_desc.load([row1, k0])
            w2 = w1
            if PAIRED:
                w2 = w_desc.load([row2, k0])
        else:
            mask_w = mask_n[:, None] & ((k0 + offs_k) < k_hi)[None, :]
            w1 = tl.load(w1_ptrs + k0, mask=mask_w, other=0.0, eviction_policy="evict_first")
            w2 = w1
            if PAIRED:
                w2 = tl.load(w2_ptrs + k0, mask=mask_w, other=0.0, eviction_policy="evict_first")
        if TMA == 1:
            x = x_desc.load([0, k0])
            a1 = dot_t(a1, w1, x)
            if PAIRED:
                a2 = dot_t(a2, w2, x)
        else:
            x = x_tile(x_ptr, x_ptr, stride_xm, k0, M, k_hi, 1.0, False, BLOCK_M, BLOCK_K)
            a1 = mul_acc(a1, w1, x, BLOCK_M)
            if PAIRED:
                a2 = mul_acc(a2, w2, x, BLOCK_M)
    if TMA == 1:
        a1 = tl.trans(a1)
        a2 = tl.trans(a2)
    return finish_acc(a1, a2, PAIRED, BLOCK_M)


@triton.jit
def _rows_scaled(acc, scale, BLOCK_M: tl.constexpr):
    # acc [BLOCK_M, BLOCK_N] times each row's 1 / RMS (norm_handoff.ssq_inv_rms: a scalar for
    # one row), as tma_tiles.proj_loop scales the products
    if BLOCK_M == 1:
        acc = acc * scale
    else:
        acc = acc * scale[:, None]
    return acc


@triton.jit
def o_item(
    j, o_ptr, r_ptr, wo_ptr, wo_desc, o_desc, r1_ptr, xw1_ptr, ssq1_ptr, n2w_ptr, ws_ptr,
    tickets, a_done, M, H, KA, stride_om, stride_rm, stride_hm, stride_wo, stride_s1,
    BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr, TMA: tl.constexpr,
    STAGES: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    # o_proj's item j: r1 = r + o @ Wo.T and the handoff to gate-up's norm (xw1, ssq1)
    tile = j // SPLIT
    n0 = tile * BN
    offs_n = n0 + tl.arange(0, BN)
    k_lo, k_hi = _split(KA, j % SPLIT, SPLIT, BK)
    acc, _ = _k_loop(wo_desc, n0, n0, o_desc, wo_ptr, stride_wo, offs_n, offs_n < H, o_ptr,
                     stride_om, M, k_lo, k_hi, TMA, False, STAGES, BLOCK_M, BN, BK)  # fmt: skip
    rows = BLOCK_M
    if SPLIT > 1:
        acc, _, rows = splitk_reduce(acc, acc, ws_ptr, tickets, tile, j % SPLIT, False, SPLIT,
                                     BLOCK_M, BN)  # fmt: skip
    mask_m = (tl.arange(0, BLOCK_M) < M) & (tl.arange(0, BLOCK_M) < rows)
    residual_out(acc, mask_m, offs_n < H, offs_n, tile, r_ptr, stride_rm, r1_ptr, stride_hm,
                 n2w_ptr, xw1_ptr, stride_hm, ssq1_ptr, stride_s1, True, True, BLOCK_M)  # fmt: skip
    bs.signal(a_done, rows)


@triton.jit
def gate_up_item(
    j, wgu_ptr, wgu_desc, xw1_desc, xw1_ptr, ssq1_ptr, act_ptr, ws_ptr, tickets, a_done,
    tiles_a, c_span, M, H, INTER, eps, stride_hm, stride_am, stride_wgu, stride_s1,
    BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr, TMA: tl.constexpr,
    STAGES: tl.constexpr, LINES: tl.constexpr, SSQ_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    # gate-up's item j: a = silu(gate) * up of rmsnorm(r1), from the handoff, once every o_proj
    # tile is done; then the count of the down split these columns feed
    tile = j // SPLIT
    n0 = tile * BN
    offs_n = n0 + tl.arange(0, BN)
    k_lo, k_hi = _split(H, j % SPLIT, SPLIT, BK)
    l2_prefetch(wgu_ptr, stride_wgu, n0, INTER, k_lo, k_hi, BN, LINES)
    l2_prefetch(wgu_ptr, stride_wgu, n0 + INTER, 2 * INTER, k_lo, k_hi, BN, LINES)
    bs.wait_count(a_done, tiles_a, a_done - bs.COUNTERS, TMA == 1)
    gate, up = _k_loop(wgu_desc, n0, n0 + INTER, xw1_desc, wgu_ptr, stride_wgu, offs_n,
                       offs_n < INTER, xw1_ptr, stride_hm, M, k_lo, k_hi, TMA, True, STAGES,
                       BLOCK_M, BN, BK)  # fmt: skip
    scale = ssq_inv_rms(ssq1_ptr, stride_s1, M, tiles_a, H, eps, BLOCK_M, SSQ_PAD)
    gate = _rows_scaled(gate, scale, BLOCK_M)
    up = _rows_scaled(up, scale, BLOCK_M)
    rows = BLOCK_M
    if SPLIT > 1:
        gate, up, rows = splitk_reduce(gate, up, ws_ptr, tickets, tile, j % SPLIT, True, SPLIT,
                                       BLOCK_M, BN)  # fmt: skip
    # -- SiLU(gate) * up, rounded at each step as _gate_up_silu_kernel does --
    dtype = act_ptr.dtype.element_ty
    gate = gate.to(dtype).to(tl.float32)
    up = up.to(dtype).to(tl.float32)
    act = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32)
    offs_m = tl.arange(0, BLOCK_M)
    mask = ((offs_m < M) & (offs_m < rows))[:, None] & (offs_n < INTER)[None, :]
    tl.store(act_ptr + offs_m[:, None] * stride_am + offs_n[None, :], (act * up).to(dtype),
             mask=mask)  # fmt: skip
    bs.signal(a_done + 1 + n0 // c_span, rows)


@triton.jit
def down_item(
    j, wd_ptr, wd_desc, act_desc, act_ptr, r1_ptr, r2_ptr, xw2_ptr, ssq2_ptr, nnw_ptr, ws_ptr,
    tickets, a_done, tiles_c, c_span, M, H, INTER, stride_hm, stride_am, stride_wd, stride_s2,
    BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr, TMA: tl.constexpr,
    STAGES: tl.constexpr, LINES: tl.constexpr, GATE_BN: tl.constexpr, SSQ_OUT: tl.constexpr,
    QKV: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    # down's item j (split by split): r2 = r1 + a @ Wd.T (+ the handoff to the next norm), once
    # the gate-up tiles of its K range are done; with QKV the count of down tiles done (after
    # the counters of the splits) for the next layer's qkv
    split = j // tiles_c
    tile = j % tiles_c
    n0 = tile * BN
    offs_n = n0 + tl.arange(0, BN)
    k_lo, k_hi = _split(INTER, split, SPLIT, BK)
    l2_prefetch(wd_ptr, stride_wd, n0, H, k_lo, k_hi, BN, LINES)
    cols = tl.maximum(tl.minimum(c_span, INTER - split * c_span), 0)
    bs.wait_count(
        a_done + 1 + split, (cols + GATE_BN - 1) // GATE_BN, a_done - bs.COUNTERS, TMA == 1
    )
    acc, _ = _k_loop(wd_desc, n0, n0, act_desc, wd_ptr, stride_wd, offs_n, offs_n < H, act_ptr,
                     stride_am, M, k_lo, k_hi, TMA, False, STAGES, BLOCK_M, BN, BK)  # fmt: skip
    rows = BLOCK_M
    if SPLIT > 1:
        acc, _, rows = splitk_reduce(acc, acc, ws_ptr, tickets, tile, split, False, SPLIT,
                                     BLOCK_M, BN)  # fmt: skip
    mask_m = (tl.arange(0, BLOCK_M) < M) & (tl.arange(0, BLOCK_M) < rows)
    residual_out(acc, mask_m, offs_n < H, offs_n, tile, r1_ptr, stride_hm, r2_ptr, stride_hm,
                 nnw_ptr, xw2_ptr, stride_hm, ssq2_ptr, stride_s2, True, SSQ_OUT,
                 BLOCK_M)  # fmt: skip
    if QKV:
        bs.signal(a_done + 1 + SPLIT, rows)


@triton.jit
def qkv_item(
    j, wq_ptr, wq_desc, xw2_desc, xw2_ptr, ssq2_ptr, ws_ptr, tickets, sync_ptr, c_done, tiles_c,
    bias_ptr, positions_ptr, slots_ptr, cos_ptr, sin_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr,
    M, H, eps, stride_hm, stride_wq, stride_s2, stride_qm, stride_cos, stride_slot,
    BD: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr, TMA: tl.constexpr,
    STAGES: tl.constexpr, LINES: tl.constexpr, SSQ_PAD: tl.constexpr,
    N_HEADS: tl.constexpr, N_KV: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    # the next layer's qkv, item j: _qkv_rope_kernel's program (tile j // SPLIT, split j %
    # SPLIT) on down's handoff (xw2, ssq2), once every down tile is done
    D_TILES: tl.constexpr = (HALF + BD - 1) // BD
    tile = j // SPLIT
    head = tile // D_TILES  # q heads, then k heads, then v heads
    d = (tile % D_TILES) * BD + tl.arange(0, BD)
    row1 = head * HEAD_DIM + (tile % D_TILES) * BD
    N_ROWS: tl.constexpr = (N_HEADS + 2 * N_KV) * HEAD_DIM
    k_lo, k_hi = _split(H, j % SPLIT, SPLIT, BK)
    l2_prefetch(wq_ptr, stride_wq, row1, N_ROWS, k_lo, k_hi, BD, LINES)
    l2_prefetch(wq_ptr, stride_wq, row1 + HALF, N_ROWS, k_lo, k_hi, BD, LINES)
    bs.wait_count(c_done, tiles_c, sync_ptr, TMA == 1)
    acc1, acc2 = _k_loop(wq_desc, row1, row1 + HALF, xw2_desc, wq_ptr, stride_wq,
                         head * HEAD_DIM + d, d < HALF, xw2_ptr, stride_hm, M, k_lo, k_hi, TMA,
                         True, STAGES, BLOCK_M, BD, BK)  # fmt: skip
    scale = ssq_inv_rms(ssq2_ptr, stride_s2, M, tiles_c, H, eps, BLOCK_M, SSQ_PAD)
    acc1 = _rows_scaled(acc1, scale, BLOCK_M)
    acc2 = _rows_scaled(acc2, scale, BLOCK_M)
    rows = BLOCK_M
    if SPLIT > 1:
        acc1, acc2, rows = splitk_reduce(acc1, acc2, ws_ptr, tickets, tile, j % SPLIT, True,
                                         SPLIT, BLOCK_M, BD)  # fmt: skip
    mask_m = (tl.arange(0, BLOCK_M) < M) & (tl.arange(0, BLOCK_M) < rows)
    rope_kv_out(acc1, acc2, mask_m, head, d, d < HALF, bias_ptr, positions_ptr, slots_ptr,
                cos_ptr, sin_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, stride_qm, stride_cos,
                stride_slot, N_HEADS, N_KV, HEAD_DIM, HALF, HAS_BIAS, BLOCK_M)  # fmt: skip


__all__ = ["down_item", "gate_up_item", "o_item", "qkv_item"]
