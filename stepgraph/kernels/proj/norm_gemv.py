"""One GEMV kernel with an RMSNorm prologue and a residual-add or argmax epilogue, and its torch
references: the projections of the fused decode step that need no paired rows.

    norm_gemv(x, norm_w, w)        y = rmsnorm(x) @ w.T (+ bias)      lm_head (qkv: ``qkv_rope``)
    gemv_residual(x, w, residual)  y = residual + (x @ w.T)          o_proj and down
    argmax partials (ARGMAX)       (max, index) of each program's columns, for ``lm_head_argmax``,
                                   and their reduce to the tokens by the last program (FOLD)

Grid ``(cdiv(N, BLOCK_N), SPLIT_K)``; the pieces are in ``gemv_tiles``, the tiles per shape and
batch bucket in ``proj_tiles``. With ``SPLIT_K > 1`` the programs of one column tile each take
a K range and the last to finish sums the float32 partials (in split order) and runs the
epilogue. Every rounding follows the
unfused torch path: the norm as ``RMSNorm`` does it, the projection rounded to the dtype before
the residual add, the sum rounded again (``x + residual`` in the model dtype).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...tuning import DecodeTuning, default_tuning
from ..launch_math import cdiv
from ..pdl import launch_options, pdl_trigger_late, pdl_wait_then_trigger, resolve_pdl
from ..sampling.argmax_parts import fold_argmax, fold_block
from .fp8_gemv import fp8_scales, scale_launch
from .gemv_tiles import (
    k_range,
    norm_block,
    splitk_reduce,
    w_cols,
)
from .norm_handoff import check_handoff, residual_out, ssq_args
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
def _norm_gemv_kernel(
    x_ptr,
    norm_w_ptr,
    w_ptr,
    bias_ptr,
    res_ptr,
    y_ptr,
    part_val_ptr,
    part_idx_ptr,
    ws_ptr,
    ticket_ptr,
    w_desc,
    x_desc,
    ssq_ptr,
    xw_ptr,
    tok_ptr,
    s_ptr,  # W_FP8: the weight's float32 scales (per output channel, or block)
    stride_sn,  # W_FP8 == 2: between rows of block scales
    M,
    N,
    K,
    eps,
    n_parts,
    stride_xm,
    stride_wn,
    stride_rm,
    stride_ym,
    stride_pm,
    stride_sm,
    stride_xw,
    NORM: tl.constexpr,  # RMSNorm prologue (norm_w, eps)
    SSQ_PAD: tl.constexpr,  # > 0: x is r * norm_w, rows scaled by 1 / RMS from ssq (handoff)
    SSQ_OUT: tl.constexpr,  # the handoff out: ssq[:, pid_n] and xw = y * norm_w (the next's)
    HAS_BIAS: tl.constexpr,
    RESIDUAL: tl.constexpr,  # y = residual + (x @ w.T).to(dtype)
    ARGMAX: tl.constexpr,  # write (max, first index of max) of this program's columns
    FOLD: tl.constexpr,  # ARGMAX, and the last program reduces them into tok_ptr (argmax_parts)
    BLOCK_P: tl.constexpr,  # FOLD's block of partials (argmax_parts.fold_block)
    USE_PDL: tl.constexpr,
    TMA: tl.constexpr,  # Tile.tma (tma_tiles)
    PREFETCH: tl.constexpr,  # L2 lines before the wait
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
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    offs_k = w_cols(BLOCK_K, W_FP8, BLOCK_M)
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    # -- weights only before the wait: they are never written during a step --
    n0 = pid_n * BLOCK_N
    w, _ = weights_before_wait(
        w_ptr,
        stride_wn,
        w_ptrs,
        w_ptrs,
        mask_n,
        n0,
        0,
        N,
        N,
        k_lo,
        k_hi,
        TMA,
        False,
        PREFETCH,
        BLOCK_N,
        BLOCK_K,
    )
    pdl_wait_then_trigger(USE_PDL)
    acc, _ = proj_loop(  # -> [BLOCK_M, BLOCK_N] float32
        w_desc,
        n0,
        0,
        x_desc,
        w_ptrs,
        w_ptrs,
        w,
        w,
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
        False,
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
    if SPLIT_K > 1:  # the last program of this tile holds the sum; the others store nothing
        acc, _, rows = splitk_reduce(
            acc, acc, ws_ptr, ticket_ptr, pid_n, pid_k, False, SPLIT_K, BLOCK_M, BLOCK_N
        )
        mask_m = mask_m & (offs_m < rows)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    y = residual_out(
        acc,
        mask_m,
        mask_n,
        offs_n,
        pid_n,
        res_ptr,
        stride_rm,
        y_ptr,
        stride_ym,
        norm_w_ptr,
        xw_ptr,
        stride_xw,
        ssq_ptr,
        stride_sm,
        RESIDUAL,
        SSQ_OUT,
        BLOCK_M,
    )
    if ARGMAX:
        # -- over the values as stored (float32 logits: the same), masked columns at -inf --
        vals = tl.where(mask_n[None, :], y.to(tl.float32), float("-inf"))
        best = tl.max(vals, axis=1)  # [BLOCK_M]
        idx = tl.argmax(vals, axis=1, tie_break_left=True) + pid_n * BLOCK_N  # [BLOCK_M]
        tl.store(part_val_ptr + offs_m * stride_pm + pid_n, best, mask=mask_m)
        tl.store(part_idx_ptr + offs_m * stride_pm + pid_n, idx.to(tl.int32), mask=mask_m)
        if FOLD:  # the ticket after the split-K tickets [0, tiles)
            tiles = tl.num_programs(0)
            fold_argmax(
                part_val_ptr,
                part_idx_ptr,
                stride_pm,
                M,
                tiles,
                tok_ptr,
                ticket_ptr + tiles,
                BLOCK_M,
                BLOCK_P,
            )


def rmsnorm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Transformers' RMSNorm, op for op: float32, back to the dtype, times the weight."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def norm_gemv_reference(x, norm_w, weight, bias, eps, out_dtype=None) -> torch.Tensor:
    """``F.linear(rmsnorm(x), weight, bias)`` in the unfused path's order (float32 out on
    request, from the model-dtype product as cuBLAS returns it)."""
    y = torch.nn.functional.linear(rmsnorm_reference(x, norm_w, eps), weight, bias)
    return y.to(out_dtype or y.dtype)


def gemv_residual_reference(x, weight, residual) -> torch.Tensor:
    return torch.nn.functional.linear(x, weight) + residual


def _launch(
    x,
    norm_w,
    weight,
    bias,
    residual,
    y,
    parts,
    eps,
    *,
    norm,
    use_pdl,
    blocks,
    kernel,
    ssq_in=None,
    next_norm=None,
    tokens=None,
    tuning=None,
    w_scale=None,
    w_block=None,
):
    # -> (xw [M, N], the sums of squares [M, column tiles] float32) given next_norm, else None
    m, k = x.shape
    n = weight.shape[0]
    t = default_tuning(tuning)
    fp8 = fp8_scales(weight, w_scale, kernel, w_block)
    tile = (
        as_tile(blocks)
        if blocks is not None
        else tile_for(
            kernel, m, n, k, x.element_size() if fp8 else weight.element_size(), t.tables, fp8
        )
    )
    check_tile(kernel, tile, m)
    tile, s_args, scale_block = scale_launch(fp8, kernel, tile, m, x, w_scale, w_block, y)
    bm = launch_block_m(tile, m, fp8, x)
    part_val, part_idx = parts if parts is not None else (y, y)
    tiles = cdiv(n, tile.block_n)
    ws, tickets = y, y
    if tile.split_k > 1 or tokens is not None:  # tokens: one more ticket, the fold's
        elems = tiles * tile.split_k * tile.block_n * bm if tile.split_k > 1 else 0
        ws, tickets = splitk_workspace(x.device, elems, tiles + 1)
    pdl = resolve_pdl(use_pdl, x.device, t)
    descs = tma_descriptors(tile, m, x, weight, tile.block_n, t.tma, bm)
    ssq, stride_s, n_parts, ssq_pad = ssq_args(ssq_in, m, y)
    xw, out = y, None
    if next_norm is not None:
        xw = torch.empty_like(y)
        ssq = torch.empty(m, tiles, dtype=torch.float32, device=y.device)
        stride_s, out = ssq.stride(0), (xw, ssq)
        norm_w = next_norm
    _norm_gemv_kernel[(tiles, tile.split_k)](
        x,
        norm_w if norm_w is not None else weight,
        weight,
        bias if bias is not None else weight,
        residual if residual is not None else y,
        y,
        part_val,
        part_idx,
        ws,
        tickets,
        *(descs or (x, x)),
        ssq,
        xw,
        tokens if tokens is not None else y,
        *s_args,
        m,
        n,
        k,
        eps,
        n_parts,
        x.stride(0),
        weight.stride(0),
        residual.stride(0) if residual is not None else 0,
        y.stride(0),
        part_val.stride(0) if parts is not None else 0,
        stride_s,
        xw.stride(0),
        NORM=norm,
        SSQ_PAD=ssq_pad,
        SSQ_OUT=next_norm is not None,
        HAS_BIAS=bias is not None,
        RESIDUAL=residual is not None,
        ARGMAX=parts is not None,
        FOLD=tokens is not None,
        BLOCK_P=fold_block(bm, tiles, tile.num_warps, t.argmax.per_thread)
        if tokens is not None
        else 2,
        USE_PDL=pdl,
        TMA=loop_mode(tile, m, descs, bm),
        PREFETCH=prefetch_lines(
            tile.block_n,
            k,
            tile.split_k,
            tile.block_k,
            weight.element_size(),
            False,
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


def norm_gemv(
    x: torch.Tensor,  # [M, K], M <= 64, rows contiguous: the residual stream
    norm_w: torch.Tensor | None,  # [K], the RMSNorm weight; None with ssq (x = r * norm_w)
    weight: torch.Tensor,  # [N, K], rows contiguous
    bias: torch.Tensor | None = None,  # [N]
    eps: float = 1e-6,
    out_dtype: torch.dtype | None = None,
    *,
    argmax_parts: tuple[torch.Tensor, torch.Tensor] | None = None,  # [M, n_programs] f32, i32
    argmax_tokens: torch.Tensor | None = None,  # [M] int64: with argmax_parts, the tokens too
    out: torch.Tensor | None = None,  # [M, N] out_dtype, rows contiguous: written in place
    use_pdl: bool | None = None,
    blocks=None,  # a proj_tiles.Tile or (BLOCK_N, BLOCK_K, num_warps[, stages[, split_k]])
    ssq: torch.Tensor | None = None,  # r's sums of squares, x = r * norm_w (norm_handoff)
    tuning: DecodeTuning | None = None,  # its tiles, PDL, TMA, prefetch; None: the default
) -> torch.Tensor:  # [M, N], out_dtype (default x.dtype)
    """``rmsnorm(x) @ weight.T + bias`` in one launch, float32 accumulation (with ``ssq``,
    ``rmsnorm(r) @ weight.T + bias`` of the ``r`` that ``x = r * norm_w`` came from)."""
    check_handoff(norm_w, ssq, "norm_gemv", need_norm=True)
    y = out
    if y is None:
        y = torch.empty(x.shape[0], weight.shape[0], dtype=out_dtype or x.dtype, device=x.device)
    if x.shape[0]:
        _launch(
            x,
            norm_w,
            weight,
            bias,
            None,
            y,
            argmax_parts,
            eps,
            norm=ssq is None,
            use_pdl=use_pdl,
            blocks=blocks,
            kernel="lm_head" if argmax_parts is not None else "norm_gemv",
            ssq_in=ssq,
            tokens=argmax_tokens if argmax_parts is not None else None,
            tuning=tuning,
        )
    return y


def gemv_residual(
    x: torch.Tensor,  # [M, K], M <= 64, rows contiguous
    weight: torch.Tensor,  # [N, K], rows contiguous
    residual: torch.Tensor | None,  # [M, N], the residual stream; None: the projection alone
    *,
    out: torch.Tensor | None = None,  # [M, N]; may be ``residual`` itself (each program
    # reads and writes only its own columns)
    use_pdl: bool | None = None,
    blocks=None,  # as norm_gemv's
    next_norm: torch.Tensor | None = None,  # [N], the next RMSNorm's weight (norm_handoff)
    tuning: DecodeTuning | None = None,  # as norm_gemv's
    w_scale: torch.Tensor | None = None,  # float32: weight is e4m3, [N] per channel
    w_block: tuple[int, int] | None = None,  # (bn, bk): w_scale per block, [N / bn, K / bk]
):  # -> y [M, N], residual.dtype (x.dtype without one); with next_norm (y, xw, ssq)
    """``residual + x @ weight.T`` in one launch (the projection rounded to the dtype first;
    with ``w_scale``, ``weight * w_scale[:, None]`` for an e4m3 weight, in registers);
    ``residual=None``: ``x @ weight.T`` (a tensor-parallel rank's partial sum). Given
    ``next_norm``, also ``xw = y * next_norm`` (rounded, ``[M, N]``) and each row's float32 sum
    of squares of y per column tile (``ssq [M, tiles]``): the next projection's x and ``ssq``
    (``kernels/proj/norm_handoff``)."""
    if out is not None:
        y = out
    elif residual is not None:
        y = torch.empty_like(residual)
    else:
        y = x.new_empty(x.shape[0], weight.shape[0])
    handed = None
    if x.shape[0]:
        handed = _launch(
            x,
            None,
            weight,
            None,
            residual,
            y,
            None,
            0.0,
            norm=False,
            use_pdl=use_pdl,
            blocks=blocks,
            kernel="gemv_residual",
            next_norm=next_norm,
            tuning=tuning,
            w_scale=w_scale,
            w_block=w_block,
        )
    if next_norm is None:
        return y
    if handed is None:  # no rows
        handed = (torch.empty_like(y), torch.empty(0, 1, dtype=torch.float32, device=y.device))
    return (y, *handed)


def argmax_programs(m: int, n: int, k: int, blocks=None, elem_bytes: int = 2, tables=None) -> int:
    """Programs of ``norm_gemv`` for an ``[n, k]`` LM head: columns of the argmax partials."""
    tile = (
        as_tile(blocks) if blocks is not None else tile_for("lm_head", m, n, k, elem_bytes, tables)
    )
    return cdiv(n, tile.block_n)


__all__ = [
    "argmax_programs",
    "gemv_residual",
    "gemv_residual_reference",
    "norm_gemv",
    "norm_gemv_reference",
    "rmsnorm_reference",
]
