"""Decode kernels: Triton split-KV attention over a paged KV cache, its split ladder, the torch
reference, and the KV-cache write.

The Triton launcher lives in ``stepgraph.kernels.flash_decode`` (import it from there:
``from stepgraph.kernels.flash_decode import flash_decode, DecodeWorkspace``). It is not
re-exported here, so the function never shadows its module, and importing the pure parts
(``splits``) does not load Triton.
"""

from __future__ import annotations

from .kv_write import write_kv
from .reference import paged_decode_reference
from .splits import BLOCK_N, MIN_SPLIT_KEYS, fa_split_keys, ladder_steps, num_splits_for

__all__ = [
    "BLOCK_N",
    "MIN_SPLIT_KEYS",
    "fa_split_keys",
    "ladder_steps",
    "num_splits_for",
    "paged_decode_reference",
    "write_kv",
]
