"""Kernels that stand alone on the reference path: add + RMSNorm, SiLU * up, RoPE with
the KV write, and the KV-cache write."""
