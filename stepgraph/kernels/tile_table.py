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
    # descriptor; 2 x @ w^T, the weight by descriptor and x from pointers (a register operand)

    def launch(self) -> dict:
        """The launch options: ``num_warps``, and ``num_stages`` when set."""
        opts = {"num_warps": self.num_warps}
        if self.num_stages is not None:
            opts["num_stages"] = self.num_stages
        return opts


# (kernel, n, k, BLOCK_M) -> Tile, at Llama-3.2-1B's shapes (n: weight rows, all of them). A key
# with 4 in place of BLOCK_M would serve 2-4 rows before the key with 16 (proj_tiles.table_rows).
# The 1B had two (o_proj Tile(32, 512, 4, 1, 4), gate-up _normed three stages: faster at bucket 4
# in runs H9-H10); with the late PDL trigger and the handoff from bucket 2 the 16-row tiles won
# there (benchmarks/ab_step.py, three interleaved rounds, graph, ctx 512, run J3: bs 3 0.966 ms
# against 1.014 with them, bs 4 0.973 against 1.021).
# Measured on the H200 (benchmarks/proj_sweep.py, bf16, PDL on, 16 calls over 16 weights, µs
# per call; 2026-12-01, rounds 2-4: round 4 with the TMA tiles, Tile(..., tma), whose figures
# follow; the sweeps vary by about 3% run to run); see docs/results.md, "decode kernels bs 2-64
# (issue 21)". Round 4 kept TMA for down (swap-AB: 11.70 / 12.30 / 13.91 against the pointer
# tiles' 12.06 / 12.84 / 15.12 in the same run) and the LM head at 16 rows (141.09 vs 144.24).
_QKV, _GU, _O, _DOWN, _LM = (3072, 2048), (16384, 2048), (2048, 2048), (2048, 8192), (128256, 2048)
TILES: dict[tuple[str, int, int, int], Tile] = {
    ("qkv_rope", *_QKV, 16): Tile(32, 256, 4, 3, 4),  # 9.04 (cuBLAS GEMM alone 6.52)
    ("qkv_rope", *_QKV, 32): Tile(16, 128, 4, 3, 4),  # 14.52 (6.58); SEPARATE_NORM below
    ("qkv_rope", *_QKV, 64): Tile(32, 128, 4, 3, 4),  # 21.53 (6.76): CUBLAS below
    # 2-16 rows: four splits of K, 256 programs (run E9, ab_step, two interleaved rounds, graph
    # ms against two splits: ctx 512 bs 5 0.972 / 0.980, bs 8 0.987 / 0.995, bs 16 1.042 /
    # 1.047; ctx 4096 bs 8 1.215 / 1.219, bs 16 1.482 / 1.488; 2-4 rows not measured with
    # it); two splits since H9-H10
    ("gemv_residual", *_O, 16): Tile(32, 128, 4, 4, 4, 2),
    # 17-64 rows: the weight through TMA as at 16 (run I7, ab_step, three interleaved rounds:
    # bs 32 1.190 against 1.197 ms, bs 64 1.327 against 1.337; same logits bits). The sweep's
    # pointer tile Tile(32, 128, 4, 4, 2): 5.79 / 6.46 µs a call (cuBLAS 6.19 / 6.32)
    ("gemv_residual", *_O, 32): Tile(32, 128, 4, 4, 2, 2),
    ("gemv_residual", *_O, 64): Tile(32, 128, 4, 4, 2, 2),
    ("gate_up_silu", *_GU, 16): Tile(64, 128, 8, 4, 1),  # 20.67 (18.57)
    ("gate_up_silu", *_GU, 32): Tile(64, 128, 8, 4, 1),  # 24.48 (19.03)
    ("gate_up_silu", *_GU, 64): Tile(64, 128, 8, 3, 1),  # 35.28 (19.53): CUBLAS below
    ("gemv_residual", *_DOWN, 16): Tile(64, 128, 4, 5, 4, 1),  # 11.70 (13.44)
    ("gemv_residual", *_DOWN, 32): Tile(64, 128, 4, 5, 4, 1),  # 12.30 (13.95)
    ("gemv_residual", *_DOWN, 64): Tile(64, 128, 4, 5, 4, 1),  # 13.91 (14.23)
    ("lm_head", *_LM, 16): Tile(256, 64, 8, 3, 1, 2),  # 141.09 (144.22)
    ("lm_head", *_LM, 32): Tile(256, 64, 8, 3, 1, 1),  # 158.59 (150.42); in the step, I2-I3
    ("lm_head", *_LM, 64): Tile(128, 64, 4, 4, 1, 2),  # 211.55 (162.74): CUBLAS below
    # x normed by its own kernel (SEPARATE_NORM below; round 5, 2026-12-01: cuBLAS GEMM alone
    # 6.54 / 6.61 / 6.76 for qkv and 18.54 / 19.00 / 19.50 for gate-up at 16 / 32 / 64 rows)
    ("qkv_rope_normed", *_QKV, 16): Tile(32, 256, 4, 3, 4),  # 7.14
    ("qkv_rope_normed", *_QKV, 32): Tile(16, 128, 4, 5, 4, 1),  # I3, five stages (3: 8.04)
    ("qkv_rope_normed", *_QKV, 64): Tile(16, 64, 4, 3, 2),  # 10.74
    ("gate_up_silu_normed", *_GU, 16): Tile(64, 128, 4, 4, 1, 1),  # H9-H10 (see above)
    ("gate_up_silu_normed", *_GU, 32): Tile(64, 128, 4, 3, 1, 1),  # 18.32
    ("gate_up_silu_normed", *_GU, 64): Tile(64, 128, 4, 3, 1, 1),  # 19.46
}
# Where the unfused pieces win: RMSNorm kernel + cuBLAS + RoPE/KV-write (or SiLU·mul) kernel,
# about 3.2-3.5 µs of small kernels plus two launches beside the GEMM (the reference step's
# profile, bs 8), against the fused kernel above: qkv 6.6 + ~5.5 vs 14.5 at 32 rows and 6.8 +
# ~5.5 vs 21.5 at 64; gate-up 19.5 + ~5 vs 35.3 at 64 (at 32: 19.0 + ~5 vs 24.5, a tie: fused);
# the LM head's norm + cuBLAS + argmax_rows (~8 µs beside the GEMM): 150.4 + 8 vs 158.6 at 32
# rows (a tie) and 162.7 + 8 vs 211.6 at 64.
# With the norm handoff (from bucket 8 on) gate-up at 64 rows streams the activation as the
# _normed variant does, with no norm kernel (19.46 µs against 19.5 + ~3.2), so it runs fused:
# bench, graph, ctx 512 (run F7), bs 48 1.307 ms against 1.368 on cuBLAS, bs 64 1.405 against
# 1.467. qkv fused the same way lost in the step at 48-64 rows: bs 64 1.450 against 1.405 (F7);
# again with 2-8 stages, 2-8 splits and TMA (ab_step.py, interleaved rounds, graph, ctx 512,
# runs I2-I3): at best bs 48 1.319 against 1.286, bs 64 1.389 against 1.378. At 17-32 rows qkv
# and the LM head run fused since I2-I3 (the same runs): qkv with five stages and the LM head's
# tile above, bs 32 1.212-1.213 ms against 1.234-1.235 on cuBLAS, 99 kernels a step against 134
# (three stages: 1.263; four: 1.219; six or eight: 1.268-1.273; qkv alone fused: 1.235).
CUBLAS: set[tuple[str, int, int, int]] = {("qkv_rope", *_QKV, 64), ("lm_head", *_LM, 64)}

# Llama-3.1-8B at 8 rows (BLOCK_M 16), round 6 (run F4, 2026-12-01, proj_sweep.py --preset
# llama-3.1-8b --rows 8; µs, cuBLAS GEMM alone in brackets). In the step (bench --model
# llama-3.1-8b, bs 8, ctx 4096, graph): 5.488 ms with these tiles and qkv on cuBLAS, 5.547 with
# qkv fused, 5.563 on the reference kernels. Rows 17-64 are not measured (reference kernels).
_Q8, _GU8, _O8, _D8, _LM8 = (6144, 4096), (28672, 4096), (4096, 4096), (4096, 14336), (128256, 4096)
TILES.update({
    ("qkv_rope", *_Q8, 16): Tile(32, 128, 4, 3, 4, 1),  # 23.23 (15.78): CUBLAS below
    ("qkv_rope_normed", *_Q8, 16): Tile(32, 256, 4, 3, 4),  # 19.74 (15.65)
    # o_proj and gate-up on the handoff: run K6 (ab_step.py --model llama-3.1-8b, ctx 4096, two
    # interleaved rounds, graph ms, against the sweep's Tile(32, 128, 4, 4, 2) and Tile(32,
    # 128, 4, 5, 1, 1)): bs 2 4.541 / 4.676, bs 4 4.792 / 4.929, bs 8 5.298 / 5.420, bs 16
    # 6.326 / 6.447 (o_proj's alone 4.632 / 4.880 / 5.374 / 6.399; gate-up with three or five
    # stages 5.323 / 5.310 at bs 8, eight warps 5.347; run K5 at bs 8, another machine: 5.229
    # against 5.355). Before, each ran about 5 µs a layer over its bytes (K3's timeline, bs 8).
    ("gemv_residual", *_O8, 16): Tile(64, 128, 4, 4, 4, 1),  # the sweep's pointer tile 11.99
    ("gemv_residual", *_D8, 16): Tile(64, 128, 4, 5, 4, 1),  # 32.06 (32.42)
    ("gate_up_silu", *_GU8, 16): Tile(64, 128, 4, 3, 1, 2),  # 65.48 (57.26)
    ("gate_up_silu_normed", *_GU8, 16): Tile(64, 128, 4, 4, 1, 1),  # the sweep's 32-row 59.08
    ("lm_head", *_LM8, 16): Tile(128, 128, 4, 4),  # 272.19 (284.38)
})  # fmt: skip
CUBLAS.add(("qkv_rope", *_Q8, 16))

# Where the norm runs as its own kernel (add_rmsnorm) before the fused kernel's ``_normed``
# variant (no prologue: the activation streams as it is). Measured in the step (stepgraph
# bench, graph, ctx 512, 2026-12-01, one call, against the reference kernels): bs 4 1.066 vs
# 1.076, bs 8 1.105 vs 1.122, bs 16 1.169 vs 1.204, bs 32 1.278 vs 1.309 (qkv there on CUBLAS);
# with the norm prologue the fused kernels had tied or lost (docs/results.md, E3 and E5).
# qkv at 32 rows (its layer 0 alone: the handoff serves the others), normed with the embedding
# (embed_rmsnorm) and then the five-stage _normed tile, against the norm prologue: ab_step,
# run I4, bs 24 1.152 against 1.162 ms, bs 32 1.194 against 1.201.
SEPARATE_NORM: set[tuple[str, int, int, int]] = {
    ("qkv_rope", *_QKV, 16), ("qkv_rope", *_QKV, 32), ("gate_up_silu", *_GU, 16),
    ("gate_up_silu", *_GU, 32),
    # gate-up at 64 rows with the handoff off: the _normed tile's 19.46 µs against 35.28 with
    # the norm prologue (not timed in the step: the handoff serves bucket 64)
    ("gate_up_silu", *_GU, 64),
}  # fmt: skip
# Llama-3.1-8B's gate-up with the norm handoff off (the handoff serves it from bucket 2): 59.08
# µs a call on x normed before against 65.48 with the norm prologue (round 6; not timed in the
# step)
SEPARATE_NORM.add(("gate_up_silu", *_GU8, 16))
# Buckets where a model measured faster on the reference kernels inside the step, though its
# tiles cover the rows (keyed by its fused qkv weight's shape): none since the late PDL trigger
# and the norm handoff from bucket 2. Llama-3.1-8B's bucket 4 was (run F6: 5.018 ms on the
# reference kernels against 5.073 on its tiles), and its bucket 2 ran them too (reference_rows);
# on its tiles now (benchmarks/ab_step.py, graph, ctx 4096, two interleaved rounds, run J9): bs 2
# 4.678 against 4.838 on the reference kernels, bs 4 4.929 against 5.085 (227 kernels, not 392).
REFERENCE_BUCKETS: set[tuple[int, int, int]] = set()
# Buckets where the step measured faster without PDL on its projections (same key): none since
# the trigger after the main loop (kernels/pdl.py, mode "late"). Llama-3.2-1B at 8 and 16 were
# (run G7: bs 8 1.102 ms against 1.117 with PDL, trigger at the wait); with the late trigger PDL
# wins there (benchmarks/ab_step.py, graph, ctx 512, run J1: bs 8 1.008 against 1.079 without,
# bs 16 1.059 against 1.130). Llama-3.1-8B at bs 8 ran faster with it (run G8).
NO_PDL_BUCKETS: set[tuple[int, int, int]] = set()


__all__ = ["CUBLAS", "NO_PDL_BUCKETS", "REFERENCE_BUCKETS", "SEPARATE_NORM", "TILES", "Tile"]
