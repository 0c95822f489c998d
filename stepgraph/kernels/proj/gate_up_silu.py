"""The MLP's first half in one kernel: RMSNorm prologue, the fused gate-up projection, SiLU·mul
epilogue; and its torch reference.

    act = silu(gate) * up,   gate | up = rmsnorm(x) @ w_gate_up.T     (w_gate_up [2 * I, K])

Grid ``(cdiv(I, BLOCK_N), SPLIT_K)``: program ``pid`` owns gate rows
``[pid * BLOCK_N, +BLOCK_N)`` and the up rows ``I`` further (the *paired* stream of
``gemv_tiles.gemv_loop``), so the activation is computed where both products are: no
``[M, 2 * I]`` intermediate, no ``silu_mul`` launch.
With ``SPLIT_K > 1`` the last program of a tile to finish sums both partials (``gemv_tiles``).
Roundings as the unfused path: gate and up rounded to the dtype (the GEMM's output), ``silu``
rounded, the product rounded.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ...tuning import DecodeTuning, default_tuning
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
    act_e4m3,
    as_tile,
    check_tile,
    launch_block_m,
    loop_mode,
    splitk_workspace,
    tile_for,
    tma_descriptors,
)
from .tma_tiles import prefetch_lines, proj_loop, weights_before_wait


@triton.jit
def _gate_up_silu_kernel(
    x_ptr,
    norm_w_ptr,
    w_ptr,
    out_ptr,
    ws_ptr,
    ticket_ptr,
    w_desc,
    x_desc,
    ssq_ptr,
    s_ptr,  # W_FP8: the weight's float32 scales (per output channel, or block)
    stride_sn,  # W_FP8 == 2: between rows of block scales
    M,
    INTER,
    K,
    eps,
    n_parts,
    stride_xm,
    stride_wn,
    stride_om,
    stride_sm,
    NORM: tl.constexpr,
    SSQ_PAD: tl.constexpr,
    USE_PDL: tl.constexpr,
    TMA: tl.constexpr,
    PREFETCH: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NORM_BLOCK: tl.constexpr,
    SPLIT_K: tl.constexpr,
    W_FP8: tl.constexpr,  # e4m3 weight, scales at s_ptr: 1 per channel, 2 per block (proj_loop)
    A8: tl.constexpr,  # W_FP8 and x quantized to e4m3 per row per chunk (gemv_tiles.dot_a8)
    SCALE_BN: tl.constexpr,  # W_FP8 == 2: the scale blocks' rows and columns
    SCALE_BK: tl.constexpr,
):
    pid_n = tl.program_id(0)
    k_lo, k_hi, pid_k = k_range(K, SPLIT_K, BLOCK_K)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # gate rows; up rows are INTER further
    mask_n = offs_n < INTER
    offs_k = w_cols(BLOCK_K, W_FP8, BLOCK_M)
    g_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    u_ptrs = w_ptr + (offs_n + INTER)[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    # -- weights only before the wait (TMA: a ragged last tile's gate rows run into up rows,
    # masked at the store) --
    n0 = pid_n * BLOCK_N
    wg, wu = weights_before_wait(
        w_ptr,
        stride_wn,
        g_ptrs,
        u_ptrs,
        mask_n,
        n0,
        n0 + INTER,
        INTER,
        2 * INTER,
        k_lo,
        k_hi,
        TMA,
        True,
        PREFETCH,
        BLOCK_N,
        BLOCK_K,
    )
    pdl_wait_then_trigger(USE_PDL)
    gate, up = proj_loop(  # -> [BLOCK_M, BLOCK_N] float32 each
        w_desc,
        n0,
        n0 + INTER,
        x_desc,
        g_ptrs,
        u_ptrs,
        wg,
        wu,
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
        BLOCK_N,
        BLOCK_K,
        NORM_BLOCK,
        SSQ_PAD,
        W_FP8,
        A8,
        SCALE_BN,
        SCALE_BK,
    )
    pdl_trigger_late(USE_PDL)
    rows = BLOCK_M
    if SPLIT_K > 1:  # the last program of this tile holds the sums; the others store nothing
        gate, up, rows = splitk_reduce(
            gate, up, ws_ptr, ticket_ptr, pid_n, pid_k, True, SPLIT_K, BLOCK_M, BLOCK_N
        )
    # -- SiLU(gate) * up, rounded at each step as torch does in the model dtype --
    dtype = out_ptr.dtype.element_ty
    gate = gate.to(dtype).to(tl.float32)
    up = up.to(dtype).to(tl.float32)
    act = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32)
    mask = ((offs_m < M) & (offs_m < rows))[:, None] & mask_n[None, :]
    tl.store(
        out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], (act * up).to(dtype), mask=mask
    )


def _kernel_name(norm_w) -> str:
    """The table name: ``gate_up_silu``, or ``gate_up_silu_normed`` for an x that needs no norm
    in the loop (``norm_w`` None: the norm ran as its own kernel before,
    ``tile_table.SEPARATE_NORM``, or x is ``r * norm_w`` with ``ssq``, ``norm_handoff``)."""
    return "gate_up_silu" if norm_w is not None else "gate_up_silu_normed"


def gate_up_silu_reference(
    x: torch.Tensor,  # [M, K]
    norm_w: torch.Tensor,  # [K]
    weight: torch.Tensor,  # [2 * I, K]
    eps: float,
) -> torch.Tensor:  # [M, I]
    """RMSNorm, ``F.linear``, ``silu(gate) * up``: the unfused ops."""
    gate, up = F.linear(rmsnorm_reference(x, norm_w, eps), weight).chunk(2, dim=-1)
    return F.silu(gate) * up


def gate_up_silu(
    x: torch.Tensor,  # [M, K], M <= 64, rows contiguous: the residual stream
    norm_w: torch.Tensor | None,  # [K]; None: x is normed already (no prologue)
    weight: torch.Tensor,  # [2 * I, K], gate rows then up rows, rows contiguous
    eps: float,
    *,
    use_pdl: bool | None = None,
    blocks=None,  # a proj_tiles.Tile or (BLOCK_N pairs, BLOCK_K, num_warps[, num_stages])
    ssq: torch.Tensor | None = None,  # r's sums of squares, x = r * norm_w (norm_handoff)
    tuning: DecodeTuning | None = None,  # its tiles, PDL, TMA, prefetch; None: the default
    w_scale: torch.Tensor | None = None,  # float32: weight is e4m3, [2 * I] per channel
    w_block: tuple[int, int] | None = None,  # (bn, bk): w_scale per block, [2I / bn, K / bk]
) -> torch.Tensor:  # [M, I], x.dtype
    """``silu(gate) * up`` of ``rmsnorm(x) @ weight.T`` in one launch (with ``ssq``, of the
    ``rmsnorm(r)`` that ``x = r * norm_w`` came from; with ``w_scale``, of an e4m3 weight
    times its scales, applied in registers)."""
    check_handoff(norm_w, ssq, "gate_up_silu")
    fp8 = fp8_scales(weight, w_scale, "gate_up_silu", w_block)
    m, k = x.shape
    inter = weight.shape[0] // 2
    out = torch.empty(m, inter, dtype=x.dtype, device=x.device)
    if m:
        t = default_tuning(tuning)
        tile = (
            as_tile(blocks)
            if blocks is not None
            else tile_for(
                _kernel_name(norm_w),
                m,
                2 * inter,
                k,
                x.element_size() if fp8 else weight.element_size(),
                t.tables,
                fp8,
            )
        )
        check_tile("gate_up_silu", tile, m)
        tile, s_args, scale_block = scale_launch(
            fp8, "gate_up_silu", tile, m, x, w_scale, w_block, out, offset=inter
        )
        bm = launch_block_m(tile, m, fp8, x)
        pdl = resolve_pdl(use_pdl, x.device, t)
        tiles = cdiv(inter, tile.block_n)
        ws, tickets = out, out
        if tile.split_k > 1:
            elems = tiles * tile.split_k * 2 * bm * tile.block_n
            ws, tickets = splitk_workspace(x.device, elems, tiles)
        descs = tma_descriptors(tile, m, x, weight, tile.block_n, t.tma, bm)
        sums, stride_s, n_parts, ssq_pad = ssq_args(ssq, m, out)
        _gate_up_silu_kernel[(tiles, tile.split_k)](
            x,
            norm_w if norm_w is not None else weight,
            weight,
            out,
            ws,
            tickets,
            *(descs or (x, x)),
            sums,
            *s_args,
            m,
            inter,
            k,
            eps,
            n_parts,
            x.stride(0),
            weight.stride(0),
            out.stride(0),
            stride_s,
            NORM=norm_w is not None,
            SSQ_PAD=ssq_pad,
            USE_PDL=pdl,
            TMA=loop_mode(tile, m, descs, bm),
            PREFETCH=prefetch_lines(
                tile.block_n,
                k,
                tile.split_k,
                tile.block_k,
                weight.element_size(),
                True,
                t.l2_prefetch_bytes,
            )
            if descs
            else 0,
            BLOCK_M=bm,
            BLOCK_N=tile.block_n,
            BLOCK_K=tile.block_k,
            NORM_BLOCK=norm_block(bm if m == 1 else m, k),
            SPLIT_K=tile.split_k,
            W_FP8=fp8,
            A8=act_e4m3(tile, m, fp8, x),
            **scale_block,
            **tile.launch(),
            **launch_options(pdl),
        )
    return out


__all__ = ["gate_up_silu", "gate_up_silu_reference"]
