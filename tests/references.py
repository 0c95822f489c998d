"""Float64 references written out in the tests, independent of the modules they check."""

from __future__ import annotations

import torch


def rope64(
    x: torch.Tensor,  # [T, heads, head_dim]
    cos: torch.Tensor,  # [T, head_dim]: angle i in columns i and i + head_dim / 2
    sin: torch.Tensor,  # [T, head_dim]
) -> torch.Tensor:  # [T, heads, head_dim] float64
    """Rotate-half RoPE, pair by pair: the pair (i, i + half) turns by angle i,
    (a, b) -> (a cos - b sin, b cos + a sin)."""
    x, cos, sin = x.double(), cos.double(), sin.double()
    half = x.shape[-1] // 2
    assert torch.equal(cos[:, :half], cos[:, half:]) and torch.equal(sin[:, :half], sin[:, half:])
    a, b = x[..., :half], x[..., half:]
    c, s = cos[:, None, :half], sin[:, None, :half]
    return torch.cat((a * c - b * s, b * c + a * s), dim=-1)
