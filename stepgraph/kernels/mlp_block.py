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

The tiles are the three kernels' own (``proj_tiles.tile_for``), and so are the loops, the
split-K reduce and the epilogues, so the block computes what the three launches compute, the
same sums in the same order (the CPU tests check bit for bit under the interpreter). It serves
2 to 64 rows of an unsharded model with the norm handoff into gate-up (``fused_mlp``), behind
``STEPGRAPH_MLP_BLOCK=1``: not measured on a GPU yet.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..errors import ConfigError
from . import block_sync as bs
from .gemv_tiles import MAX_M
from .mlp_block_items import down_item, gate_up_item, o_item
from .pdl import launch_options, pdl_wait_then_trigger, resolve_pdl
from .proj_tiles import Tile, block_m, splitk_workspace, tile_for, tma_descriptors

PREFETCH_ENV = "STEPGRAPH_MLP_BLOCK_PREFETCH"  # bytes of L2 prefetch before a wait, per tile
PREFETCH_BYTES = 32768
SCHEDULE_ENV = "STEPGRAPH_MLP_BLOCK_SCHEDULE"  # "queue" (default) or "stride" (block_sync)
PER_SM_ENV = "STEPGRAPH_MLP_BLOCK_PER_SM"  # programs a SM (default 1; the queue takes any)


@triton.jit
def _mlp_block_kernel(
    o_ptr, r_ptr, wo_ptr, wgu_ptr, wd_ptr, n2w_ptr, nnw_ptr,
    r1_ptr, xw1_ptr, ssq1_ptr, act_ptr, r2_ptr, xw2_ptr, ssq2_ptr, ws_ptr, sync_ptr,
    wo_desc, o_desc, wgu_desc, xw1_desc, wd_desc, act_desc,
    M, H, KA, INTER, eps,
    stride_om, stride_rm, stride_hm, stride_am, stride_wo, stride_wgu, stride_wd,
    stride_s1, stride_s2,
    A_BN: tl.constexpr, A_BK: tl.constexpr, A_SPLIT: tl.constexpr, A_TMA: tl.constexpr,
    A_STAGES: tl.constexpr,
    B_BN: tl.constexpr, B_BK: tl.constexpr, B_SPLIT: tl.constexpr, B_TMA: tl.constexpr,
    B_STAGES: tl.constexpr, B_LINES: tl.constexpr,
    C_BN: tl.constexpr, C_BK: tl.constexpr, C_SPLIT: tl.constexpr, C_TMA: tl.constexpr,
    C_STAGES: tl.constexpr, C_LINES: tl.constexpr,
    SSQ_PAD: tl.constexpr, SSQ_OUT: tl.constexpr, STRIDE: tl.constexpr,
    USE_PDL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    pdl_wait_then_trigger(USE_PDL)
    tiles_a = tl.cdiv(H, A_BN)
    tiles_b = tl.cdiv(INTER, B_BN)
    tiles_c = tl.cdiv(H, C_BN)
    n_a = tiles_a * A_SPLIT
    n_ab = n_a + tiles_b * B_SPLIT
    total = n_ab + tiles_c * C_SPLIT
    a_done = sync_ptr + bs.COUNTERS  # o_proj tiles finished; then one counter per down split
    tickets = a_done + 1 + C_SPLIT  # split-K tickets: o_proj's, gate-up's, down's tiles
    # split-K partials of the projections that split (mlp_block's `parts`), one after another
    ws_b = ws_ptr + tiles_a * (A_SPLIT * BLOCK_M * A_BN) * (A_SPLIT > 1)
    ws_c = ws_b + tiles_b * (B_SPLIT * 2 * BLOCK_M * B_BN) * (B_SPLIT > 1)
    c_span = tl.cdiv(tl.cdiv(INTER, C_SPLIT), C_BK) * C_BK  # down's K per split
    item = bs.first_item(sync_ptr, STRIDE)
    while item < total:  # items in dependency order: o_proj, gate-up, down (block_sync)
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
        else:
            down_item(item - n_ab, wd_ptr, wd_desc, act_desc, act_ptr, r1_ptr, r2_ptr, xw2_ptr,
                       ssq2_ptr, nnw_ptr, ws_c, tickets + tiles_a + tiles_b, a_done, tiles_c,
                       c_span, M, H, INTER, stride_hm, stride_am, stride_wd, stride_s2, C_BN,
                       C_BK, C_SPLIT, C_TMA, C_STAGES, C_LINES, B_BN, SSQ_OUT, BLOCK_M)  # fmt: skip
        item = bs.next_item(sync_ptr, item, STRIDE)
    bs.exit_and_reset(sync_ptr, 1 + C_SPLIT, BLOCK_C)


def _stride() -> bool:
    mode = os.environ.get(SCHEDULE_ENV, "queue")
    if mode not in ("queue", "stride"):
        raise ConfigError(f"{SCHEDULE_ENV} must be 'queue' or 'stride', got {mode!r}")
    return mode == "stride"


@dataclass(frozen=True)
class BlockTiles:
    """The block's tiles: o_proj's, gate-up's (on the handoff's normed x) and down's."""

    o: Tile
    gate_up: Tile
    down: Tile


def block_tiles(m: int, h: int, ka: int, inter: int, elem_bytes: int = 2) -> BlockTiles:
    """The three kernels' own tiles at ``m`` rows (``proj_tiles.tile_for``), or a ConfigError
    naming why one launch cannot run them: rows outside 2-64, tiles of different warp counts
    (one launch has one), or gate-up tiles that straddle a down split (its counters)."""
    if not 2 <= m <= MAX_M:
        raise ConfigError(f"mlp_block serves 2 to {MAX_M} rows, got {m}")
    t = BlockTiles(
        tile_for("gemv_residual", m, h, ka, elem_bytes),
        tile_for("gate_up_silu_normed", m, 2 * inter, h, elem_bytes),
        tile_for("gemv_residual", m, h, inter, elem_bytes),
    )
    if len({t.o.num_warps, t.gate_up.num_warps, t.down.num_warps}) > 1:
        raise ConfigError(f"mlp_block: its tiles need one warp count, got {t}")
    c_span = triton.cdiv(triton.cdiv(inter, t.down.split_k), t.down.block_k) * t.down.block_k
    if c_span % t.gate_up.block_n:
        raise ConfigError(
            f"mlp_block: down's K per split ({c_span}) is not a multiple of gate-up's "
            f"{t.gate_up.block_n} columns a tile, got {t}"
        )
    return t


def _programs(device: torch.device, items: int, programs: int | None, stride: bool) -> int:
    """The grid: ``programs``, else ``$STEPGRAPH_MLP_BLOCK_PER_SM`` (default 1) a SM (two SMs
    off CUDA), at most one an item; the stride schedule's limit checked."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if (
        device.type == "cuda") else 2  # fmt: skip
    if programs is None:
        programs = sms * int(os.environ.get(PER_SM_ENV, "1"))
    p = min(items, programs)
    if p < 1:
        raise ConfigError(f"mlp_block: programs must be >= 1, got {programs}")
    if stride and p > (1 if os.environ.get("TRITON_INTERPRET") == "1" else sms):
        raise ConfigError(
            f"mlp_block: the stride schedule needs all {p} programs resident at once (at most "
            f"{sms} SMs; 1 under the interpreter, which runs programs one after another); "
            f"use {SCHEDULE_ENV}=queue or fewer programs"
        )
    return p


def mlp_block(
    o: torch.Tensor,  # [M, KA], 2 <= M <= 64: the attention's output rows
    r: torch.Tensor,  # [M, H]: the residual stream
    wo: torch.Tensor,  # [H, KA]
    norm2_w: torch.Tensor,  # [H], the post-attention RMSNorm's weight
    w_gu: torch.Tensor,  # [2 * I, H], gate rows then up rows
    eps: float,
    wd: torch.Tensor,  # [H, I]
    next_norm: torch.Tensor | None = None,  # [H]: the next RMSNorm's weight (the handoff out)
    *,
    use_pdl: bool | None = None,
    programs: int | None = None,  # the grid (default: one program per SM; 2 off CUDA)
    tiles: BlockTiles | None = None,  # default: block_tiles (the three kernels' tiles)
):  # -> r2 [M, H]; with next_norm (r2, xw2, ssq2) as gemv_residual(..., next_norm) returns
    """``r1 = r + o @ wo.T``, ``a = silu_mul(rmsnorm(r1) @ w_gu.T)``, ``r2 = r1 + a @ wd.T``
    in one launch, as ``gemv_residual`` (with ``next_norm=norm2_w``), ``gate_up_silu`` (on the
    handoff) and ``gemv_residual`` (with ``next_norm``) compute them."""
    m, ka = o.shape
    h, inter = r.shape[1], w_gu.shape[0] // 2
    want = {"r": (m, h), "wo": (h, ka), "w_gu": (2 * inter, h), "wd": (h, inter)}
    for name, t in (("r", r), ("wo", wo), ("w_gu", w_gu), ("wd", wd), ("o", o)):
        if name != "o" and tuple(t.shape) != want[name] or t.stride(1) != 1 or t.dtype != o.dtype:
            raise ConfigError(f"mlp_block: {name} must be {want.get(name, 'a matrix')} "
                              f"with contiguous rows in {o.dtype}, got {tuple(t.shape)} "
                              f"{t.dtype} strides {t.stride()}")  # fmt: skip
    t = tiles if tiles is not None else block_tiles(m, h, ka, inter, o.element_size())
    a, g, d = t.o, t.gate_up, t.down
    new = lambda cols, dtype=o.dtype: torch.empty(m, cols, dtype=dtype, device=o.device)  # noqa: E731
    r1, xw1, act, r2 = new(h), new(h), new(inter), new(h)
    tiles = (triton.cdiv(h, a.block_n), triton.cdiv(inter, g.block_n), triton.cdiv(h, d.block_n))
    ssq1 = new(tiles[0], torch.float32)
    xw2, ssq2 = (new(h), new(tiles[2], torch.float32)) if next_norm is not None else (r2, ssq1)
    bm = block_m(m)
    parts = [n * t.split_k * t.block_n * bm * (2 if t is g else 1) * (t.split_k > 1)
             for n, t in zip(tiles, (a, g, d))]  # fmt: skip
    elems = sum(parts)  # float32 split-K partials: the projections that split
    counters = 1 + d.split_k
    ws, sync = splitk_workspace(o.device, elems, bs.sync_slots(counters) + sum(tiles))
    stride = _stride()
    items = tiles[0] * a.split_k + tiles[1] * g.split_k + tiles[2] * d.split_k
    grid = (_programs(o.device, items, programs, stride),)
    descs = [tma_descriptors(tile, m, x, w, tile.block_n)
             for tile, x, w in ((a, o, wo), (g, xw1, w_gu), (d, act, wd))]  # fmt: skip
    lines = [prefetch_lines(tile, k, o.element_size()) for tile, k in ((g, h), (d, inter))]
    pdl = resolve_pdl(use_pdl, o.device)
    _mlp_block_kernel[grid](
        o, r, wo, w_gu, wd, norm2_w, next_norm if next_norm is not None else norm2_w,
        r1, xw1, ssq1, act, r2, xw2, ssq2, ws, sync,
        *(x for dsc, (xt, wt) in zip(descs, ((o, wo), (xw1, w_gu), (act, wd)))
          for x in (dsc or (wt, xt))),
        m, h, ka, inter, eps,
        o.stride(0), r.stride(0), h, inter, wo.stride(0), w_gu.stride(0), wd.stride(0),
        ssq1.stride(0), ssq2.stride(0),
        A_BN=a.block_n, A_BK=a.block_k, A_SPLIT=a.split_k, A_TMA=a.tma if descs[0] else 0,
        A_STAGES=a.num_stages or 3,
        B_BN=g.block_n, B_BK=g.block_k, B_SPLIT=g.split_k, B_TMA=g.tma if descs[1] else 0,
        B_STAGES=g.num_stages or 3, B_LINES=lines[0],
        C_BN=d.block_n, C_BK=d.block_k, C_SPLIT=d.split_k, C_TMA=d.tma if descs[2] else 0,
        C_STAGES=d.num_stages or 3, C_LINES=lines[1],
        SSQ_PAD=triton.next_power_of_2(tiles[0]), SSQ_OUT=next_norm is not None,
        STRIDE=stride, USE_PDL=pdl, BLOCK_M=bm, BLOCK_C=bs.reset_block(counters),
        num_warps=a.num_warps, **launch_options(pdl),
    )  # fmt: skip
    if os.environ.get("TRITON_INTERPRET") == "1":
        bs.check_fault(sync, "mlp_block")
    return r2 if next_norm is None else (r2, xw2, ssq2)


def prefetch_lines(tile: Tile, k: int, elem_bytes: int) -> int:
    """``LINES`` of the L2 prefetch a waiting gate-up or down tile asks for, per row set: the
    smaller of ``$STEPGRAPH_MLP_BLOCK_PREFETCH`` bytes (default 32 KB) and its K range, as a
    power of two of 128-byte lines; 0 turns it off (and the interpreter has no prefetch)."""
    budget = int(os.environ.get(PREFETCH_ENV, PREFETCH_BYTES))
    span = triton.cdiv(triton.cdiv(k, tile.split_k), tile.block_k) * tile.block_k
    lines = min(budget, tile.block_n * span * elem_bytes) // 128
    return 0 if lines < 1 else 1 << (lines.bit_length() - 1)


__all__ = ["BlockTiles", "PER_SM_ENV", "PREFETCH_ENV", "SCHEDULE_ENV", "block_tiles", "mlp_block"]
