"""Write the new token's keys and values into the paged KV cache (one torch op each, no host
sync, so it can be captured in a CUDA graph)."""

from __future__ import annotations

import torch

from ...errors import ConfigError


def write_kv(
    k_cache: torch.Tensor,  # [num_pages, page_size, n_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_pages, page_size, n_kv_heads, head_dim]
    k: torch.Tensor,  # [bs, n_kv_heads, head_dim]
    v: torch.Tensor,  # [bs, n_kv_heads, head_dim]
    out_cache_loc: torch.Tensor,  # [bs] int64, flat slot = page * page_size + offset
) -> None:
    """Store ``k[i]``, ``v[i]`` at slot ``out_cache_loc[i]`` of the caches, in place.

    Slots must be distinct (padded rows of a graph batch point at a reserved scratch slot each,
    or at one shared scratch slot whose content nobody reads). Slot bounds are not checked on
    the device (that would sync); an out-of-range slot is a device-side indexing error.
    """
    if k_cache.dim() != 4 or tuple(v_cache.shape) != tuple(k_cache.shape):
        raise ConfigError(
            f"write_kv: k_cache and v_cache must both be [num_pages, page_size, n_kv_heads, "
            f"head_dim], got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    n_kv, hd = k_cache.shape[2], k_cache.shape[3]
    bs = out_cache_loc.shape[0] if out_cache_loc.dim() == 1 else -1
    for name, t in (("k", k), ("v", v)):
        if tuple(t.shape) != (bs, n_kv, hd):
            raise ConfigError(
                f"write_kv: {name} must be [{bs}, {n_kv}, {hd}] (out_cache_loc has {bs} rows), "
                f"got {tuple(t.shape)}"
            )
        if t.dtype != k_cache.dtype or t.device != k_cache.device:
            raise ConfigError(
                f"write_kv: {name} must be {k_cache.dtype} on {k_cache.device} like the cache, "
                f"got {t.dtype} on {t.device}; cast it first"
            )
    if out_cache_loc.dtype != torch.int64 or out_cache_loc.device != k_cache.device:
        raise ConfigError(
            f"write_kv: out_cache_loc must be a [bs] torch.int64 tensor on {k_cache.device}, "
            f"got {out_cache_loc.dtype} {tuple(out_cache_loc.shape)} on {out_cache_loc.device}"
        )
    k_cache.view(-1, n_kv, hd).index_copy_(0, out_cache_loc, k)
    v_cache.view(-1, n_kv, hd).index_copy_(0, out_cache_loc, v)


__all__ = ["write_kv"]
