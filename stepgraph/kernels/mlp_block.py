"""The second half of a decoder layer in one persistent launch: o_proj, gate-up, down.

    r1 = r + o @ Wo.T             (+ the norm handoff: xw1 = r1 * norm2_w, its sums of squares)
    a  = silu(gate) * up          gate | up = rmsnorm(r1) @ Wgu.T, from xw1 and the sums
    r2 = r1 + a @ Wd.T            (+ the handoff to the next norm, given its weight)

The three-launch path (``gemv_residual``, ``gate_up_silu``, ``gemv_residual``) pays each small
kernel's ramp and tail: at bs 8 the MLP half of a layer runs 39.4 µs on the H200 against 26 µs
for its bytes (docs/results.md, G6). Here a grid of about one program per SM takes the three
projections' tiles as one numbered list of items (``block_sync``): every o_proj tile, then
every gate-up tile, then the down tiles split by split. A gate-up tile waits for the last
o_proj tile (its norm needs whole rows); a down tile waits only for the gate-up tiles of its
own K range. A program that finishes early asks L2 for its next tile's weights and starts it as
soon as its inputs are there, so one projection's tail overlaps the next one's stream.

Given the next layer's qkv (``NextQkv``), its tiles follow down's in the same list, each
waiting on every down tile (its norm, from down's handoff, needs whole rows): that layer's
``qkv_rope`` launch goes, and a layer is its attention and this launch.

The tiles are the kernels' own (``proj_tiles.tile_for``, ``qkv_rope.qkv_tile``), and so are
the loops, the split-K reduce and the epilogues, so the block computes what the separate
launches compute, the same sums in the same order: bit for bit under the interpreter (the CPU
tests) and, on the H200, at Llama-3.2-1B's tiles in every GPU test; at Llama-3.1-8B's a few
bf16 roundings in some rows differ, data-dependent (the compiler contracts multiply-adds
differently in one kernel), the block deterministic and as accurate (docs/results.md,
H7-H8). It serves 1 to 64 rows of an unsharded model with the norm handoff into gate-up
(``fused_mlp``; one row with its own tiles, ``one_row_tiles``), behind ``STEPGRAPH_MLP_BLOCK=1``
(``=qkv`` with the next qkv; ``STEPGRAPH_MLP_BLOCK_ONE_ROW=1`` at bs 1). Measured on the
H200 it is slower than the separate launches: about a microsecond a layer at the same tiles at
best, five at the table's (every stage is one wave there, so no tail is left to overlap;
docs/results.md, H2-H4). The step keeps them, and the block stays an A/B switch.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..errors import ConfigError
from . import block_sync as bs
from .mlp_block_items import down_item, gate_up_item, o_item, qkv_item
from .mlp_block_plan import (
    PER_SM_ENV,
    PREFETCH_ENV,
    SCHEDULE_ENV,
    BlockTiles,
    NextQkv,
    block_tiles,
    grid_size,
    launch_extra,
    prefetch_lines,
    use_stride,
)
from .pdl import launch_options, pdl_wait_then_trigger_short, resolve_pdl
from .proj_tiles import block_m, check_tile, splitk_workspace, tma_descriptors


@triton.jit
def _mlp_block_kernel(
    o_ptr, r_ptr, wo_ptr, wgu_ptr, wd_ptr, n2w_ptr, nnw_ptr,
    r1_ptr, xw1_ptr, ssq1_ptr, act_ptr, r2_ptr, xw2_ptr, ssq2_ptr, ws_ptr, sync_ptr,
    wo_desc, o_desc, wgu_desc, xw1_desc, wd_desc, act_desc, wq_desc, xw2_desc,
    wq_ptr, bias_ptr, positions_ptr, slots_ptr, cos_ptr, sin_ptr, q_ptr, k_cache_ptr,
    v_cache_ptr,
    M, H, KA, INTER, eps, eps_q,
    stride_om, stride_rm, stride_hm, stride_am, stride_wo, stride_wgu, stride_wd,
    stride_s1, stride_s2, stride_wq, stride_qm, stride_cos, stride_slot,
    A_BN: tl.constexpr, A_BK: tl.constexpr, A_SPLIT: tl.constexpr, A_TMA: tl.constexpr,
    A_STAGES: tl.constexpr,
    B_BN: tl.constexpr, B_BK: tl.constexpr, B_SPLIT: tl.constexpr, B_TMA: tl.constexpr,
    B_STAGES: tl.constexpr, B_LINES: tl.constexpr,
    C_BN: tl.constexpr, C_BK: tl.constexpr, C_SPLIT: tl.constexpr, C_TMA: tl.constexpr,
    C_STAGES: tl.constexpr, C_LINES: tl.constexpr,
    QKV: tl.constexpr, D_BD: tl.constexpr, D_BK: tl.constexpr, D_SPLIT: tl.constexpr,
    D_TMA: tl.constexpr, D_STAGES: tl.constexpr, D_LINES: tl.constexpr,
    N_HEADS: tl.constexpr, N_KV: tl.constexpr, HEAD_DIM: tl.constexpr, HAS_BIAS: tl.constexpr,
    SSQ_PAD: tl.constexpr, SSQ_PAD_C: tl.constexpr, SSQ_OUT: tl.constexpr,
    STRIDE: tl.constexpr, USE_PDL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    pdl_wait_then_trigger_short(USE_PDL)
    tiles_a = tl.cdiv(H, A_BN)
    tiles_b = tl.cdiv(INTER, B_BN)
    tiles_c = tl.cdiv(H, C_BN)
    n_a = tiles_a * A_SPLIT
    n_ab = n_a + tiles_b * B_SPLIT
    n_abc = n_ab + tiles_c * C_SPLIT
    HALF: tl.constexpr = HEAD_DIM // 2
    tiles_d = (N_HEADS + 2 * N_KV) * ((HALF + D_BD - 1) // D_BD) * QKV  # 0: no qkv stage
    total = n_abc + tiles_d * D_SPLIT
    # counters: o_proj tiles done, one a down split, then (QKV) down tiles done
    a_done = sync_ptr + bs.COUNTERS
    tickets = a_done + 1 + C_SPLIT + QKV  # split-K tickets: o_proj's, gate-up's, down's, qkv's
    # split-K partials of the projections that split (mlp_block's `parts`), one after another
    ws_b = ws_ptr + tiles_a * (A_SPLIT * BLOCK_M * A_BN) * (A_SPLIT > 1)
    ws_c = ws_b + tiles_b * (B_SPLIT * 2 * BLOCK_M * B_BN) * (B_SPLIT > 1)
    ws_d = ws_c + tiles_c * (C_SPLIT * BLOCK_M * C_BN) * (C_SPLIT > 1)
    c_span = tl.cdiv(tl.cdiv(INTER, C_SPLIT), C_BK) * C_BK  # down's K per split
    item = bs.first_item(sync_ptr, STRIDE)
    while item < total:  # items in dependency order: o_proj, gate-up, down, qkv (block_sync)
        if item < n_a:
            o_item(item, o_ptr, r_ptr, wo_ptr, wo_desc, o_desc, r1_ptr, xw1_ptr, ssq1_ptr,
                   n2w_ptr, ws_ptr, tickets, a_done, M, H, KA, stride_om, stride_rm,
                   stride_hm, stride_wo, stride_s1, A_BN, A_BK, A_SPLIT, A_TMA, A_STAGES,
                   BLOCK_M)  # fmt: skip
        elif item < n_ab:
            gate_up_item(item - n_a, wgu_ptr, wgu_desc, xw1_desc, xw1_ptr, ssq1_ptr, act_ptr,
                         ws_b, tickets + tiles_a, a_done, tiles_a, c_span, M, H, INTER, eps,
                         stride_hm, stride_am, stride_wgu, stride_s1, B_BN, B_BK, B_SPLIT,
                         B_TMA, B_STAGES, B_LINES, SSQ_PAD, BLOCK_M)  # fmt: skip
        elif item < n_abc:
            down_item(item - n_ab, wd_ptr, wd_desc, act_desc, act_ptr, r1_ptr, r2_ptr, xw2_ptr,
                      ssq2_ptr, nnw_ptr, ws_c, tickets + tiles_a + tiles_b, a_done, tiles_c,
                      c_span, M, H, INTER, stride_hm, stride_am, stride_wd, stride_s2, C_BN,
                      C_BK, C_SPLIT, C_TMA, C_STAGES, C_LINES, B_BN, SSQ_OUT, QKV,
                      BLOCK_M)  # fmt: skip
        elif QKV:
            qkv_item(item - n_abc, wq_ptr, wq_desc, xw2_desc, xw2_ptr, ssq2_ptr, ws_d,
                     tickets + tiles_a + tiles_b + tiles_c, sync_ptr, a_done + 1 + C_SPLIT,
                     tiles_c,
                     bias_ptr, positions_ptr, slots_ptr, cos_ptr, sin_ptr, q_ptr, k_cache_ptr,
                     v_cache_ptr, M, H, eps_q, stride_hm, stride_wq, stride_s2, stride_qm,
                     stride_cos, stride_slot, D_BD, D_BK, D_SPLIT, D_TMA, D_STAGES, D_LINES,
                     SSQ_PAD_C, N_HEADS, N_KV, HEAD_DIM, HALF, HAS_BIAS, BLOCK_M)  # fmt: skip
        item = bs.next_item(sync_ptr, item, STRIDE)
    bs.exit_and_reset(sync_ptr, 1 + C_SPLIT + QKV, BLOCK_C)


def _check(m, ka, h, inter, o, r, wo, w_gu, wd, qkv) -> None:
    want = {"r": (m, h), "wo": (h, ka), "w_gu": (2 * inter, h), "wd": (h, inter)}
    named = [("r", r), ("wo", wo), ("w_gu", w_gu), ("wd", wd), ("o", o)]
    if qkv is not None:
        want["qkv.weight"] = (qkv.weight.shape[0], h)
        named.append(("qkv.weight", qkv.weight))
    for name, t in named:
        if name != "o" and tuple(t.shape) != want[name] or t.stride(1) != 1 or t.dtype != o.dtype:
            raise ConfigError(f"mlp_block: {name} must be {want.get(name, 'a matrix')} "
                              f"with contiguous rows in {o.dtype}, got {tuple(t.shape)} "
                              f"{t.dtype} strides {t.stride()}")  # fmt: skip


def mlp_block(
    o: torch.Tensor,  # [M, KA], 1 <= M <= 64: the attention's output rows
    r: torch.Tensor,  # [M, H]: the residual stream
    wo: torch.Tensor,  # [H, KA]
    norm2_w: torch.Tensor,  # [H], the post-attention RMSNorm's weight
    w_gu: torch.Tensor,  # [2 * I, H], gate rows then up rows
    eps: float,
    wd: torch.Tensor,  # [H, I]
    next_norm: torch.Tensor | None = None,  # [H]: the next RMSNorm's weight (the handoff out)
    *,
    qkv: NextQkv | None = None,  # the next layer's qkv too (needs next_norm: its input norm)
    use_pdl: bool | None = None,
    programs: int | None = None,  # the grid (default: one program per SM; 2 off CUDA)
    tiles: BlockTiles | None = None,  # default: block_tiles (the kernels' own tiles)
):  # -> r2 [M, H]; with next_norm (r2, xw2, ssq2) as gemv_residual(..., next_norm) returns;
    # with qkv (r2, xw2, ssq2, q [M, n_heads, head_dim]) and its K/V in the caches
    """``r1 = r + o @ wo.T``, ``a = silu_mul(rmsnorm(r1) @ w_gu.T)``, ``r2 = r1 + a @ wd.T``
    in one launch, as ``gemv_residual`` (with ``next_norm=norm2_w``), ``gate_up_silu`` (on the
    handoff) and ``gemv_residual`` (with ``next_norm``) compute them; with ``qkv``, then the
    next layer's ``qkv_rope`` on down's handoff in the same launch."""
    m, ka = o.shape
    h, inter = r.shape[1], w_gu.shape[0] // 2
    if qkv is not None and next_norm is None:
        raise ConfigError("mlp_block: qkv needs next_norm (the next layer's input norm weight)")
    _check(m, ka, h, inter, o, r, wo, w_gu, wd, qkv)
    hd = qkv.k_cache.shape[3] if qkv is not None else 2
    qkv_shape = (qkv.weight.shape[0], hd // 2) if qkv is not None else None
    t = tiles if tiles is not None else block_tiles(m, h, ka, inter, o.element_size(), qkv_shape)
    a, g, d, e = t.o, t.gate_up, t.down, t.qkv if qkv is not None else None
    if qkv is not None and e is None:
        raise ConfigError(f"mlp_block: qkv given, but the tiles have none for it: {t}")
    for name, s in zip(("gemv_residual", "gate_up_silu", "gemv_residual", "qkv_rope"),
                       (a, g, d, e)):  # fmt: skip
        if s is not None:
            check_tile(name, s, m)
    new = lambda cols, dtype=o.dtype: torch.empty(m, cols, dtype=dtype, device=o.device)  # noqa: E731
    r1, xw1, act, r2 = new(h), new(h), new(inter), new(h)
    n_kv = qkv.k_cache.shape[2] if qkv is not None else 0
    tiles = [triton.cdiv(h, a.block_n), triton.cdiv(inter, g.block_n), triton.cdiv(h, d.block_n)]
    if e is not None:
        tiles.append((qkv.n_heads + 2 * n_kv) * triton.cdiv(hd // 2, e.block_n))
    ssq1 = new(tiles[0], torch.float32)
    xw2, ssq2 = (new(h), new(tiles[2], torch.float32)) if next_norm is not None else (r2, ssq1)
    q = torch.empty(m, qkv.n_heads, hd, dtype=o.dtype, device=o.device) if qkv else r2
    bm = block_m(m)
    stages = (a, g, d, e)[: len(tiles)]
    parts = [n * s.split_k * s.block_n * bm * (1, 2, 1, 2)[i] * (s.split_k > 1)  # 2: paired
             for i, (n, s) in enumerate(zip(tiles, stages))]  # fmt: skip
    counters = 1 + d.split_k + (e is not None)
    ws, sync = splitk_workspace(o.device, sum(parts), bs.sync_slots(counters) + sum(tiles))
    stride = use_stride()
    items = sum(n * s.split_k for n, s in zip(tiles, stages))
    grid = (grid_size(o.device, items, programs, stride),)
    xs = [(o, wo), (xw1, w_gu), (act, wd)] + ([(xw2, qkv.weight)] if e is not None else [])
    descs = [tma_descriptors(s, m, x, w, s.block_n) for s, (x, w) in zip(stages, xs)]
    tma = [s.tma if dsc else 0 for s, dsc in zip(stages, descs)] + [0]
    flat = [x for dsc, (xt, wt) in zip(descs, xs) for x in (dsc or (wt, xt))]
    flat += [r2, r2] if e is None else []
    lines = [prefetch_lines(s, k, o.element_size()) for s, k in ((g, h), (d, inter))]
    lines.append(prefetch_lines(e, h, o.element_size()) if e is not None else 0)
    ex = e or d  # the qkv stage's constexprs (unused without it)
    pdl = resolve_pdl(use_pdl, o.device)
    _mlp_block_kernel[grid](
        o, r, wo, w_gu, wd, norm2_w, next_norm if next_norm is not None else norm2_w,
        r1, xw1, ssq1, act, r2, xw2, ssq2, ws, sync, *flat,
        *((qkv.weight, qkv.bias if qkv.bias is not None else qkv.weight, qkv.positions,
           qkv.slots, qkv.cos, qkv.sin, q, qkv.k_cache, qkv.v_cache) if qkv else (r2,) * 9),
        m, h, ka, inter, eps, qkv.eps if qkv else 0.0,
        o.stride(0), r.stride(0), h, inter, wo.stride(0), w_gu.stride(0), wd.stride(0),
        ssq1.stride(0), ssq2.stride(0), qkv.weight.stride(0) if qkv else 0, q.stride(0),
        qkv.cos.stride(0) if qkv else 0, qkv.k_cache.stride(1) if qkv else 0,
        A_BN=a.block_n, A_BK=a.block_k, A_SPLIT=a.split_k, A_TMA=tma[0],
        A_STAGES=a.num_stages or 3,
        B_BN=g.block_n, B_BK=g.block_k, B_SPLIT=g.split_k, B_TMA=tma[1],
        B_STAGES=g.num_stages or 3, B_LINES=lines[0],
        C_BN=d.block_n, C_BK=d.block_k, C_SPLIT=d.split_k, C_TMA=tma[2],
        C_STAGES=d.num_stages or 3, C_LINES=lines[1],
        QKV=e is not None, D_BD=ex.block_n, D_BK=ex.block_k, D_SPLIT=ex.split_k, D_TMA=tma[3],
        D_STAGES=ex.num_stages or 3, D_LINES=lines[2],
        N_HEADS=qkv.n_heads if qkv else 1, N_KV=n_kv, HEAD_DIM=hd,
        HAS_BIAS=qkv is not None and qkv.bias is not None,
        SSQ_PAD=triton.next_power_of_2(tiles[0]), SSQ_PAD_C=triton.next_power_of_2(tiles[2]),
        SSQ_OUT=next_norm is not None, STRIDE=stride, USE_PDL=pdl, BLOCK_M=bm,
        BLOCK_C=bs.reset_block(counters), num_warps=a.num_warps, **launch_options(pdl),
        **launch_extra(),
    )  # fmt: skip
    if os.environ.get("TRITON_INTERPRET") == "1":
        bs.check_fault(sync, "mlp_block")
    if qkv is not None:
        return r2, xw2, ssq2, q
    return r2 if next_norm is None else (r2, xw2, ssq2)


__all__ = [
    "PER_SM_ENV",
    "PREFETCH_ENV",
    "SCHEDULE_ENV",
    "BlockTiles",
    "NextQkv",
    "block_tiles",
    "mlp_block",
]
