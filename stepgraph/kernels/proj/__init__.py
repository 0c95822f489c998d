"""The projections of the fused decode step and their tiles: the GEMVs with a norm
prologue or a residual epilogue, qkv + RoPE, gate-up + SiLU, the cuBLAS head's scale,
the norm handoff; the measured tile tables and the TMA weight stream."""
