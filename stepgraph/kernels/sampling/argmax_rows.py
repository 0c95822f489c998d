"""Greedy tokens of logits already in memory: ``torch.argmax(logits, -1)`` in two small launches.

Where the step's LM head is a cuBLAS GEMM (the reference rows of the fused step, and its
head's cuBLAS pieces at 33-64 rows), torch's argmax over ``[bs, 128256]`` float32 is one launch
with a few programs per row, slow for its bytes (docs/experiments.md#argmax-folding). Here:

1. ``_argmax_part_kernel``, grid ``(M, P)``: each program takes ``BLOCK_V`` columns of a row and
   writes the largest key and the first column holding it.
2. ``_argmax_keys_kernel``, grid ``(M,)``: the largest of the ``P`` keys, the smallest column
   among its ties.

The keys order floats as ``torch.argmax`` does: the float32 bits made monotone (negative
values' magnitude bits flipped), ``-0.0`` the same key as ``+0.0`` (they compare equal), and
every NaN above ``+inf`` (torch takes a NaN as the maximum). So the token is torch's, the first
occurrence on ties included, for every input (``tests/test_argmax_rows.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...tuning import DecodeTuning
from ..launch_math import cdiv, next_pow2
from ..pdl import launch_options, pdl_wait_then_trigger_short, resolve_pdl

BLOCK_V = 4096  # columns a program of the first launch reads: 32 programs a row at vocab 128256


@triton.jit
def _argmax_part_kernel(
    x_ptr,
    key_ptr,
    idx_ptr,
    V,
    stride_xm,
    P,
    USE_PDL: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0)
    part = tl.program_id(1)
    pdl_wait_then_trigger_short(USE_PDL)  # the logits are the predecessor's output
    cols = part * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = cols < V
    v = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
    bits = v.to(tl.int32, bitcast=True)
    bits = tl.where(bits == -2147483648, 0, bits)  # -0.0 is +0.0
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # monotone in the float's value
    key = tl.where(v != v, 2147483647, key)  # NaN: the maximum, as torch takes it
    key = tl.where(mask, key, -2147483648)
    top = tl.max(key, axis=0)
    first = tl.min(tl.where(key == top, cols, 2147483647), axis=0)
    tl.store(key_ptr + row * P + part, top)
    tl.store(idx_ptr + row * P + part, first)


@triton.jit
def _argmax_keys_kernel(
    key_ptr,
    idx_ptr,
    out_ptr,
    P,
    USE_PDL: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    row = tl.program_id(0)
    pdl_wait_then_trigger_short(USE_PDL)
    offs = tl.arange(0, BLOCK_P)
    best_key = tl.full((BLOCK_P,), -2147483648, dtype=tl.int32)
    best_idx = tl.full((BLOCK_P,), 2147483647, dtype=tl.int32)
    for p0 in range(0, P, BLOCK_P):
        mask = (p0 + offs) < P
        k = tl.load(key_ptr + row * P + p0 + offs, mask=mask, other=-2147483648)
        i = tl.load(idx_ptr + row * P + p0 + offs, mask=mask, other=2147483647)
        better = k > best_key  # strictly: a lane keeps its earlier (smaller-column) part on ties
        best_key = tl.where(better, k, best_key)
        best_idx = tl.where(better, i, best_idx)
    top = tl.max(best_key, axis=0)
    first = tl.min(tl.where(best_key == top, best_idx, 2147483647), axis=0)
    tl.store(out_ptr + row, first.to(tl.int64))


def argmax_rows(
    logits: torch.Tensor,  # [M, V] float32, bf16 or fp16; the last dimension contiguous
    out: torch.Tensor | None = None,  # [M] int64 (a graph's static buffer)
    *,
    use_pdl: bool | None = None,
    block_v: int = BLOCK_V,
    tuning: DecodeTuning | None = None,  # its PDL; None: the default
) -> torch.Tensor:  # [M] int64: torch.argmax(logits, -1)
    """``torch.argmax(logits, -1)``, into ``out`` when given. Graph-capturable: the partials'
    buffers are allocated inside the step (the graph's pool holds them)."""
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"argmax_rows takes [M, V] logits, rows contiguous; got {logits.shape}")
    m, v = logits.shape
    if v < 1 or v > 2**31 - 1:
        raise ValueError(f"argmax_rows needs 1 <= V < 2**31 columns, got {v}")
    tokens = out if out is not None else logits.new_empty(m, dtype=torch.int64)
    if m == 0:
        return tokens
    parts = cdiv(v, block_v)
    keys = torch.empty(m, parts, dtype=torch.int32, device=logits.device)
    cols = torch.empty(m, parts, dtype=torch.int32, device=logits.device)
    pdl = resolve_pdl(use_pdl, logits.device, tuning)
    _argmax_part_kernel[(m, parts)](
        logits,
        keys,
        cols,
        v,
        logits.stride(0),
        parts,
        USE_PDL=pdl,
        BLOCK_V=block_v,
        num_warps=8,
        **launch_options(pdl),
    )
    _argmax_keys_kernel[(m,)](
        keys,
        cols,
        tokens,
        parts,
        USE_PDL=pdl,
        BLOCK_P=min(1024, next_pow2(parts)),
        num_warps=1,
        **launch_options(pdl),
    )
    return tokens


__all__ = ["BLOCK_V", "argmax_rows"]
