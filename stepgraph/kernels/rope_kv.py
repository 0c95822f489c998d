"""RoPE on q and k plus the write of k and v into the paged KV cache, in one Triton kernel; and
the torch reference (``apply_rope`` + ``write_kv``), which is the model's path on the CPU.

Grid ``(T, n_heads + 2 * n_kv_heads)``: program ``(t, h)`` takes one head of token ``t`` from the
fused qkv row. Heads ``[0, n_heads)`` are query heads, rotated into ``q_out``; the next
``n_kv_heads`` are key heads, rotated into ``k_cache`` at slot ``slots[t]``; the last
``n_kv_heads`` are value heads, copied into ``v_cache`` at that slot. cos/sin are read from the
``[max_positions, head_dim]`` tables at ``positions[t]`` (no per-step gather kernel). The
rotation is in float32 with one rounding (the torch path rounds after each op).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kv_write import write_kv


@triton.jit
def _rope_kv_kernel(
    qkv_ptr, positions_ptr, slots_ptr, cos_ptr, sin_ptr,
    q_out_ptr, k_cache_ptr, v_cache_ptr,
    stride_qkv_t, stride_q_t, stride_cos, stride_cache_slot,
    N_HEADS: tl.constexpr,
    N_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
):  # fmt: skip
    tok = tl.program_id(0)
    head = tl.program_id(1)  # q heads, then k heads, then v heads
    d = tl.arange(0, HALF)
    src = qkv_ptr + tok * stride_qkv_t + head * HEAD_DIM  # q | k | v are stacked on the row
    x1 = tl.load(src + d)  # [HALF], first half of the head
    x2 = tl.load(src + HALF + d)  # [HALF], second half
    slot = tl.load(slots_ptr + tok).to(tl.int64)
    if head >= N_HEADS + N_KV:  # -- value head: copy into the cache --
        dst = v_cache_ptr + slot * stride_cache_slot + (head - N_HEADS - N_KV) * HEAD_DIM
        tl.store(dst + d, x1)
        tl.store(dst + HALF + d, x2)
    else:  # -- query or key head: rotate-half RoPE at this token's position --
        pos = tl.load(positions_ptr + tok).to(tl.int64)
        c1 = tl.load(cos_ptr + pos * stride_cos + d).to(tl.float32)
        c2 = tl.load(cos_ptr + pos * stride_cos + HALF + d).to(tl.float32)
        s1 = tl.load(sin_ptr + pos * stride_cos + d).to(tl.float32)
        s2 = tl.load(sin_ptr + pos * stride_cos + HALF + d).to(tl.float32)
        x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
        o1 = (x1f * c1 - x2f * s1).to(x1.dtype)  # rotated = cat(-x2, x1)
        o2 = (x2f * c2 + x1f * s2).to(x1.dtype)
        if head < N_HEADS:
            dst = q_out_ptr + tok * stride_q_t + head * HEAD_DIM
        else:
            dst = k_cache_ptr + slot * stride_cache_slot + (head - N_HEADS) * HEAD_DIM
        tl.store(dst + d, o1)
        tl.store(dst + HALF + d, o2)


def apply_rope(
    x: torch.Tensor,  # [T, heads, head_dim]
    cos: torch.Tensor,  # [T, head_dim]
    sin: torch.Tensor,  # [T, head_dim]
) -> torch.Tensor:  # [T, heads, head_dim]
    """Rotate-half RoPE (the Hugging Face layout: pairs are (i, i + head_dim/2))."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def rope_kv_reference(
    qkv: torch.Tensor,  # [T, (n_heads + 2 * n_kv) * head_dim]
    positions: torch.Tensor,  # [T] int64
    cos_table: torch.Tensor,  # [max_positions, head_dim]
    sin_table: torch.Tensor,  # [max_positions, head_dim]
    k_cache: torch.Tensor,  # [num_pages, page_size, n_kv, head_dim]
    v_cache: torch.Tensor,  # [num_pages, page_size, n_kv, head_dim]
    slots: torch.Tensor,  # [T] int64
    n_heads: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # q, k (rotated), v: [T, heads, hd]
    """The unfused torch ops: split, rotate q and k, ``write_kv``. Returns q, k and v."""
    t = qkv.shape[0]
    n_kv, hd = k_cache.shape[2], k_cache.shape[3]
    q, k, v = qkv.split([n_heads * hd, n_kv * hd, n_kv * hd], dim=-1)
    cos, sin = cos_table[positions], sin_table[positions]  # [T, head_dim]
    q = apply_rope(q.view(t, n_heads, hd), cos, sin)  # [T, n_heads, hd]
    k = apply_rope(k.view(t, n_kv, hd), cos, sin)  # [T, n_kv, hd]
    v = v.view(t, n_kv, hd)  # [T, n_kv, hd]
    write_kv(k_cache, v_cache, k, v, slots)
    return q, k, v


def rope_kv(
    qkv: torch.Tensor,  # [T, (n_heads + 2 * n_kv) * head_dim], rows contiguous
    positions: torch.Tensor,  # [T] int64
    cos_table: torch.Tensor,  # [max_positions, head_dim], qkv's dtype
    sin_table: torch.Tensor,  # [max_positions, head_dim]
    k_cache: torch.Tensor,  # [num_pages, page_size, n_kv, head_dim], contiguous
    v_cache: torch.Tensor,  # [num_pages, page_size, n_kv, head_dim], contiguous
    slots: torch.Tensor,  # [T] int64, flat slot = page * page_size + offset
    n_heads: int,
) -> torch.Tensor:  # [T, n_heads, head_dim], rotated q
    """Rotate q and k, store k and v at ``slots`` of the caches, return q: one launch.

    Slots are not bounds-checked on the device (that would sync); as for ``write_kv``, padded
    graph rows must point at scratch slots."""
    t = qkv.shape[0]
    n_kv, hd = k_cache.shape[2], k_cache.shape[3]
    q = torch.empty(t, n_heads, hd, dtype=qkv.dtype, device=qkv.device)
    if t:
        _rope_kv_kernel[(t, n_heads + 2 * n_kv)](
            qkv, positions, slots, cos_table, sin_table,
            q, k_cache, v_cache,
            qkv.stride(0), q.stride(0), cos_table.stride(0), k_cache.stride(1),
            N_HEADS=n_heads, N_KV=n_kv, HEAD_DIM=hd, HALF=hd // 2,
            num_warps=1,
        )  # fmt: skip
    return q


__all__ = ["apply_rope", "rope_kv", "rope_kv_reference"]
