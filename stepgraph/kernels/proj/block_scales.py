"""FP8 weights with block scales in the fused projections: a scale per ``(bn, bk)`` block of
the weight (Hugging Face's fine-grained FP8, ``weight_block_size: [128, 128]``), applied inside
the K loop.

A program of a fused kernel owns ``BLOCK_N`` weight rows (two such sets when paired: gate and
up, the two halves of a RoPE head). When each set lies inside one row block (``bn`` a multiple
of the set's rows, and the sets start on multiples of it), its scales along K are one vector
``s[k // bk]`` for the whole set, and

    sum_k x[k] * (w[n, k] * s[n // bn, k // bk]) = sum_k (x[k] * s[k // bk]) * w[n, k]

so the scale multiplies the activation chunk, not the weights: one multiply per element of x
a chunk (``scaled_x``), the weight stream untouched. The scaled chunk is float32; from two rows
it is then rounded to e4m3 per row (W8A8, ``gemv_tiles.dot_a8``), which is why 2-byte
activations run every tile from two rows as W8A8 under block scales (``block_tile``): a
product rounded back to bf16 or fp16 would lose bits, and fp16 its small values. Float32
activations stay float32 (the "ieee" dot). A program whose rows straddle two blocks cannot
take the vector: ``rows_fit`` says where, and the step runs the reference kernels there.
"""

from __future__ import annotations

import dataclasses

import triton
import triton.language as tl

from ...errors import ConfigError
from .tile_table import Tile


@triton.jit
def k_scales(sp, k0, k_hi, KS: tl.constexpr, SCALE_BK: tl.constexpr, BLOCK_K: tl.constexpr):
    # KS: -> [BLOCK_K] float32, the scale of each column k0.. of the row block whose scale row
    # starts at sp (columns from k_hi on: 0; x is 0 there too); else zeros, never read
    offs = k0 + tl.arange(0, BLOCK_K)
    if KS:
        s = tl.load(sp + offs // SCALE_BK, mask=offs < k_hi, other=0.0)
    else:
        s = tl.zeros((BLOCK_K,), dtype=tl.float32)
    return s


@triton.jit
def scaled_x(x, s, A8: tl.constexpr, BLOCK_M: tl.constexpr):
    # x times the chunk's column scales s [BLOCK_K]: one row (x [BLOCK_K] float32) and
    # W8A8 or float32 x ([BLOCK_M, BLOCK_K]) in float32; else rounded back to x's dtype
    if BLOCK_M == 1:
        y = x * s
    elif A8 or x.dtype == tl.float32:
        y = x.to(tl.float32) * s[None, :]
    else:
        y = (x.to(tl.float32) * s[None, :]).to(x.dtype)
    return y


def set_rows(kernel: str, tile: Tile, half: int | None = None) -> int:
    """Weight rows of one row set of a program of ``kernel`` with ``tile``: ``block_n``, or for
    ``qkv_rope`` (``half``: head_dim / 2) the rows of the half-head tile that are read."""
    if kernel.startswith("qkv_rope") and half is not None:
        return min(tile.block_n, half)
    return tile.block_n


def rows_fit(
    kernel: str, tile: Tile, block_rows: int, half: int | None = None, offset: int = 0
) -> bool:
    """Whether every row set of ``tile``'s programs lies inside one ``block_rows``-row scale
    block: the set's rows (a power of two) divide the block, and the sets start on multiples
    of them (qkv's half-head tiles: when they divide ``half``; a second set ``offset`` rows
    after the first, gate-up's up rows: when they divide ``offset``)."""
    rows = set_rows(kernel, tile, half)
    if block_rows % rows or offset % rows:
        return False
    return half is None or not kernel.startswith("qkv_rope") or half % rows == 0


def block_tile(tile: Tile, m: int, x_bytes: int) -> Tile:
    """The tile block scales run: from two rows with 2-byte activations, W8A8 (``a8``)."""
    if m > 1 and x_bytes == 2 and not tile.a8:
        return dataclasses.replace(tile, a8=1)
    return tile


def fit_tile(
    kernel: str,
    tile: Tile,
    m: int,
    x_bytes: int,
    block: tuple[int, int],
    half: int | None = None,
    offset: int = 0,
) -> Tile:
    """``tile`` as block scales ``block = (bn, bk)`` run it at ``m`` rows (``block_tile``), or a
    ConfigError where a program's rows would straddle two row blocks (``rows_fit``)."""
    if not rows_fit(kernel, tile, block[0], half, offset):
        raise ConfigError(
            f"{kernel}: {tile}'s programs take {set_rows(kernel, tile, half)} weight rows a "
            f"set, which do not lie inside the {block[0]}-row scale blocks; pass a tile whose "
            "block_n divides them (the decode step runs the reference kernels there)"
        )
    return block_tile(tile, m, x_bytes)


__all__ = ["block_tile", "fit_tile", "k_scales", "rows_fit", "scaled_x", "set_rows"]
