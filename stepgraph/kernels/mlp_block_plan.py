"""What ``mlp_block`` launches: its tiles (the kernels' own, ``block_tiles``), the next layer's
qkv when the block takes it too (``NextQkv``), its grid and schedule, and its L2 prefetch.
Pure host code; the switches are read at each launch."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton

from ..errors import ConfigError
from .gemv_tiles import MAX_M
from .proj_tiles import Tile, tile_for
from .tma_tiles import l2_lines

PREFETCH_ENV = "STEPGRAPH_MLP_BLOCK_PREFETCH"  # bytes of L2 prefetch before a wait, per tile
PREFETCH_BYTES = 32768
SCHEDULE_ENV = "STEPGRAPH_MLP_BLOCK_SCHEDULE"  # "queue" (default) or "stride" (block_sync)
PER_SM_ENV = "STEPGRAPH_MLP_BLOCK_PER_SM"  # programs a SM (default 1; the queue takes any)
# registers a thread at most (unset: the compiler's choice, 252-255 at Llama-3.2-1B's tiles,
# which leaves room for one program a SM: set 224 or less for two, with PER_SM 2)
MAXNREG_ENV = "STEPGRAPH_MLP_BLOCK_MAXNREG"


def launch_extra() -> dict:
    """Launch options from the switches: ``maxnreg`` when ``$STEPGRAPH_MLP_BLOCK_MAXNREG`` is set
    (the interpreter ignores it)."""
    value = os.environ.get(MAXNREG_ENV)
    if not value or os.environ.get("TRITON_INTERPRET") == "1":
        return {}
    if not value.isdigit() or not 24 <= int(value) <= 255:
        raise ConfigError(f"{MAXNREG_ENV} must be a register count in 24-255, got {value!r}")
    return {"maxnreg": int(value)}


def use_stride() -> bool:
    mode = os.environ.get(SCHEDULE_ENV, "queue")
    if mode not in ("queue", "stride"):
        raise ConfigError(f"{SCHEDULE_ENV} must be 'queue' or 'stride', got {mode!r}")
    return mode == "stride"


@dataclass(frozen=True)
class BlockTiles:
    """The block's tiles: o_proj's, gate-up's (on the handoff's normed x), down's, and the next
    layer's qkv's (on down's handoff) when the block runs it."""

    o: Tile
    gate_up: Tile
    down: Tile
    qkv: Tile | None = None


@dataclass(frozen=True)
class NextQkv:
    """The next layer's qkv projection, RoPE and K/V write, for a block that runs them after
    down on its handoff (``qkv_rope(xw2, None, ..., ssq=ssq2)``'s arguments)."""

    weight: torch.Tensor  # [(n_heads + 2 * n_kv) * head_dim, H], rows contiguous
    bias: torch.Tensor | None  # [(n_heads + 2 * n_kv) * head_dim]
    eps: float  # the next input norm's
    positions: torch.Tensor  # [M] int64
    cos: torch.Tensor  # [max_positions, head_dim]
    sin: torch.Tensor
    k_cache: torch.Tensor  # [num_pages, page_size, n_kv, head_dim], the next layer's
    v_cache: torch.Tensor
    slots: torch.Tensor  # [M] int64
    n_heads: int


def one_row_tiles(inter: int, qkv: bool) -> BlockTiles:
    """The block's tiles at one row (a rule; H2: 53 µs a layer against the one-row kernels' 31):
    16 weight rows an item (16
    pairs for gate-up and qkv) and 8k elements a K chunk, so an item streams 64 KB in chunks
    (the one-row kernels' 4-row tiles would make 2k items a layer), and down in four splits so
    that its items start as their quarter of gate-up ends."""
    split = 4 if inter >= 4 * 512 else 1
    return BlockTiles(Tile(16, 512, 4), Tile(16, 256, 4), Tile(16, 512, 4, None, split),
                      Tile(16, 256, 4) if qkv else None)  # fmt: skip


def block_tiles(
    m: int, h: int, ka: int, inter: int, elem_bytes: int = 2, qkv: tuple[int, int] | None = None
) -> BlockTiles:
    """The kernels' own tiles at ``m`` rows (``proj_tiles.tile_for``; ``qkv``: the next layer's
    ``(weight rows, head_dim // 2)``, ``qkv_rope.qkv_tile``'s on a handed-off x; one row:
    ``one_row_tiles``), or a ConfigError naming why one launch cannot run them: rows outside
    1-64, tiles of different
    warp counts (one launch has one), gate-up tiles that straddle a down split (its counters),
    or a qkv tile that does not divide a head's half."""
    if not 1 <= m <= MAX_M:
        raise ConfigError(f"mlp_block serves 1 to {MAX_M} rows, got {m}")
    if m == 1:
        t = one_row_tiles(inter, qkv is not None)
    else:
        t = BlockTiles(
            tile_for("gemv_residual", m, h, ka, elem_bytes),
            tile_for("gate_up_silu_normed", m, 2 * inter, h, elem_bytes),
            tile_for("gemv_residual", m, h, inter, elem_bytes),
            tile_for("qkv_rope_normed", m, qkv[0], h, elem_bytes) if qkv else None,
        )
    if qkv and (t.qkv.block_n & (t.qkv.block_n - 1) or (
            t.qkv.block_n < qkv[1] and qkv[1] % t.qkv.block_n)):  # fmt: skip
        raise ConfigError(f"mlp_block: qkv's BLOCK_D must be a power of two dividing "
                          f"{qkv[1]} or above it, got {t.qkv}")  # fmt: skip
    warps = {x.num_warps for x in (t.o, t.gate_up, t.down, t.qkv) if x is not None}
    if len(warps) > 1:
        raise ConfigError(f"mlp_block: its tiles need one warp count, got {t}")
    c_span = triton.cdiv(triton.cdiv(inter, t.down.split_k), t.down.block_k) * t.down.block_k
    if c_span % t.gate_up.block_n:
        raise ConfigError(
            f"mlp_block: down's K per split ({c_span}) is not a multiple of gate-up's "
            f"{t.gate_up.block_n} columns a tile, got {t}"
        )
    return t


def grid_size(device: torch.device, items: int, programs: int | None, stride: bool) -> int:
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


def prefetch_lines(tile: Tile, k: int, elem_bytes: int) -> int:
    """``LINES`` of the L2 prefetch a waiting gate-up or down tile asks for, per row set: the
    smaller of ``$STEPGRAPH_MLP_BLOCK_PREFETCH`` bytes (default 32 KB) and its K range, as a
    power of two of 128-byte lines; 0 turns it off (and the interpreter has no prefetch)."""
    budget = int(os.environ.get(PREFETCH_ENV, PREFETCH_BYTES))
    return l2_lines(budget, tile.block_n, k, tile.split_k, tile.block_k, elem_bytes)


__all__ = [
    "MAXNREG_ENV",
    "BlockTiles",
    "PER_SM_ENV",
    "PREFETCH_ENV",
    "SCHEDULE_ENV",
    "block_tiles",
    "NextQkv",
    "grid_size",
    "launch_extra",
    "one_row_tiles",
    "prefetch_lines",
    "use_stride",
]
