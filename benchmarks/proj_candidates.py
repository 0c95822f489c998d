"""The tiles ``proj_sweep.py`` checks and times per case: ``CANDIDATES`` (bf16, tensor-core
tiles at 8-64 rows), ``FP8_ONE_ROW`` and ``FP8_CANDIDATES`` (e4m3 weights: one-row tiles, every
case; tensor-core tiles per case).
A ``Tile`` is ``(block_n, block_k, num_warps, num_stages, split_k[, tma[, a8]])``."""

from __future__ import annotations

from stepgraph.kernels.proj.proj_tiles import Tile

T = Tile
CANDIDATES = {  # (block_n, block_k, num_warps, num_stages, split_k[, tma]); block_n: the kernel's
    # pointer tiles (among them one-chunk tiles, the program's whole K range loaded before the
    # PDL wait), then TMA tiles of both kinds (tma 1: swap-AB, x by descriptor; 2: x from
    # pointers) near the best of a plain skinny GEMM (docs/experiments.md#tma-swap-ab)
    "o_proj": [
        T(32, 128, 4, 4, 2),
        T(16, 512, 4, 1, 4),
        T(32, 512, 4, 1, 4),
        *(
            T(*t, mode)
            for mode in (1, 2)
            for t in (
                (64, 128, 4, 3, 4),
                (64, 128, 4, 3, 8),
                (64, 256, 4, 3, 4),
                (32, 128, 4, 4, 4),
            )
        ),
    ],
    "down": [
        T(32, 128, 4, 4, 4),
        T(32, 128, 4, 3, 4),
        T(16, 1024, 4, 1, 8),
        *(
            T(*t, mode)
            for mode in (1, 2)
            for t in (
                (64, 128, 4, 3, 8),
                (64, 256, 4, 3, 4),
                (64, 128, 4, 5, 4),
                (32, 128, 4, 4, 4),
            )
        ),
    ],
    "gate_up": [
        T(64, 128, 8, 4, 1),
        T(64, 128, 8, 3, 1),
        T(16, 512, 4, 1, 4),
        *(
            T(*t, mode)
            for mode in (1, 2)
            for t in (
                (32, 128, 4, 3, 1),
                (64, 128, 4, 3, 1),
                (64, 128, 8, 4, 1),
                (32, 128, 4, 5, 1),
            )
        ),
    ],
    "qkv": [
        T(32, 256, 4, 3, 4),
        T(16, 128, 4, 3, 4),
        T(32, 128, 4, 3, 4),
        T(16, 512, 4, 1, 4),
        *(
            T(*t, mode)
            for mode in (1, 2)
            for t in (
                (32, 128, 4, 3, 4),
                (32, 256, 4, 3, 4),
                (32, 128, 4, 4, 8),
                (16, 128, 4, 3, 4),
            )
        ),
    ],
    "lm_head": [
        T(256, 64, 8, 3),
        T(128, 128, 8, 3),
        T(128, 64, 4, 4),
        T(128, 128, 4, 4),
        *(
            T(*t, mode)
            for mode in (1, 2)
            for t in (
                (128, 128, 4, 3, 1),
                (256, 64, 8, 3, 1),
                (128, 64, 4, 4, 1),
                (64, 128, 4, 3, 1),
            )
        ),
    ],
    # the _normed variants (x normed by its own kernel before: tile_table.SEPARATE_NORM)
    "qkv_normed": [
        T(32, 256, 4, 3, 4),
        T(32, 128, 4, 3, 4, 1),
        T(32, 128, 4, 3, 8, 1),
        T(32, 256, 4, 3, 4, 1),
        T(32, 128, 4, 3, 4, 2),
        T(16, 128, 4, 3, 4, 1),
    ],
    "gate_up_normed": [
        T(64, 128, 8, 4, 1),
        T(32, 128, 4, 5, 1, 1),
        T(32, 128, 4, 3, 1, 1),
        T(64, 128, 4, 3, 1, 1),
        T(64, 128, 8, 4, 1, 2),
        T(32, 128, 4, 3, 2, 1),
    ],
}
# One split or two, 16-32 weight rows a program, deeper TMA pipelines: no split-K reduce tail
# for the narrow projections (docs/experiments.md#tensor-core-tiles-with-split-k)
_FEW_SPLIT_TILES = {
    "o_proj": [
        (16, 128, 4, 6, 1, 1),
        (16, 256, 4, 4, 1, 1),
        (16, 128, 4, 8, 1, 1),
        (16, 128, 4, 6, 1, 2),
        (16, 256, 4, 4, 2, 1),
        (32, 256, 4, 4, 1, 1),
    ],
    "down": [
        (16, 256, 4, 4, 1, 1),
        (16, 128, 4, 8, 1, 1),
        (16, 256, 4, 6, 1, 1),
        (16, 256, 4, 4, 2, 1),
        (32, 256, 4, 4, 2, 1),
    ],
    "qkv_normed": [
        (16, 128, 4, 6, 1, 1),
        (16, 256, 4, 4, 1, 1),
        (16, 128, 4, 4, 2, 1),
        (32, 128, 4, 4, 1, 1),
    ],
    "gate_up_normed": [(32, 128, 4, 6, 1, 1), (32, 256, 4, 4, 1, 1)],
}
for _name, _tiles in _FEW_SPLIT_TILES.items():
    CANDIDATES[_name] += [T(*t) for t in _tiles]


# FP8 weights (--quantization fp8). One row, every case: FP8_ONE_ROW, the GEMV's (block_n,
# block_k, warps), block_k in e4m3 elements: barrier-free tiles (BLOCK_K >= 8 x 32 lanes x the
# warps, so the weight loads take x's layout: gemv_tiles.w_cols) at 2, 4 and 8 warps beside the
# first sweep's winners (W8A8 tiles, one row padded to 16 on FP8 tensor cores, lost to them).
# From two rows, per case (FP8_CANDIDATES, every BLOCK_M): the W8A16 winners of the first FP8
# sweep (x @ w^T through pointers, tma 0; TMA swap-AB, 1; TMA x @ w^T, 2; swap-AB through
# pointers, 3), then W8A8 tiles (a8 1, the seventh field: x quantized per row per chunk, FP8
# tensor cores), split K for programs >= 2 x 132 SMs
FP8_ONE_ROW = [
    (4, 1024, 4),
    (8, 1024, 4),
    (16, 1024, 4),
    (2, 2048, 4),
    (4, 2048, 4),
    (8, 2048, 4),
    (8, 2048, 8),
    (4, 4096, 8),
    (8, 512, 2),
    (16, 512, 2),
    (8, 512, 4),
    (4, 512, 4),
]
FP8_CANDIDATES: dict[str, list[tuple]] = {
    "o_proj": [
        (32, 256, 4, 3, 4, 0),
        (64, 256, 4, 3, 4, 3),
        (32, 128, 4, 4, 4, 2),
        (64, 128, 4, 4, 4, 0),
        (64, 128, 4, 4, 4, 3, 1),
        (64, 128, 4, 4, 8, 3, 1),
        (64, 256, 4, 3, 4, 3, 1),
        (64, 128, 4, 4, 4, 1, 1),
        (64, 256, 4, 3, 4, 1, 1),
        (32, 128, 4, 4, 4, 0, 1),
        (32, 256, 4, 3, 4, 0, 1),
    ],
    "down": [
        (64, 256, 4, 4, 8, 1),
        (64, 256, 4, 3, 8, 3),
        (64, 256, 4, 3, 4, 1),
        (32, 256, 4, 3, 8, 0),
        (64, 128, 4, 4, 8, 3, 1),
        (64, 256, 4, 3, 8, 3, 1),
        (64, 128, 4, 4, 16, 3, 1),
        (64, 256, 4, 3, 8, 1, 1),
        (64, 128, 4, 4, 8, 1, 1),
        (128, 128, 8, 3, 4, 3, 1),
        (64, 256, 4, 3, 4, 1, 1),
    ],
    "gate_up": [
        (64, 256, 8, 3, 1, 0),
        (64, 256, 4, 3, 2, 1),
        (64, 128, 4, 4, 1, 2),
        (64, 256, 4, 3, 1, 1),
        (64, 128, 4, 4, 2, 3, 1),
        (64, 256, 4, 3, 1, 3, 1),
        (64, 256, 4, 3, 2, 3, 1),
        (64, 128, 4, 4, 1, 1, 1),
        (64, 256, 4, 3, 1, 1, 1),
        (128, 128, 8, 3, 1, 3, 1),
    ],
    "qkv": [
        (32, 256, 4, 3, 4, 0),
        (32, 128, 4, 4, 8, 3),
        (16, 64, 4, 3, 2, 0),
        (64, 128, 4, 4, 4, 0),
        (32, 128, 4, 4, 8, 3, 1),
        (32, 256, 4, 3, 4, 3, 1),
        (64, 128, 4, 4, 4, 3, 1),
        (32, 128, 4, 4, 4, 1, 1),
        (32, 256, 4, 3, 4, 1, 1),
        (32, 128, 4, 4, 4, 0, 1),
        (32, 256, 4, 3, 4, 0, 1),
    ],
}
FP8_CANDIDATES["qkv_normed"] = FP8_CANDIDATES["qkv"]
FP8_CANDIDATES["gate_up_normed"] = FP8_CANDIDATES["gate_up"]
