"""Tile choices of the fused projection kernels, one table for every (kernel, shape, bs bucket),
and the split-K workspace.

A launch of ``M`` rows pads them to ``BLOCK_M = block_m(M)``: 1 (the broadcast-multiply GEMV of
``gemv_tiles``) or 16, 32, 64 (``tl.dot`` on tensor cores). ``tile_for(kernel, m, n, k)`` gives
the kernel's ``Tile``: ``block_n`` is the kernel's own ``BLOCK_N`` constexpr (weight rows for
``norm_gemv``/``gemv_residual``/``lm_head``, row *pairs* for ``gate_up_silu``, ``BLOCK_D`` for
``qkv_rope``), ``block_k`` the K chunk, ``num_warps``/``num_stages`` launch options and
``split_k`` the programs sharing one column tile's K (the last one runs the epilogue).
``tile_table.TILES`` holds the measured choice per ``(kernel, n, k, BLOCK_M)``
(``benchmarks/proj_sweep.py`` on the H200), carried as ``DecodeTuning.tables``
(``stepgraph.tuning.ProjTables``); other shapes get ``default_tile``'s rule.

Eager, graph and exact steps of one batch size pick the same tile (a pure function of the
arguments), so they run the same kernels and round alike.
"""

from __future__ import annotations

import functools
import warnings
from typing import TYPE_CHECKING

import torch

from ...errors import ConfigError
from ..launch_math import cdiv, next_pow2
from .gemv_tiles import proj_blocks
from .tile_table import CUBLAS, TILES, Tile
from .tma_tiles import box_fits, descriptor, tma_ready

if TYPE_CHECKING:
    from ...tuning import ProjTables

KERNELS = (
    "norm_gemv",
    "gemv_residual",
    "lm_head",
    "gate_up_silu",
    "qkv_rope",
    "gate_up_silu_normed",
    "qkv_rope_normed",
)  # _normed: x normed by its own kernel
PAIRED = ("gate_up_silu", "qkv_rope", "gate_up_silu_normed", "qkv_rope_normed")
TARGET_PROGRAMS = 264  # two programs per SM of the H200 (132 SMs)


def block_m(m: int) -> int:
    """Rows one launch computes: 1 for one row, else M padded to 16, 32 or 64 (``tl.dot``)."""
    return 1 if m <= 1 else max(16, next_pow2(m))


def _tables(tables: ProjTables | None) -> ProjTables:
    """``tables``, or ``DecodeTuning.default()``'s where None (a launcher called directly)."""
    if tables is not None:
        return tables
    from ...tuning import DecodeTuning

    return DecodeTuning.default().tables


def default_tile(kernel: str, m: int, n: int, k: int) -> Tile:
    """The rule for shapes not in ``TILES``. One row: ``gemv_tiles.proj_blocks`` (measured for
    bs=1). Several: the narrowest column tile that still gives ``TARGET_PROGRAMS`` programs
    (16 rows at least, a ``tl.dot`` minimum), split-K when even 16-row tiles leave SMs idle and
    every split keeps 512 or more of K."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; one of {KERNELS}")
    if m <= 1:
        bn, bk, warps = proj_blocks(1, n, k)
        if kernel == "gate_up_silu":
            bn = max(1, bn // 2)  # both row sets in one tile budget
        return Tile(bn, bk, warps)
    bm = block_m(m)
    rows = n // 2 if kernel in PAIRED else n  # per program: pairs
    bn = 64 if kernel == "lm_head" else 16
    while bn > 16 and cdiv(rows, bn) < TARGET_PROGRAMS:
        bn //= 2
    bk = max(16, min(128 if bm <= 32 else 64, next_pow2(k)))
    split = 1
    if kernel != "lm_head":
        while cdiv(rows, bn) * split * 2 <= TARGET_PROGRAMS and k // (2 * split) >= 512:
            split *= 2
    return Tile(bn, bk, 4, 3, split)


SWAP_POINTERS = 3  # Tile.tma: swap-AB through pointers (the weight the MMA's register operand)
FP8_ROW_K, FP8_ROW_ELEMS = 2048, 8192  # the FP8 one-row rule: K a chunk, weights a program
SPLIT_REGS = 16384  # split_k x BLOCK_M x BLOCK_N (x 2 paired): the FP8 rule's split-K cap


def fp8_default_tile(kernel: str, m: int, n: int, k: int, x_bytes: int = 2) -> Tile:
    """The rule for FP8 weights (e4m3, one byte an element; activations of ``x_bytes``) at
    shapes not in ``FP8_TILES``. One row: ``FP8_ROW_K`` of K and ``FP8_ROW_ELEMS`` weights a
    program (of each half where the kernel pairs two), 4 warps: within 0-22% of the sweep's
    winner at each of the eight one-row shapes of the 1B and 8B on the H200 (the best single
    tile there; docs/experiments.md#fp8-one-row-loads). Several: W8A8
    (``a8``: x quantized per row per chunk, FP8 tensor cores; float32 x: not) swap-AB through
    pointers (``SWAP_POINTERS``: the weight rows are the MMA's M; W8A16, converting the
    weight to bf16 from 2 rows, tied or lost to bf16 on the H200), 64 weight rows a program (a
    Hopper warpgroup MMA's M; 32 for qkv, whose tiles divide head_dim / 2), 128 bytes of K a
    chunk (at 256 W8A16's register operand took 239-255 registers a thread), four stages, then
    split K (powers of two, every split a whole chunk) until ``TARGET_PROGRAMS`` programs, as
    long as the split-K reduce's partials (``SPLIT_REGS`` floats of a program) fit: 8 splits of
    64 x 64 spilled, 4 did not."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; one of {KERNELS}")
    kcap = next_pow2(max(k, 16))
    if m <= 1:  # 2048 of K, 8k weights (both halves: 16k) a program, 4 warps
        bk = max(32, min(FP8_ROW_K, kcap))
        return Tile(max(1, min(FP8_ROW_ELEMS // bk, next_pow2(n))), bk, 4)
    bm = block_m(m)
    paired = kernel in PAIRED
    rows = n // 2 if paired else n
    bn = 32 if kernel.startswith("qkv_rope") else 64
    bk = max(16, min(128 if x_bytes <= 2 else 64, kcap))
    split = 1
    if kernel != "lm_head":
        tiles = cdiv(rows, bn)
        while (
            tiles * split < TARGET_PROGRAMS
            and k // (2 * split) >= bk
            and 2 * split * bm * bn * (2 if paired else 1) <= SPLIT_REGS
        ):
            split *= 2
    return Tile(bn, bk, 4, 4, split, SWAP_POINTERS, 0 if x_bytes > 2 else 1)


def fp8_table_tile(
    kernel: str, m: int, n: int, k: int, x_bytes: int = 2, tables: ProjTables | None = None
) -> Tile | None:
    """``tables.fp8_tiles``' tile for ``m`` rows of an ``[n, k]`` FP8 weight, or None (float32
    activations take the rule: the table was measured with bf16 ones)."""
    if x_bytes != 2:
        return None
    tiles = _tables(tables).fp8_tiles
    return next(
        (tiles[key] for key in ((kernel, n, k, c) for c in table_rows(m)) if key in tiles), None
    )


SMEM_BUDGET = 200 * 1024  # bytes of shared memory a tile's pipeline may take (H200: 227 KB)


def smem_bytes(kernel: str, tile: Tile, m: int, elem_bytes: int, w_bytes: int | None = None) -> int:
    """Shared memory of ``tile``'s software pipeline, roughly: stages x (x chunk + weight
    chunks) in the element size (the weight's ``w_bytes``: 1 for e4m3; None: the same)."""
    rows = 2 * tile.block_n if kernel in PAIRED else tile.block_n
    stages = tile.num_stages or 3
    w_bytes = elem_bytes if w_bytes is None else w_bytes
    return stages * (block_m(m) * elem_bytes + rows * w_bytes) * tile.block_k


def table_rows(m: int) -> tuple[int, ...]:
    """The ``TILES`` row keys ``m`` rows look up, first match wins: 4 then 16 for 2-4 rows (the
    default buckets 2 and 4; a custom bucket that straddles 4 and 5 rows would pick two tiles
    for one graph, as the ``block_m`` classes do at 16 and 17), else ``block_m(m)``."""
    return (4, 16) if 2 <= m <= 4 else (block_m(m),)


def tile_for(
    kernel: str,
    m: int,
    n: int,
    k: int,
    elem_bytes: int = 2,
    tables: ProjTables | None = None,
    fp8: bool = False,
) -> Tile:
    """The tile ``kernel`` launches for ``m`` rows of an ``[n, k]`` weight of ``elem_bytes``
    bytes an element, from ``tables.tiles`` (None: the default tuning's). The table was
    measured in bf16: other sizes (float32) take the rule, as does a table tile whose pipeline
    would not fit in shared memory. ``fp8``: the weight is e4m3 and ``elem_bytes`` the
    activations' size: ``tables.fp8_tiles``, else ``fp8_default_tile``."""
    if fp8:
        tile = fp8_table_tile(kernel, m, n, k, elem_bytes, tables)
        if tile is not None and (smem := smem_bytes(kernel, tile, m, elem_bytes, 1)) > SMEM_BUDGET:
            _over_budget(kernel, tile, block_m(m), smem)
            tile = None
        return tile or fp8_default_tile(kernel, m, n, k, elem_bytes)
    tile = None
    if elem_bytes == 2:
        tiles = _tables(tables).tiles
        tile = next(
            (tiles[key] for key in ((kernel, n, k, c) for c in table_rows(m)) if key in tiles), None
        )
    if tile is not None and (smem := smem_bytes(kernel, tile, m, elem_bytes)) > SMEM_BUDGET:
        _over_budget(kernel, tile, block_m(m), smem)
        tile = None
    return tile or default_tile(kernel, m, n, k)


@functools.cache  # once per tile and row class
def _over_budget(kernel: str, tile: Tile, rows: int, smem: int) -> None:
    warnings.warn(
        f"{kernel}: the table's {tile} needs about {smem >> 10} KB of shared memory at {rows} "
        f"rows, over SMEM_BUDGET ({SMEM_BUDGET >> 10} KB), so the rule's tile runs instead; "
        "fewer stages or a smaller block_n or block_k would fit",
        stacklevel=3,
    )


def prefer_cublas(
    kernel: str, m: int, n: int, k: int, elem_bytes: int = 2, tables: ProjTables | None = None
) -> bool:
    """Whether the fused step runs ``kernel``'s unfused pieces (cuBLAS GEMM) at ``m`` rows
    (``tables.cublas``, measured in bf16; other element sizes keep the fused kernel)."""
    bm, t = block_m(m), _tables(tables)
    return elem_bytes == 2 and (
        (kernel, n, k, bm) in t.cublas or (kernel, bm) in t.cublas_everywhere
    )


def separate_norm(
    kernel: str, m: int, n: int, k: int, elem_bytes: int = 2, tables: ProjTables | None = None
) -> bool:
    """Whether the fused step runs ``kernel`` (``qkv_rope``, ``gate_up_silu``) at ``m`` rows as
    the norm kernel, then the ``_normed`` variant on the normed x (``tables.separate_norm``,
    measured in bf16)."""
    bm, t = block_m(m), _tables(tables)
    return (
        elem_bytes == 2
        and bm > 1
        and ((kernel, n, k, bm) in t.separate_norm or (kernel, bm) in t.separate_norm_everywhere)
    )


def measured(
    kernel: str, m: int, n: int, k: int, elem_bytes: int = 2, tables: ProjTables | None = None
) -> bool:
    """Whether ``kernel`` at ``m`` rows (2 or more) of an ``[n, k]`` weight has a measured choice:
    a tile in ``TILES`` or cuBLAS in ``CUBLAS`` (both measured in bf16). Untuned tiles lost to
    the reference kernels by 2x, so the fused step runs its tensor-core kernels only where every
    projection was measured (docs/experiments.md#tensor-cores-against-the-reference-kernels)."""
    key, t = (kernel, n, k, block_m(m)), _tables(tables)
    return elem_bytes == 2 and (
        key in t.tiles or key in t.cublas or (kernel, key[3]) in t.cublas_everywhere
    )


def reference_bucket(
    qkv_n: int, k: int, bucket: int, elem_bytes: int = 2, tables: ProjTables | None = None
) -> bool:
    """Whether a model whose fused qkv weight is ``[qkv_n, k]`` measured faster on the reference
    kernels at ``bucket`` although its tiles cover the rows (``tables.reference_buckets``,
    measured in bf16)."""
    return elem_bytes == 2 and (qkv_n, k, bucket) in _tables(tables).reference_buckets


def no_pdl_bucket(
    qkv_n: int, k: int, bucket: int, elem_bytes: int = 2, tables: ProjTables | None = None
) -> bool:
    """Whether the step at ``bucket`` measured faster without PDL on its projections, for a
    model whose fused qkv weight is ``[qkv_n, k]`` (``tables.no_pdl_buckets``, bf16)."""
    return elem_bytes == 2 and (qkv_n, k, bucket) in _tables(tables).no_pdl_buckets


def loop_mode(tile: Tile, m: int, descs, bm: int | None = None) -> int:
    """The kernels' ``TMA`` constexpr for ``tile`` at ``m`` rows (``bm``: the launch's BLOCK_M,
    ``launch_block_m``; None: ``block_m(m)``): the tile's TMA mode where ``tma_descriptors``
    gave descriptors, ``SWAP_POINTERS`` for a swap-AB pointer tile on tensor-core rows, else 0
    (the pointer loop)."""
    if descs:
        return tile.tma
    bm = block_m(m) if bm is None else bm
    return SWAP_POINTERS if tile.tma == SWAP_POINTERS and bm >= 16 else 0


def launch_block_m(tile: Tile, m: int, fp8: bool, x: torch.Tensor) -> int:
    """BLOCK_M of a launch of ``m`` rows: ``block_m(m)``, except one row on an ``a8`` tile
    with e4m3 weights and 2-byte activations, which runs W8A8 on FP8 tensor cores with M
    padded to 16 (the weight straight to the MMA, no conversion) instead of the GEMV."""
    if m == 1 and act_e4m3(tile, m, fp8, x):
        return 16
    return block_m(m)


def act_e4m3(tile: Tile, m: int, fp8: bool, x: torch.Tensor) -> bool:
    """Whether ``tile`` runs W8A8 at ``m`` rows (the kernels' ``A8``): an ``a8`` tile, e4m3
    weights (``fp8``) and activations of 2 bytes (float32 ones keep the dequantized path,
    exact against float64); one row too, padded to 16 (``launch_block_m``)."""
    return bool(tile.a8) and fp8 and m >= 1 and x.element_size() == 2


def tma_descriptors(
    tile: Tile,
    m: int,
    x: torch.Tensor,
    weight: torch.Tensor,
    rows: int,
    tma: bool = True,
    bm: int | None = None,
):
    """``(weight descriptor, x descriptor)`` when ``tile`` streams through TMA at ``m`` rows
    (``tma``, ``DecodeTuning.tma``; ``tile.tma``, tensor-core rows, boxes ``[rows, block_k]``
    and ``[BLOCK_M, block_k]`` that TMA takes, both tensors ``tma_ready``), else None: the
    pointer loop, same tile. ``bm``: the launch's BLOCK_M (None: ``block_m(m)``)."""
    bm = block_m(m) if bm is None else bm
    if not tma or tile.tma not in (1, 2) or bm < 16 or not box_fits(rows, tile.block_k, bm):
        return None
    if not tma_ready(weight, *((x,) if tile.tma == 1 else ())):
        return None
    return descriptor(weight, rows, tile.block_k), (
        descriptor(x, bm, tile.block_k) if tile.tma == 1 else x
    )


def as_tile(blocks) -> Tile:
    """A ``Tile`` from a launcher's ``blocks`` override: a ``Tile`` or a tuple
    ``(block_n, block_k, num_warps[, num_stages[, split_k[, tma]]])``."""
    return blocks if isinstance(blocks, Tile) else Tile(*blocks)


def check_tile(kernel: str, tile: Tile, m: int) -> Tile:
    """``tile`` if ``kernel`` can launch it for ``m`` rows, else a ConfigError naming the fix:
    ``tl.dot`` needs 16 or more columns and K a chunk; only ``norm_gemv`` splits K."""
    if m > 1 and (tile.block_n < 16 or tile.block_k < 16):
        raise ConfigError(
            f"{kernel}: {m} rows run on tensor cores, which need block_n >= 16 and "
            f"block_k >= 16; got {tile}"
        )
    if tile.split_k < 1:
        raise ConfigError(f"{kernel}: split_k must be >= 1; got {tile}")
    if tile.a8 not in (0, 1) or (tile.a8 and (tile.block_k < 32 or tile.block_n < 16)):
        raise ConfigError(
            f"{kernel}: a8 must be 0 or 1, and an a8 tile (FP8 tensor cores, one row too) "
            f"needs block_n >= 16 and block_k >= 32; got {tile}"
        )
    if tile.tma not in (0, 1, 2, SWAP_POINTERS):
        raise ConfigError(
            f"{kernel}: tma must be 0 (pointers), 1 or 2 (TMA) or {SWAP_POINTERS} (swap-AB "
            f"through pointers); got {tile}"
        )
    return tile


# -- split-K workspace: float32 partials and one ticket per column tile, per device ------------
_WORKSPACES: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
_RETIRED: list[tuple[torch.Tensor, torch.Tensor]] = []  # captured graphs may still point here


def splitk_workspace(
    device: torch.device, partial_elems: int, tickets: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(partials float32, tickets int32)`` with at least the given sizes, shared by every
    split-K launch on ``device`` (launches on one stream run one after another, and each leaves
    its tickets at zero). Grown buffers are kept alive: a captured graph keeps its pointers."""
    device = torch.device(device)
    cur = _WORKSPACES.get(device)
    if cur is None or cur[0].numel() < partial_elems or cur[1].numel() < tickets:
        if cur is not None:
            _RETIRED.append(cur)
        p = max(partial_elems, cur[0].numel() if cur else 0, 1 << 20)
        t = max(tickets, cur[1].numel() if cur else 0, 4096)
        cur = (
            torch.empty(p, dtype=torch.float32, device=device),
            torch.zeros(t, dtype=torch.int32, device=device),
        )
        _WORKSPACES[device] = cur
    return cur


__all__ = [
    "CUBLAS",
    "KERNELS",
    "SPLIT_REGS",
    "SWAP_POINTERS",
    "TILES",
    "Tile",
    "act_e4m3",
    "as_tile",
    "block_m",
    "check_tile",
    "default_tile",
    "fp8_default_tile",
    "fp8_table_tile",
    "launch_block_m",
    "loop_mode",
    "no_pdl_bucket",
    "prefer_cublas",
    "separate_norm",
    "smem_bytes",
    "splitk_workspace",
    "table_rows",
    "tile_for",
    "tma_descriptors",
]
