"""Prefill ("extend") attention of packed chunks over the paged KV cache: the one attention that
the eager prefill (``attention.PagedAttentionBackend``) and the piecewise prefill share.

Every chunk's new K/V are already in their pages when it runs. Query ``i`` of a chunk that
starts at position ``start`` attends to its request's keys ``0 .. start + i``, read through the
request's pages. On CUDA the Triton kernel ``kernels.prefill.extend_attention`` does it in one
launch; the torch path (``kernels.prefill.extend_reference``: one SDPA per chunk over the gathered
keys) serves the CPU and any head size the kernel does not take.
"""

from __future__ import annotations

import contextlib

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from ...kernels.prefill.extend_attention import extend_attention as extend_kernel
from ...kernels.prefill.extend_inputs import HEAD_DIMS
from ...kernels.prefill.extend_reference import extend_attention_torch
from .extend_batch import ExtendBatch

# Not cuDNN's SDPA: it builds and caches an execution plan per new shape, and prompts come in
# every length. Measured on the H200 (benchmarks/soak.py, 100k tokens, prompts of 1..512):
# host RSS grew 656 MiB at 2988 tok/s with it; without it, 4 MiB at 4658 tok/s.
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _backends(t: torch.Tensor) -> contextlib.AbstractContextManager:
    return sdpa_kernel(SDPA_BACKENDS) if t.is_cuda else contextlib.nullcontext()


def extend_attention(
    q: torch.Tensor,  # [T, n_heads, head_dim], rotated, chunk after chunk
    k_cache: torch.Tensor,  # [num_pages, page_size, n_kv_heads, head_dim], new K/V written
    v_cache: torch.Tensor,  # [num_pages, page_size, n_kv_heads, head_dim]
    batch: ExtendBatch,
    scale: float,
) -> torch.Tensor:  # [T, n_heads, head_dim]
    """Each chunk over its request's prefix and itself, causally (module docstring): the Triton
    kernel on CUDA for the head sizes it takes, else one SDPA per chunk."""
    if q.is_cuda and q.shape[-1] in HEAD_DIMS:
        return extend_kernel(
            q,
            k_cache,
            v_cache,
            batch.qo_indptr,
            batch.kv_lens,
            batch.block_table,
            max_q_len=batch.max_q_len,
            sm_scale=scale,
        )
    live = sum(batch.q_lens)  # a graph's padded rows past it (GraphPrefill) stay zero
    with _backends(q):
        o = extend_attention_torch(
            q[:live], k_cache, v_cache, batch.q_lens, batch.kv_lens_host, batch.pages, scale
        )
    return o if live == q.shape[0] else torch.cat([o, o.new_zeros(q.shape[0] - live, *o.shape[1:])])


__all__ = ["SDPA_BACKENDS", "extend_attention"]
