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


def rms64(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """RMSNorm in float64: ``w * x / sqrt(mean(x^2) + eps)``."""
    xd = x.double()
    return w.double() * xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps)


def check_qkv_rope(q, qkv, positions, cos_t, sin_t, caches, caches0, slots, n_heads, tol):
    """``qkv_rope``'s results against the float64 projection ``qkv`` ``[M, (heads + 2 kv) hd]``:
    ``q`` rotated, k rotated and v copied into ``caches`` (k, v) at ``slots``, every other slot
    as in ``caches0``. Relative errors below ``tol``."""
    from tests.conftest import rel_err

    k_cache, v_cache = caches
    m, (_, _, n_kv, hd) = q.shape[0], k_cache.shape
    qd, kd, vd = qkv.split([n_heads * hd, n_kv * hd, n_kv * hd], dim=-1)
    cos, sin = cos_t[positions].double(), sin_t[positions].double()
    assert rel_err(q, rope64(qd.view(m, n_heads, hd), cos, sin)) < tol
    k_flat, v_flat = k_cache.view(-1, n_kv, hd), v_cache.view(-1, n_kv, hd)
    assert rel_err(k_flat[slots], rope64(kd.view(m, n_kv, hd), cos, sin)) < tol
    assert rel_err(v_flat[slots], vd.view(m, n_kv, hd)) < tol
    untouched = torch.ones(k_flat.shape[0], dtype=torch.bool, device=k_flat.device)
    untouched[slots] = False
    for flat, c0 in zip((k_flat, v_flat), caches0):
        assert torch.equal(flat[untouched], c0.view(-1, n_kv, hd)[untouched])
