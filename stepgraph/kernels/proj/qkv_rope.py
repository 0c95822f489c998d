"""The attention's input half in one kernel: RMSNorm prologue, the fused qkv projection (+ bias),
RoPE on q and k and the write of k and v into the paged KV cache; and its torch reference.

Rotate-half RoPE pairs element ``d`` of a head with ``d + HALF``, so a program owns the *paired*
weight rows ``head * HEAD_DIM + d0 + [0, BLOCK_D)`` and ``HALF`` further (``gemv_tiles``).
Grid ``(n_heads + 2 * n_kv_heads) * cdiv(HALF, BLOCK_D)``: program ``pid`` takes head
``pid // cdiv(HALF, BLOCK_D)`` (query heads, then key heads, then value heads, as the rows of
``w_qkv`` are stacked) and its slice ``d0``. Its epilogue is ``rope_kv``'s, for those columns:
query heads rotated into ``q_out``, key heads rotated into ``k_cache`` at ``slots[m]``, value
heads copied into ``v_cache``. Roundings as the unfused CUDA path: the projection (+ bias)
rounded to the dtype, the rotation in float32 with one rounding. No ``[M, qkv]`` intermediate,
no ``rope_kv`` launch. With ``SPLIT_K > 1`` (grid axis 1) the last program of a tile to finish
sums both partials and runs the epilogue (``gemv_tiles.splitk_reduce``).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from ...errors import ConfigError
from ...tuning import DecodeTuning, default_tuning
from ..elementwise.rope_kv import rope_kv_reference
from ..launch_math import cdiv
from ..pdl import launch_options, pdl_trigger_late, pdl_wait_then_trigger, resolve_pdl
from .fp8_gemv import fp8_scales, scale_launch
from .gemv_tiles import (
    k_range,
    norm_block,
    splitk_reduce,
    w_cols,
)
from .norm_gemv import rmsnorm_reference
from .norm_handoff import check_handoff, ssq_args
from .proj_tiles import (
    Tile,
    act_e4m3,
    as_tile,
    check_tile,
    fp8_table_tile,
    launch_block_m,
    loop_mode,
    splitk_workspace,
    tile_for,
    tma_descriptors,
)
from .tma_tiles import prefetch_lines, proj_loop, weights_before_wait


@triton.jit
def rope_kv_out(
    acc1,
    acc2,
    mask_m,
    head,
    d,
    mask_n,
    bias_ptr,
    positions_ptr,
    slots_ptr,
    cos_ptr,
    sin_ptr,
    q_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    stride_qm,
    stride_cos,
    stride_slot,
    N_HEADS: tl.constexpr,
    N_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    # The epilogue of a qkv tile: acc1, acc2 [BLOCK_M, BLOCK_D] float32, the products of head
    # `head`'s rows d and d + HALF (+ bias), rounded to the dtype; value heads copied into the
    # cache at each row's slot, query and key heads rotated (rotate-half RoPE at each row's
    # position) into q_out and the key cache. Rows under mask_m, columns under mask_n.
    offs_m = tl.arange(0, BLOCK_M)
    rows1 = head * HEAD_DIM + d
    if HAS_BIAS:
        acc1 += tl.load(bias_ptr + rows1, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        acc2 += tl.load(bias_ptr + rows1 + HALF, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    dtype = q_out_ptr.dtype.element_ty
    x1 = acc1.to(dtype)  # the projection as the unfused path stores it
    x2 = acc2.to(dtype)
    slot = tl.load(slots_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)  # [BLOCK_M]
    mask = mask_m[:, None] & mask_n[None, :]
    if head >= N_HEADS + N_KV:  # -- value head: copy into the cache --
        dst = v_cache_ptr + slot[:, None] * stride_slot + (head - N_HEADS - N_KV) * HEAD_DIM
        tl.store(dst + d[None, :], x1, mask=mask)
        tl.store(dst + HALF + d[None, :], x2, mask=mask)
    else:  # -- query or key head: rotate-half RoPE at each row's position --
        pos = tl.load(positions_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
        trig = pos[:, None] * stride_cos + d[None, :]  # [BLOCK_M, BLOCK_D]
        c1 = tl.load(cos_ptr + trig, mask=mask, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + trig + HALF, mask=mask, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + trig, mask=mask, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + trig + HALF, mask=mask, other=0.0).to(tl.float32)
        x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
        o1 = (x1f * c1 - x2f * s1).to(dtype)  # rotated = cat(-x2, x1)
        o2 = (x2f * c2 + x1f * s2).to(dtype)
        if head < N_HEADS:
            dst = q_out_ptr + offs_m[:, None] * stride_qm + head * HEAD_DIM
            tl.store(dst + d[None, :], o1, mask=mask)
            tl.store(dst + HALF + d[None, :], o2, mask=mask)
        else:
            dst = k_cache_ptr + slot[:, None] * stride_slot + (head - N_HEADS) * HEAD_DIM
            tl.store(dst + d[None, :], o1, mask=mask)
            tl.store(dst + HALF + d[None, :], o2, mask=mask)


@triton.jit
def _qkv_rope_kernel(
    x_ptr,
    norm_w_ptr,
    w_ptr,
    bias_ptr,
    positions_ptr,
    slots_ptr,
    cos_ptr,
    sin_ptr,
    q_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    ws_ptr,
    ticket_ptr,
    w_desc,
    x_desc,
    ssq_ptr,
    s_ptr,  # W_FP8: the weight's float32 scales (per output channel, or block)
    stride_sn,  # W_FP8 == 2: between rows of block scales
    M,
    K,
    eps,
    n_parts,
    stride_xm,
    stride_wn,
    stride_qm,
    stride_cos,
    stride_slot,
    stride_sm,
    N_HEADS: tl.constexpr,
    N_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    NORM: tl.constexpr,
    SSQ_PAD: tl.constexpr,
    USE_PDL: tl.constexpr,
    TMA: tl.constexpr,
    PREFETCH: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NORM_BLOCK: tl.constexpr,
    SPLIT_K: tl.constexpr,
    W_FP8: tl.constexpr,  # e4m3 weight, scales at s_ptr: 1 per channel, 2 per block (proj_loop)
    A8: tl.constexpr,  # W_FP8 and x quantized to e4m3 per row per chunk (gemv_tiles.dot_a8)
    SCALE_BN: tl.constexpr,  # W_FP8 == 2: the scale blocks' rows and columns
    SCALE_BK: tl.constexpr,
):
    pid = tl.program_id(0)
    k_lo, k_hi, pid_k = k_range(K, SPLIT_K, BLOCK_K)
    D_TILES: tl.constexpr = (HALF + BLOCK_D - 1) // BLOCK_D  # BLOCK_D > HALF: one, masked
    head = pid // D_TILES  # q heads, then k heads, then v heads
    d = (pid % D_TILES) * BLOCK_D + tl.arange(0, BLOCK_D)  # [BLOCK_D]
    rows1 = head * HEAD_DIM + d  # first-half rows of the head; second half: + HALF
    offs_m = tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    mask_n = d < HALF  # all true when BLOCK_D divides HALF
    offs_k = w_cols(BLOCK_K, W_FP8, BLOCK_M)
    w1_ptrs = w_ptr + rows1[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    w2_ptrs = w1_ptrs + HALF * stride_wn
    # -- weights only before the wait (TMA, BLOCK_D > HALF: the boxes run past the half; those
    # columns are masked) --
    r1 = head * HEAD_DIM + (pid % D_TILES) * BLOCK_D  # the tile's first row
    N_ROWS: tl.constexpr = (N_HEADS + 2 * N_KV) * HEAD_DIM
    w1, w2 = weights_before_wait(
        w_ptr,
        stride_wn,
        w1_ptrs,
        w2_ptrs,
        mask_n,
        r1,
        r1 + HALF,
        N_ROWS,
        N_ROWS,
        k_lo,
        k_hi,
        TMA,
        True,
        PREFETCH,
        BLOCK_D,
        BLOCK_K,
    )
    pdl_wait_then_trigger(USE_PDL)
    acc1, acc2 = proj_loop(  # -> [BLOCK_M, BLOCK_D] float32 each
        w_desc,
        r1,
        r1 + HALF,
        x_desc,
        w1_ptrs,
        w2_ptrs,
        w1,
        w2,
        mask_n,
        x_ptr,
        norm_w_ptr,
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
        TMA,
        NORM,
        True,
        BLOCK_M,
        BLOCK_D,
        BLOCK_K,
        NORM_BLOCK,
        SSQ_PAD,
        W_FP8,
        A8,
        SCALE_BN,
        SCALE_BK,
    )
    pdl_trigger_late(USE_PDL)
    if SPLIT_K > 1:  # the last program of this tile holds the sums; the others store nothing
        acc1, acc2, rows = splitk_reduce(
            acc1, acc2, ws_ptr, ticket_ptr, pid, pid_k, True, SPLIT_K, BLOCK_M, BLOCK_D
        )
        mask_m = mask_m & (offs_m < rows)
    rope_kv_out(
        acc1,
        acc2,
        mask_m,
        head,
        d,
        mask_n,
        bias_ptr,
        positions_ptr,
        slots_ptr,
        cos_ptr,
        sin_ptr,
        q_out_ptr,
        k_cache_ptr,
        v_cache_ptr,
        stride_qm,
        stride_cos,
        stride_slot,
        N_HEADS,
        N_KV,
        HEAD_DIM,
        HALF,
        HAS_BIAS,
        BLOCK_M,
    )


def qkv_tile(
    norm: bool,
    m: int,
    n_rows: int,
    k: int,
    half: int,
    elem_bytes: int = 2,
    tables=None,
    fp8: bool = False,
) -> Tile:
    """The tile ``qkv_rope`` launches for ``m`` rows (``norm``: with the norm prologue's pass
    over x; False for an x normed already or ``r * norm_w`` with its sums of squares): the
    table's, and at one row the one-row rule halved, since it counts both halves of a pair
    (``fp8``, an e4m3 weight: a one-row tile of ``FP8_TILES`` is the kernel's own, as is)."""
    kernel = "qkv_rope" if norm else "qkv_rope_normed"
    tile = tile_for(kernel, m, n_rows, k, elem_bytes, tables, fp8)
    if m == 1 and not (fp8 and fp8_table_tile(kernel, m, n_rows, k, elem_bytes, tables)):
        tile = Tile(max(1, min(half, tile.block_n // 2)), tile.block_k, tile.num_warps)
    elif fp8 and tile.block_n > half >= 16:
        tile = dataclasses.replace(tile, block_n=half)  # one tile a half-head, not masked
    return tile


def qkv_rope_reference(
    x,
    norm_w,
    weight,
    bias,
    eps,
    positions,
    cos_table,
    sin_table,
    k_cache,
    v_cache,
    slots,
    n_heads,
) -> torch.Tensor:  # [M, n_heads, head_dim], rotated q; k, v written at ``slots``
    """RMSNorm, ``F.linear``, then ``rope_kv_reference``: the unfused ops."""
    qkv = torch.nn.functional.linear(rmsnorm_reference(x, norm_w, eps), weight, bias)
    return rope_kv_reference(
        qkv, positions, cos_table, sin_table, k_cache, v_cache, slots, n_heads
    )[0]


def qkv_rope(
    x: torch.Tensor,  # [M, K], M <= 64, rows contiguous: the residual stream
    norm_w: torch.Tensor | None,  # [K], input_layernorm's weight; None: x normed already
    weight: torch.Tensor,  # [(n_heads + 2 * n_kv) * head_dim, K], rows contiguous
    bias: torch.Tensor | None,  # [(n_heads + 2 * n_kv) * head_dim] or None
    eps: float,
    positions: torch.Tensor,  # [M] int64
    cos_table: torch.Tensor,  # [max_positions, head_dim], x's dtype, rows contiguous
    sin_table: torch.Tensor,  # [max_positions, head_dim]
    k_cache: torch.Tensor,  # [num_pages, page_size, n_kv, head_dim], contiguous
    v_cache: torch.Tensor,  # [num_pages, page_size, n_kv, head_dim], contiguous
    slots: torch.Tensor,  # [M] int64, flat slot = page * page_size + offset
    n_heads: int,
    *,
    use_pdl: bool | None = None,
    blocks=None,  # a proj_tiles.Tile or (BLOCK_D, BLOCK_K, num_warps[, num_stages])
    ssq: torch.Tensor | None = None,  # r's sums of squares, x = r * norm_w (norm_handoff)
    tuning: DecodeTuning | None = None,  # its tiles, PDL, TMA, prefetch; None: the default
    w_scale: torch.Tensor | None = None,  # float32: weight is e4m3, [rows] per channel
    w_block: tuple[int, int] | None = None,  # (bn, bk): w_scale per block, [rows / bn, K / bk]
) -> torch.Tensor:  # [M, n_heads, head_dim], rotated q
    """Norm, qkv projection, RoPE and KV write in one launch; returns q (with ``ssq``, the
    norm of the ``r`` that ``x = r * norm_w`` came from; with ``w_scale``, the projection of an
    e4m3 weight times its scales, in registers, before the bias). Slots are not bounds-checked
    on the device (padded graph rows must point at scratch slots)."""
    check_handoff(norm_w, ssq, "qkv_rope")
    fp8 = fp8_scales(weight, w_scale, "qkv_rope", w_block)
    m, k = x.shape
    n_kv, hd = k_cache.shape[2], k_cache.shape[3]
    half = hd // 2
    q = torch.empty(m, n_heads, hd, dtype=x.dtype, device=x.device)
    if m:
        n_rows = (n_heads + 2 * n_kv) * hd
        t = default_tuning(tuning)
        if blocks is None:
            elem = x.element_size() if fp8 else weight.element_size()
            tile = qkv_tile(norm_w is not None, m, n_rows, k, half, elem, t.tables, fp8)
        else:
            tile = as_tile(blocks)
        bd = check_tile("qkv_rope", tile, m).block_n
        tile, s_args, scale_block = scale_launch(
            fp8, "qkv_rope", tile, m, x, w_scale, w_block, q, half
        )
        bm = launch_block_m(tile, m, fp8, x)
        if bd & (bd - 1) or (bd < half and half % bd):
            raise ConfigError(
                f"qkv_rope: BLOCK_D={bd} must be a power of two dividing head_dim / 2 = {half} "
                "(or above it: one masked tile a head); pass other blocks (or blocks=None)"
            )
        pdl = resolve_pdl(use_pdl, x.device, t)
        tiles = (n_heads + 2 * n_kv) * cdiv(half, bd)
        ws, tickets = q, q
        if tile.split_k > 1:
            elems = tiles * tile.split_k * 2 * bm * bd
            ws, tickets = splitk_workspace(x.device, elems, tiles)
        descs = tma_descriptors(tile, m, x, weight, bd, t.tma, bm)
        sums, stride_s, n_parts, ssq_pad = ssq_args(ssq, m, q)
        _qkv_rope_kernel[(tiles, tile.split_k)](
            x,
            norm_w if norm_w is not None else weight,
            weight,
            bias if bias is not None else weight,
            positions,
            slots,
            cos_table,
            sin_table,
            q,
            k_cache,
            v_cache,
            ws,
            tickets,
            *(descs or (x, x)),
            sums,
            *s_args,
            m,
            k,
            eps,
            n_parts,
            x.stride(0),
            weight.stride(0),
            q.stride(0),
            cos_table.stride(0),
            k_cache.stride(1),
            stride_s,
            N_HEADS=n_heads,
            N_KV=n_kv,
            HEAD_DIM=hd,
            HALF=half,
            HAS_BIAS=bias is not None,
            NORM=norm_w is not None,
            SSQ_PAD=ssq_pad,
            USE_PDL=pdl,
            TMA=loop_mode(tile, m, descs, bm),
            PREFETCH=prefetch_lines(
                bd, k, tile.split_k, tile.block_k, weight.element_size(), True, t.l2_prefetch_bytes
            )
            if descs
            else 0,
            BLOCK_M=bm,
            BLOCK_D=bd,
            BLOCK_K=tile.block_k,
            NORM_BLOCK=norm_block(bm if m == 1 else m, k),
            SPLIT_K=tile.split_k,
            W_FP8=fp8,
            A8=act_e4m3(tile, m, fp8, x),
            **scale_block,
            **tile.launch(),
            **launch_options(pdl),
        )
    return q


__all__ = ["qkv_rope", "qkv_rope_reference", "qkv_tile"]
