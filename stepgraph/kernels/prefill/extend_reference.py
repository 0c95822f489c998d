"""Plain torch prefill ("extend") attention over the paged KV cache: the float64 reference of the
Triton kernel in ``extend_attention.py``, and the fast path of the model on the CPU.

Both gather each request's keys and values through its block-table row (``gather_kv``); query
``i`` of request ``b`` sits at position ``prefix_len[b] + i`` and sees keys ``0 ..
prefix_len[b] + i``; query head ``h`` reads KV head ``h // (n_heads // n_kv_heads)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ...errors import ConfigError
from ..decode.reference import gather_kv


def extend_attention_reference(
    q: torch.Tensor,  # [T, n_heads, head_dim]
    k_cache: torch.Tensor,  # [num_pages, page_size, n_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_pages, page_size, n_kv_heads, head_dim]
    qo_indptr: torch.Tensor,  # [bs + 1] int: cumulative new tokens
    kv_lens: torch.Tensor,  # [bs] int: prefix_len + q_len
    block_table: torch.Tensor,  # [bs, max_pages] int
    sm_scale: float,
    *,
    max_q_len: int | None = None,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:  # [T, n_heads, head_dim] in ``dtype``
    """The independent reference: an explicit masked softmax per request, in ``dtype`` (default
    float64), on q's device. Reads the index tensors to the host (a sync: tests only).
    ``max_q_len``, when given, must be at least every ``q_len`` (the kernel's contract)."""
    total, n_heads, head_dim = q.shape
    n_kv_heads = k_cache.shape[2]
    group = n_heads // n_kv_heads
    starts = qo_indptr.tolist()
    lens = kv_lens.tolist()
    out = torch.zeros(total, n_heads, head_dim, dtype=dtype, device=q.device)
    for b, kv_len in enumerate(lens):
        q_len = starts[b + 1] - starts[b]
        if not 0 <= q_len <= kv_len or (max_q_len is not None and q_len > max_q_len):
            raise ConfigError(
                f"extend_attention_reference: request {b} has q_len={q_len}, kv_len={kv_len}, "
                f"max_q_len={max_q_len}; need 0 <= q_len <= kv_len and q_len <= max_q_len."
            )
        if q_len == 0:
            continue
        prefix = kv_len - q_len
        k = gather_kv(k_cache, block_table[b], kv_len).to(dtype)  # [kv_len, n_kv, hd]
        v = gather_kv(v_cache, block_table[b], kv_len).to(dtype)
        qb = q[starts[b] : starts[b + 1]].to(dtype).view(q_len, n_kv_heads, group, head_dim)
        scores = torch.einsum("qkgd,lkd->kgql", qb, k) * sm_scale  # [n_kv, group, q_len, kv_len]
        q_pos = prefix + torch.arange(q_len, device=q.device)
        visible = torch.arange(kv_len, device=q.device)[None, :] <= q_pos[:, None]
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        o = torch.einsum("kgql,lkd->qkgd", probs, v)  # [q_len, n_kv, group, hd]
        out[starts[b] : starts[b + 1]] = o.reshape(q_len, n_heads, head_dim)
    return out


def extend_attention_torch(
    q: torch.Tensor,  # [T, n_heads, head_dim], T = sum(q_lens)
    k_cache: torch.Tensor,  # [num_pages, page_size, n_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_pages, page_size, n_kv_heads, head_dim]
    q_lens: Sequence[int],  # host ints: new tokens per request
    kv_lens: Sequence[int],  # host ints: prefix_len + q_len per request
    pages: torch.Tensor | Sequence[Sequence[int]],  # block table [bs, max_pages], or page lists
    sm_scale: float,
    *,
    out: torch.Tensor | None = None,  # [T, n_heads, head_dim], q.dtype
) -> torch.Tensor:  # [T, n_heads, head_dim], q.dtype
    """The same attention at q's dtype through ``F.scaled_dot_product_attention``, one call per
    request: the model's attention on the CPU, where the Triton interpreter is too slow.

    Takes the lengths as host ints, so it reads nothing back from the device. ``pages`` is
    either the block table (an integer tensor on the cache's device, row ``b`` the pages of
    request ``b``) or one list of page ids per request; only the first
    ``cdiv(kv_lens[b], page_size)`` of each are read. Queries are packed by ``q_lens`` in
    order. A prefix of 0 takes SDPA's ``is_causal``; otherwise a boolean mask
    ``k_pos <= prefix + i`` (SDPA's own causal mask is top-left aligned).
    """
    total, n_heads, head_dim = q.shape
    if len(q_lens) != len(kv_lens) or sum(q_lens) != total:
        raise ConfigError(
            f"extend_attention_torch: q_lens {list(q_lens)} must sum to T={total} and match "
            f"kv_lens {list(kv_lens)} in length; pass one entry per request."
        )
    if out is None:
        out = torch.empty_like(q)
    page_size = k_cache.shape[1]
    start = 0
    for b, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens)):
        if q_len == 0:
            continue
        prefix = kv_len - q_len
        if prefix < 0:
            raise ConfigError(
                f"extend_attention_torch: request {b} has q_len={q_len} > kv_len={kv_len}; "
                "kv_len counts the prefix and the new tokens."
            )
        row = pages[b]
        if not isinstance(row, torch.Tensor):
            n_pages = -(-kv_len // page_size)
            row = torch.tensor(list(row[:n_pages]), dtype=torch.long, device=k_cache.device)
        k = gather_kv(k_cache, row, kv_len).transpose(0, 1)[None]  # [1, n_kv, kv_len, hd]
        v = gather_kv(v_cache, row, kv_len).transpose(0, 1)[None]
        qb = q[start : start + q_len].transpose(0, 1)[None]  # [1, n_heads, q_len, hd]
        mask = None
        if prefix > 0:
            q_pos = prefix + torch.arange(q_len, device=q.device)
            mask = torch.arange(kv_len, device=q.device)[None, :] <= q_pos[:, None]
        o = F.scaled_dot_product_attention(
            qb, k, v, attn_mask=mask, is_causal=mask is None, scale=sm_scale, enable_gqa=True
        )  # [1, n_heads, q_len, hd]
        out[start : start + q_len] = o[0].transpose(0, 1)
        start += q_len
    return out


__all__ = ["extend_attention_reference", "extend_attention_torch"]
