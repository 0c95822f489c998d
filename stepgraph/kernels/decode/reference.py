"""Plain torch decode attention over a paged KV cache: the reference of the Triton kernel in the
tests, and the attention of the model on the CPU. It gathers each request's pages and runs a
softmax per request (a loop over the batch: simple, correct for any GQA ratio)."""

from __future__ import annotations

import math

import torch


def gather_kv(
    cache: torch.Tensor,  # [num_pages, page_size, n_kv_heads, head_dim]
    pages: torch.Tensor,  # [max_pages] int32, one row of the block table
    seq_len: int,
) -> torch.Tensor:  # [seq_len, n_kv_heads, head_dim]
    """The first ``seq_len`` keys (or values) of one request, in logical order."""
    page_size = cache.shape[1]
    n_pages = -(-seq_len // page_size)
    idx = pages[:n_pages].to(device=cache.device, dtype=torch.long)
    return cache[idx].flatten(0, 1)[:seq_len]


def paged_decode_reference(
    q: torch.Tensor,  # [bs, n_heads, head_dim]
    k_cache: torch.Tensor,  # [num_pages, page_size, n_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_pages, page_size, n_kv_heads, head_dim]
    block_table: torch.Tensor,  # [bs, max_pages] int32
    seq_lens: torch.Tensor,  # [bs] int32
    sm_scale: float | None = None,
    *,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:  # [bs, n_heads, head_dim]
    """Attention of each request's query over its ``seq_lens[b]`` cached keys.

    Computes in ``compute_dtype`` (default: float32, or q.dtype when wider) and returns that
    dtype when ``compute_dtype`` is given, q.dtype otherwise. Query head ``h`` reads KV head
    ``h // (n_heads // n_kv_heads)``. A request of length 0 gets zeros.
    """
    bs, n_heads, head_dim = q.shape
    n_kv_heads = k_cache.shape[2]
    group = n_heads // n_kv_heads
    dtype = compute_dtype or torch.promote_types(q.dtype, torch.float32)
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)
    lens = seq_lens.tolist()
    out = torch.zeros(bs, n_heads, head_dim, dtype=dtype, device=q.device)
    for b in range(bs):
        if lens[b] == 0:
            continue
        k = gather_kv(k_cache, block_table[b], lens[b]).to(dtype)  # [L, n_kv, hd]
        v = gather_kv(v_cache, block_table[b], lens[b]).to(dtype)  # [L, n_kv, hd]
        qb = q[b].to(dtype).view(n_kv_heads, group, head_dim)  # [n_kv, group, hd]
        scores = torch.einsum("kgd,lkd->kgl", qb, k) * scale  # [n_kv, group, L]
        probs = torch.softmax(scores, dim=-1)
        out[b] = torch.einsum("kgl,lkd->kgd", probs, v).reshape(n_heads, head_dim)
    return out if compute_dtype is not None else out.to(q.dtype)


__all__ = ["gather_kv", "paged_decode_reference"]
