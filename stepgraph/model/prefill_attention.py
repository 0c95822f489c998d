"""Causal attention of packed prompts, each over its own tokens: the one prefill attention that
the eager prefill (``attention.PagedAttentionBackend``) and the piecewise prefill share."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

MASKED_ATTENTION_MAX_TOKENS = 256  # above: one causal SDPA per prompt instead of one masked

# Not cuDNN's SDPA: it builds and caches an execution plan per new shape, and prompts come in
# every length. Measured on the H200 (benchmarks/soak.py, 100k tokens, prompts of 1..512):
# host RSS grew 656 MiB at 2988 tok/s with it; without it, 4 MiB at 4658 tok/s.
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _backends(t: torch.Tensor) -> contextlib.AbstractContextManager:
    return sdpa_kernel(SDPA_BACKENDS) if t.is_cuda else contextlib.nullcontext()


def prefill_attention(
    q: torch.Tensor,  # [n, n_heads, head_dim]: every prompt's rows, packed in order
    k: torch.Tensor,  # [n, n_kv_heads, head_dim], rotated
    v: torch.Tensor,  # [n, n_kv_heads, head_dim]
    lens: Sequence[int],  # tokens per prompt, summing to n
    scale: float,
    mask: torch.Tensor | None = None,  # [n, n] bool, from block_causal_mask (or None)
) -> torch.Tensor:  # [n, n_heads, head_dim]
    """Each prompt attends causally to its own tokens. With ``mask`` (several short prompts),
    one SDPA over all of them with KV heads expanded; else one causal SDPA per prompt, query head
    ``h`` reading KV head ``h // group`` (as transformers computes it)."""
    with _backends(q):
        return _attend(q, k, v, lens, scale, mask)


def _attend(q, k, v, lens, scale, mask) -> torch.Tensor:  # shapes as prefill_attention
    if mask is not None:
        group = q.shape[1] // k.shape[1]
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],  # [1, H, n, hd]
            k.repeat_interleave(group, dim=1).transpose(0, 1)[None],
            v.repeat_interleave(group, dim=1).transpose(0, 1)[None],
            attn_mask=mask,
            scale=scale,
        )
        return o[0].transpose(0, 1)
    outs, start = [], 0
    for m in lens:
        sl = slice(start, start + m)
        o = F.scaled_dot_product_attention(
            q[sl].transpose(0, 1)[None],  # [1, H, m, hd]
            k[sl].transpose(0, 1)[None],
            v[sl].transpose(0, 1)[None],
            is_causal=True,
            scale=scale,
            enable_gqa=True,
        )
        outs.append(o[0].transpose(0, 1))
        start += m
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def block_causal_mask(
    lens: Sequence[int],
    positions: torch.Tensor,  # [n] int64, each prompt from 0
    segment: torch.Tensor,  # [n] int64, the prompt of each row
) -> torch.Tensor | None:  # [n, n] bool
    """The block-diagonal causal mask of packed prompts; ``None`` for one prompt or more than
    ``MASKED_ATTENTION_MAX_TOKENS`` rows (then per-prompt SDPA is cheaper than an n x n mask)."""
    if len(lens) == 1 or sum(lens) > MASKED_ATTENTION_MAX_TOKENS:
        return None
    return (segment[:, None] == segment[None, :]) & (positions[:, None] >= positions[None, :])
