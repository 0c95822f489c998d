"""Tile choices of the fused projection kernels, one table for every (kernel, shape, bs bucket),
and the split-K workspace.

A launch of ``M`` rows pads them to ``BLOCK_M = block_m(M)``: 1 (the broadcast-multiply GEMV of
``gemv_tiles``) or 16, 32, 64 (``tl.dot`` on tensor cores). ``tile_for(kernel, m, n, k)`` gives
the kernel's ``Tile``: ``block_n`` is the kernel's own ``BLOCK_N`` constexpr (weight rows for
``norm_gemv``/``gemv_residual``/``lm_head``, row *pairs* for ``gate_up_silu``, ``BLOCK_D`` for
``qkv_rope``), ``block_k`` the K chunk, ``num_warps``/``num_stages`` launch options and
``split_k`` the programs sharing one column tile's K (the last one runs the epilogue).
``TILES`` holds the measured choice per ``(kernel, n, k, BLOCK_M)``
(``benchmarks/proj_sweep.py`` on the H200); other shapes get ``default_tile``'s rule.

Eager, graph and exact steps of one batch size pick the same tile (a pure function of the
arguments), so they run the same kernels and round alike.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
import triton

from ..errors import ConfigError
from .gemv_tiles import proj_blocks
from .tma_tiles import box_fits, descriptor, tma_ready

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


@dataclass(frozen=True)
class Tile:
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int | None = None  # None: Triton's default (3)
    split_k: int = 1
    tma: int = 0  # tensor-core rows through TMA (tma_tiles): 1 swap-AB, weight and x by
    # descriptor; 2 x @ w^T, the weight by descriptor and x from pointers (a register operand)

    def launch(self) -> dict:
        """The launch options: ``num_warps``, and ``num_stages`` when set."""
        opts = {"num_warps": self.num_warps}
        if self.num_stages is not None:
            opts["num_stages"] = self.num_stages
        return opts


def block_m(m: int) -> int:
    """Rows one launch computes: 1 for one row, else M padded to 16, 32 or 64 (``tl.dot``)."""
    return 1 if m <= 1 else max(16, triton.next_power_of_2(m))


# (kernel, n, k, BLOCK_M) -> Tile, at Llama-3.2-1B's shapes (n: weight rows, all of them).
# Measured on the H200 (benchmarks/proj_sweep.py, bf16, PDL on, 16 calls over 16 weights, µs
# per call; 2026-12-01, rounds 2-4: round 4 with the TMA tiles, Tile(..., tma), whose figures
# follow; the sweeps vary by about 3% run to run); see docs/results.md, "decode kernels bs 2-64
# (issue 21)". Round 4 kept TMA for down (swap-AB: 11.70 / 12.30 / 13.91 against the pointer
# tiles' 12.06 / 12.84 / 15.12 in the same run) and the LM head at 16 rows (141.09 vs 144.24).
_QKV, _GU, _O, _DOWN, _LM = (3072, 2048), (16384, 2048), (2048, 2048), (2048, 8192), (128256, 2048)
TILES: dict[tuple[str, int, int, int], Tile] = {
    ("qkv_rope", *_QKV, 16): Tile(32, 256, 4, 3, 4),  # 9.04 (cuBLAS GEMM alone 6.52)
    ("qkv_rope", *_QKV, 32): Tile(16, 128, 4, 3, 4),  # 14.52 (6.58): CUBLAS below
    ("qkv_rope", *_QKV, 64): Tile(32, 128, 4, 3, 4),  # 21.53 (6.76): CUBLAS below
    ("gemv_residual", *_O, 16): Tile(32, 512, 4, 1, 4),  # 5.04 (6.17)
    ("gemv_residual", *_O, 32): Tile(32, 128, 4, 4, 2),  # 5.79 (6.19)
    ("gemv_residual", *_O, 64): Tile(32, 128, 4, 4, 2),  # 6.46 (6.32)
    ("gate_up_silu", *_GU, 16): Tile(64, 128, 8, 4, 1),  # 20.67 (18.57)
    ("gate_up_silu", *_GU, 32): Tile(64, 128, 8, 4, 1),  # 24.48 (19.03)
    ("gate_up_silu", *_GU, 64): Tile(64, 128, 8, 3, 1),  # 35.28 (19.53): CUBLAS below
    ("gemv_residual", *_DOWN, 16): Tile(64, 128, 4, 5, 4, 1),  # 11.70 (13.44)
    ("gemv_residual", *_DOWN, 32): Tile(64, 128, 4, 5, 4, 1),  # 12.30 (13.95)
    ("gemv_residual", *_DOWN, 64): Tile(64, 128, 4, 5, 4, 1),  # 13.91 (14.23)
    ("lm_head", *_LM, 16): Tile(256, 64, 8, 3, 1, 2),  # 141.09 (144.22)
    ("lm_head", *_LM, 32): Tile(256, 64, 8, 3, 1, 1),  # 158.59 (150.42): CUBLAS below
    ("lm_head", *_LM, 64): Tile(128, 64, 4, 4, 1, 2),  # 211.55 (162.74): CUBLAS below
    # x normed by its own kernel (SEPARATE_NORM below; round 5, 2026-12-01: cuBLAS GEMM alone
    # 6.54 / 6.61 / 6.76 for qkv and 18.54 / 19.00 / 19.50 for gate-up at 16 / 32 / 64 rows)
    ("qkv_rope_normed", *_QKV, 16): Tile(32, 256, 4, 3, 4),  # 7.14
    ("qkv_rope_normed", *_QKV, 32): Tile(16, 128, 4, 3, 4, 1),  # 8.04
    ("qkv_rope_normed", *_QKV, 64): Tile(16, 64, 4, 3, 2),  # 10.74
    ("gate_up_silu_normed", *_GU, 16): Tile(64, 128, 4, 3, 1, 1),  # 17.81
    ("gate_up_silu_normed", *_GU, 32): Tile(64, 128, 4, 3, 1, 1),  # 18.32
    ("gate_up_silu_normed", *_GU, 64): Tile(64, 128, 4, 3, 1, 1),  # 19.46
}
# Where the unfused pieces win: RMSNorm kernel + cuBLAS + RoPE/KV-write (or SiLU·mul) kernel,
# about 3.2-3.5 µs of small kernels plus two launches beside the GEMM (the reference step's
# profile, bs 8), against the fused kernel above: qkv 6.6 + ~5.5 vs 14.5 at 32 rows and 6.8 +
# ~5.5 vs 21.5 at 64; gate-up 19.5 + ~5 vs 35.3 at 64 (at 32: 19.0 + ~5 vs 24.5, a tie: fused);
# the LM head's norm + cuBLAS + argmax_rows (~8 µs beside the GEMM): 150.4 + 8 vs 158.6 at 32
# rows (a tie) and 162.7 + 8 vs 211.6 at 64.
CUBLAS: set[tuple[str, int, int, int]] = {
    ("qkv_rope", *_QKV, 32), ("qkv_rope", *_QKV, 64), ("gate_up_silu", *_GU, 64),
    ("lm_head", *_LM, 32), ("lm_head", *_LM, 64),
}  # fmt: skip


def _env_pairs(name: str) -> set[tuple[str, int]]:
    """The ``kernel:BLOCK_M`` pairs of an A/B switch, e.g. ``qkv_rope:16,gate_up_silu:32``."""
    items = (i.strip().partition(":") for i in os.environ.get(name, "").split(","))
    return {(kernel, int(bm)) for kernel, _, bm in items if kernel}


# The A/B switch of a measurement: STEPGRAPH_PROJ_CUBLAS="qkv_rope:16,gate_up_silu:32" also runs
# those kernels' unfused pieces at that BLOCK_M, for every shape
CUBLAS_ANY = _env_pairs("STEPGRAPH_PROJ_CUBLAS")
# Where the norm runs as its own kernel (add_rmsnorm) before the fused kernel's ``_normed``
# variant (no prologue: the activation streams as it is). Measured in the step (stepgraph
# bench, graph, ctx 512, 2026-12-01, one call, against the reference kernels): bs 4 1.066 vs
# 1.076, bs 8 1.105 vs 1.122, bs 16 1.169 vs 1.204, bs 32 1.278 vs 1.309 (qkv there on CUBLAS);
# with the norm prologue the fused kernels had tied or lost (docs/results.md, E3 and E5).
SEPARATE_NORM: set[tuple[str, int, int, int]] = {
    ("qkv_rope", *_QKV, 16), ("gate_up_silu", *_GU, 16), ("gate_up_silu", *_GU, 32),
}  # fmt: skip
# Its A/B switch: STEPGRAPH_SEPARATE_NORM="qkv_rope:16,gate_up_silu:32" or "all"
SEPARATE_ANY = (
    {(k, bm) for k in ("qkv_rope", "gate_up_silu") for bm in (16, 32, 64)}
    if os.environ.get("STEPGRAPH_SEPARATE_NORM", "").strip() == "all"
    else _env_pairs("STEPGRAPH_SEPARATE_NORM")
)
TILES_ENV = "STEPGRAPH_PROJ_TILES"  # a JSON file {"kernel,n,k,block_m": [tile fields]}: a sweep's


def _env_tiles() -> None:
    """Add the tiles of ``$STEPGRAPH_PROJ_TILES`` (``benchmarks/proj_sweep.py --tiles-out``) to
    ``TILES`` (in place of a ``CUBLAS`` choice of the same key): a sweep's choice tried in the
    same device run, before it is written here."""
    path = os.environ.get(TILES_ENV)
    if path:
        with open(path) as f:
            for key, fields in json.load(f).items():
                kernel, n, k, bm = key.split(",")
                TILES[(kernel, int(n), int(k), int(bm))] = Tile(*fields)
                CUBLAS.discard((kernel, int(n), int(k), int(bm)))  # the sweep's tile is tried


_env_tiles()


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
    while bn > 16 and triton.cdiv(rows, bn) < TARGET_PROGRAMS:
        bn //= 2
    bk = max(16, min(128 if bm <= 32 else 64, triton.next_power_of_2(k)))
    split = 1
    if kernel != "lm_head":
        while triton.cdiv(rows, bn) * split * 2 <= TARGET_PROGRAMS and k // (2 * split) >= 512:
            split *= 2
    return Tile(bn, bk, 4, 3, split)


SMEM_BUDGET = 200 * 1024  # bytes of shared memory a tile's pipeline may take (H200: 227 KB)


def smem_bytes(kernel: str, tile: Tile, m: int, elem_bytes: int) -> int:
    """Shared memory of ``tile``'s software pipeline, roughly: stages x (x chunk + weight
    chunks) in the element size."""
    rows = 2 * tile.block_n if kernel in PAIRED else tile.block_n
    stages = tile.num_stages or 3
    return stages * (block_m(m) + rows) * tile.block_k * elem_bytes


def tile_for(kernel: str, m: int, n: int, k: int, elem_bytes: int = 2) -> Tile:
    """The tile ``kernel`` launches for ``m`` rows of an ``[n, k]`` weight of ``elem_bytes``
    bytes an element. ``TILES`` was measured in bf16: other sizes (float32) take the rule, as
    does a table tile whose pipeline would not fit in shared memory."""
    tile = TILES.get((kernel, n, k, block_m(m))) if elem_bytes == 2 else None
    if tile is None or smem_bytes(kernel, tile, m, elem_bytes) > SMEM_BUDGET:
        tile = default_tile(kernel, m, n, k)
    return tile


def prefer_cublas(kernel: str, m: int, n: int, k: int, elem_bytes: int = 2) -> bool:
    """Whether the fused step runs ``kernel``'s unfused pieces (cuBLAS GEMM) at ``m`` rows
    (measured in bf16; other element sizes keep the fused kernel)."""
    bm = block_m(m)
    return elem_bytes == 2 and ((kernel, n, k, bm) in CUBLAS or (kernel, bm) in CUBLAS_ANY)


def separate_norm(kernel: str, m: int, n: int, k: int, elem_bytes: int = 2) -> bool:
    """Whether the fused step runs ``kernel`` (``qkv_rope``, ``gate_up_silu``) at ``m`` rows as
    the norm kernel, then the ``_normed`` variant on the normed x (measured in bf16)."""
    bm = block_m(m)
    return (
        elem_bytes == 2
        and bm > 1
        and ((kernel, n, k, bm) in SEPARATE_NORM or (kernel, bm) in SEPARATE_ANY)
    )


def measured(kernel: str, m: int, n: int, k: int, elem_bytes: int = 2) -> bool:
    """Whether ``kernel`` at ``m`` rows (2 or more) of an ``[n, k]`` weight has a measured choice:
    a tile in ``TILES`` or cuBLAS in ``CUBLAS`` (both measured in bf16). The rule's tiles ran
    llama-3.1-8b at bs 8 in 10.5 ms against 5.5 for cuBLAS (H200, 2026-12-01), so the fused step
    runs its tensor-core kernels only where every projection was measured."""
    key = (kernel, n, k, block_m(m))
    return elem_bytes == 2 and (key in TILES or key in CUBLAS or (kernel, key[3]) in CUBLAS_ANY)


def tma_descriptors(tile: Tile, m: int, x: torch.Tensor, weight: torch.Tensor, rows: int):
    """``(weight descriptor, x descriptor)`` when ``tile`` streams through TMA at ``m`` rows
    (``tile.tma``, tensor-core rows, boxes ``[rows, block_k]`` and ``[BLOCK_M, block_k]`` that
    TMA takes, both tensors ``tma_ready``), else None: the pointer loop, same tile."""
    bm = block_m(m)
    if tile.tma not in (1, 2) or bm < 16 or not box_fits(rows, tile.block_k, bm):
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
    "TILES",
    "TILES_ENV",
    "Tile",
    "as_tile",
    "block_m",
    "check_tile",
    "default_tile",
    "prefer_cublas",
    "separate_norm",
    "smem_bytes",
    "splitk_workspace",
    "tile_for",
    "tma_descriptors",
]
