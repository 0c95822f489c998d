"""Decode kernels: Triton split-KV attention over a paged KV cache, its split ladder, the torch
reference, and the KV-cache write.

The Triton launcher lives in ``stepgraph.kernels.decode.flash_decode`` (import it from there:
``from stepgraph.kernels.decode.flash_decode import flash_decode, DecodeWorkspace``). It is not
re-exported here, so the function never shadows its module, and importing the pure parts
(``splits``) does not load Triton.

Subpackages by role: ``decode`` (decode attention and its split ladder), ``prefill`` (prefill
attention over a cached prefix), ``proj`` (the fused step's projections and their tiles),
``sampling`` (greedy argmax inside the step), ``elementwise`` (add + RMSNorm, SiLU * up, RoPE, the
KV write); ``pdl`` (programmatic dependent launch) serves them all.
"""

from __future__ import annotations

from .decode.reference import paged_decode_reference
from .decode.splits import BLOCK_N, MIN_SPLIT_KEYS, fa_split_keys, ladder_steps, num_splits_for
from .elementwise.kv_write import write_kv

__all__ = [
    "BLOCK_N",
    "MIN_SPLIT_KEYS",
    "fa_split_keys",
    "ladder_steps",
    "num_splits_for",
    "paged_decode_reference",
    "write_kv",
]
