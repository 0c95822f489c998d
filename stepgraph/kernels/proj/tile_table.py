"""The measured tables of the fused projections: ``Tile`` (a kernel's launch shape), ``TILES``
(the tile per (kernel, n, k, BLOCK_M)), ``CUBLAS`` (where norm + cuBLAS + a small kernel won) and
``SEPARATE_NORM`` (where the norm as its own kernel won), at the shapes of Llama-3.2-1B and
Llama-3.1-8B. Data only; ``proj_tiles`` holds the rules that read it, and ``tile_for`` falls back
to ``default_tile`` for every other shape. ``benchmarks/proj_sweep.py`` measures new entries
(docs/tuning.md)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tile:
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int | None = None  # None: Triton's default (3)
    split_k: int = 1
    tma: int = 0  # tensor-core rows through TMA (tma_tiles): 1 swap-AB, weight and x by
    # descriptor; 2 x @ w^T, the weight by descriptor and x from pointers (a register operand);
    # 3 swap-AB through pointers, no descriptor (w @ x^T: the weight tile, converted in
    # registers when e4m3, is the MMA's register operand; gemv_tiles.gemv_loop's SWAP)
    a8: int = 0  # 1: W8A8 for e4m3 weights from 2 rows: x quantized to e4m3 per row per K
    # chunk, FP8 tensor cores (gemv_tiles.dot_a8); bf16 weights and float32 x ignore it

    def launch(self) -> dict:
        """The launch options: ``num_warps``, and ``num_stages`` when set."""
        opts = {"num_warps": self.num_warps}
        if self.num_stages is not None:
            opts["num_stages"] = self.num_stages
        return opts


# (kernel, n, k, BLOCK_M) -> Tile, at Llama-3.2-1B's shapes (n: weight rows, all of them), from
# benchmarks/proj_sweep.py on the H200 (bf16, PDL on) and checked in the step with
# benchmarks/ab_step.py; the figures are in docs/experiments.md#projection-tiles-tma-and-cublas.
# A key with 4 in place of BLOCK_M would serve 2-4 rows before the 16-row key
# (proj_tiles.table_rows); with the late PDL trigger and the norm handoff the 16-row tiles won
# there, so there is none.
_QKV, _GU, _O, _DOWN, _LM = (3072, 2048), (16384, 2048), (2048, 2048), (2048, 8192), (128256, 2048)
TILES: dict[tuple[str, int, int, int], Tile] = {
    ("qkv_rope", *_QKV, 16): Tile(32, 256, 4, 3, 4),
    ("qkv_rope", *_QKV, 32): Tile(16, 128, 4, 3, 4),  # SEPARATE_NORM serves layer 0
    ("qkv_rope", *_QKV, 64): Tile(32, 128, 4, 3, 4),  # CUBLAS serves this class
    # 2-16 rows: four splits of K, 256 programs
    # (docs/experiments.md#o_proj-splits-k-four-ways-at-2-16-rows)
    ("gemv_residual", *_O, 16): Tile(32, 128, 4, 4, 4, 2),
    # 17-64 rows: the weight through TMA, as at 16 rows
    ("gemv_residual", *_O, 32): Tile(32, 128, 4, 4, 2, 2),
    ("gemv_residual", *_O, 64): Tile(32, 128, 4, 4, 2, 2),
    ("gate_up_silu", *_GU, 16): Tile(64, 128, 8, 4, 1),
    ("gate_up_silu", *_GU, 32): Tile(64, 128, 8, 4, 1),
    ("gate_up_silu", *_GU, 64): Tile(64, 128, 8, 3, 1),
    ("gemv_residual", *_DOWN, 16): Tile(64, 128, 4, 5, 4, 1),  # TMA swap-AB beat the pointers
    ("gemv_residual", *_DOWN, 32): Tile(64, 128, 4, 5, 4, 1),
    ("gemv_residual", *_DOWN, 64): Tile(64, 128, 4, 5, 4, 1),
    ("lm_head", *_LM, 16): Tile(256, 64, 8, 3, 1, 2),
    ("lm_head", *_LM, 32): Tile(256, 64, 8, 3, 1, 1),  # fused here: it beat cuBLAS in the step
    ("lm_head", *_LM, 64): Tile(128, 64, 4, 4, 1, 2),  # CUBLAS serves this class
    # x normed already (by its own kernel, SEPARATE_NORM, or the norm handoff)
    ("qkv_rope_normed", *_QKV, 16): Tile(32, 256, 4, 3, 4),
    ("qkv_rope_normed", *_QKV, 32): Tile(16, 128, 4, 5, 4, 1),  # five stages won in the step
    ("qkv_rope_normed", *_QKV, 64): Tile(16, 64, 4, 3, 2),
    ("gate_up_silu_normed", *_GU, 16): Tile(64, 128, 4, 4, 1, 1),
    ("gate_up_silu_normed", *_GU, 32): Tile(64, 128, 4, 3, 1, 1),
    ("gate_up_silu_normed", *_GU, 64): Tile(64, 128, 4, 3, 1, 1),
}
# Where the unfused pieces win (norm kernel + cuBLAS + RoPE/KV write, or the head's argmax):
# qkv and the LM head at 33-64 rows, where the GEMM's speed outweighs the small kernels beside
# it; gate-up at 64 rows and qkv / the head at 17-32 rows run fused on the handoff instead
# (docs/experiments.md#cublas-where-it-wins).
CUBLAS: set[tuple[str, int, int, int]] = {("qkv_rope", *_QKV, 64), ("lm_head", *_LM, 64)}

# Llama-3.1-8B at 2-16 rows (BLOCK_M 16); rows 17-64 are not measured, so they run the
# reference kernels (docs/experiments.md#the-8b-tiles).
_Q8, _GU8, _O8, _D8, _LM8 = (6144, 4096), (28672, 4096), (4096, 4096), (4096, 14336), (128256, 4096)
TILES.update(
    {
        ("qkv_rope", *_Q8, 16): Tile(32, 128, 4, 3, 4, 1),  # CUBLAS serves this class
        ("qkv_rope_normed", *_Q8, 16): Tile(32, 256, 4, 3, 4),
        # o_proj, gate-up on the handoff: TMA tiles beat the sweep's pointer tiles in the step
        ("gemv_residual", *_O8, 16): Tile(64, 128, 4, 4, 4, 1),
        ("gemv_residual", *_D8, 16): Tile(64, 128, 4, 5, 4, 1),
        ("gate_up_silu", *_GU8, 16): Tile(64, 128, 4, 3, 1, 2),
        ("gate_up_silu_normed", *_GU8, 16): Tile(64, 128, 4, 4, 1, 1),
        ("lm_head", *_LM8, 16): Tile(128, 128, 4, 4),
    }
)
CUBLAS.add(("qkv_rope", *_Q8, 16))

# FP8 weights (e4m3, per-channel scales; activations bf16): the tile per (kernel, n, k, BLOCK_M)
# as TILES, BLOCK_M 1 included (the one-row GEMV: block_k counts e4m3 elements, one byte each),
# from benchmarks/proj_sweep.py --quantization fp8 on the H200 (2026-12-03, µs a call, bf16's
# own tile on bf16 weights in brackets); other keys take proj_tiles.fp8_default_tile
# (docs/experiments.md#fp8-weight-tiles). One row: the GEMV with its weights in runs of 8
# (docs/experiments.md#fp8-one-row-loads; W8A8 one-row tiles on tensor cores lost to it), swept
# again after that change (bf16's figures beside from the same run). From 2 rows W8A8 (a8)
# where it won, W8A16 elsewhere; swept again once x was rounded to e4m3 by the hardware's cast
# (gemv_tiles.quantize_rows_e4m3); qkv's prologue form takes the handoff form's measured tile.
FP8_TILES: dict[tuple[str, int, int, int], Tile] = {
    ("qkv_rope", *_QKV, 1): Tile(4, 2048, 4),  # 3.81 (5.12)
    ("gemv_residual", *_O, 1): Tile(8, 2048, 4),  # 2.41 (3.31)
    ("gate_up_silu", *_GU, 1): Tile(8, 512, 2),  # 10.60 (17.24)
    ("gemv_residual", *_DOWN, 1): Tile(4, 4096, 8),  # 6.12 (9.46)
    ("qkv_rope_normed", *_QKV, 16): Tile(32, 256, 4, 3, 4, 0, 1),  # 7.02 (7.04)
    ("qkv_rope_normed", *_QKV, 32): Tile(32, 128, 4, 4, 4, 1, 1),  # 10.24 (8.03)
    ("qkv_rope_normed", *_QKV, 64): Tile(32, 128, 4, 4, 4, 0, 1),  # 12.45 (10.74)
    ("gemv_residual", *_O, 16): Tile(32, 256, 4, 3, 4),  # 5.52 (5.81)
    ("gemv_residual", *_O, 32): Tile(64, 256, 4, 3, 4, 3, 1),  # 6.48 (6.48)
    ("gemv_residual", *_O, 64): Tile(64, 256, 4, 3, 4, 1, 1),  # 8.33 (6.94)
    ("gate_up_silu_normed", *_GU, 16): Tile(64, 256, 4, 3, 1, 3, 1),  # 11.75 (17.14)
    ("gate_up_silu_normed", *_GU, 32): Tile(64, 256, 4, 3, 1, 3, 1),  # 13.53 (18.12)
    ("gate_up_silu_normed", *_GU, 64): Tile(64, 256, 4, 3, 1, 1, 1),  # 17.23 (19.29)
    ("gemv_residual", *_DOWN, 16): Tile(64, 128, 4, 4, 8, 3, 1),  # 9.59 (12.17)
    ("gemv_residual", *_DOWN, 32): Tile(64, 256, 4, 3, 8, 1, 1),  # 10.74 (12.23)
    ("gemv_residual", *_DOWN, 64): Tile(64, 256, 4, 3, 4, 1, 1),  # 16.65 (13.70)
    ("qkv_rope", *_Q8, 1): Tile(8, 1024, 4),  # 9.84 (15.95)
    ("gemv_residual", *_O8, 1): Tile(8, 2048, 4),  # 5.49 (9.76)
    ("gate_up_silu", *_GU8, 1): Tile(4, 2048, 4),  # 32.12 (57.86)
    ("gemv_residual", *_D8, 1): Tile(8, 2048, 4),  # 15.30 (28.88)
    ("qkv_rope_normed", *_Q8, 16): Tile(64, 128, 4, 4, 4, 3, 1),  # 13.10 (19.73)
    ("gemv_residual", *_O8, 16): Tile(64, 128, 4, 4, 4, 1, 1),  # 9.76 (11.84)
    ("gate_up_silu_normed", *_GU8, 16): Tile(64, 128, 4, 4, 1, 1, 1),  # 32.78 (56.68)
    ("gemv_residual", *_D8, 16): Tile(64, 128, 4, 4, 8, 3, 1),  # 21.55 (31.86)
}
for _key in [k for k in FP8_TILES if k[0] == "qkv_rope_normed"]:
    FP8_TILES.setdefault(("qkv_rope", *_key[1:]), FP8_TILES[_key])

# Where the norm runs as its own kernel (add_rmsnorm) before the fused kernel's ``_normed``
# variant, the activation then streaming as it is: with the norm in the prologue the fused
# kernels tied or lost (docs/experiments.md#the-norm-as-its-own-kernel). With the handoff on it
# serves layer 0's qkv (normed with the embedding, embed_rmsnorm) and the handoff-off paths.
SEPARATE_NORM: set[tuple[str, int, int, int]] = {
    ("qkv_rope", *_QKV, 16),
    ("qkv_rope", *_QKV, 32),
    ("gate_up_silu", *_GU, 16),
    ("gate_up_silu", *_GU, 32),
    ("gate_up_silu", *_GU, 64),
}
SEPARATE_NORM.add(("gate_up_silu", *_GU8, 16))  # the 8B's gate-up with the handoff off
# Buckets where a model measured faster on the reference kernels inside the step although its
# tiles cover the rows (keyed by its fused qkv weight's shape): none since the late PDL trigger
# and the norm handoff (docs/experiments.md#tensor-cores-against-the-reference-kernels).
REFERENCE_BUCKETS: set[tuple[int, int, int]] = set()
# Buckets where the step measured faster without PDL on its projections (same key): none since
# the trigger after the main loop (docs/experiments.md#the-late-trigger-from-two-rows).
NO_PDL_BUCKETS: set[tuple[int, int, int]] = set()


__all__ = [
    "CUBLAS",
    "FP8_TILES",
    "NO_PDL_BUCKETS",
    "REFERENCE_BUCKETS",
    "SEPARATE_NORM",
    "TILES",
    "Tile",
]
