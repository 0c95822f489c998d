"""RoPE on q and k plus the write of k and v into the paged KV cache, in one Triton kernel; and
the torch reference (``apply_rope`` + ``write_kv``), which is the model's path on the CPU.

Grid ``(T, n_heads + 2 * n_kv_heads)``: program ``(t, h)`` takes one head of token ``t`` from the
fused qkv row. Heads ``[0, n_heads)`` are query heads, rotated into ``q_out``; the next
``n_kv_heads`` are key heads, rotated into ``k_cache`` at slot ``slots[t]``; the last
``n_kv_heads`` are value heads, copied into ``v_cache`` at that slot. cos/sin are read from the
``[max_positions, head_dim]`` tables at ``positions[t]`` (no per-step gather kernel). The
rotation is in float32 with one rounding (the torch path rounds after each op).

With ``ssq`` (the norm handoff, ``kernels/proj/norm_handoff``) the row is a GEMM of ``x = r *
norm_w`` not yet scaled by ``r``'s 1 / RMS: each program takes that scale from the sums of
squares the writer of ``r`` left (``ssq_inv_rms``), multiplies its head by it and adds the
bias, in float32 before the rotation, so cuBLAS can take the handoff's ``x`` with no norm
kernel before it (the fused step's qkv at 33-64 rows).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...errors import ConfigError
from ..proj.norm_handoff import ssq_args, ssq_inv_rms
from .kv_write import write_kv


@triton.jit
def _rope_kv_kernel(
    qkv_ptr,
    positions_ptr,
    slots_ptr,
    cos_ptr,
    sin_ptr,
    q_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    stride_qkv_t,
    stride_q_t,
    stride_cos,
    stride_cache_slot,
    ssq_ptr,
    stride_sm,
    n_parts,
    hidden,
    eps,
    bias_ptr,
    N_HEADS: tl.constexpr,
    N_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    SSQ_PAD: tl.constexpr = 0,  # > 0: the row scaled by 1 / RMS from the sums of squares
    HAS_BIAS: tl.constexpr = False,  # the bias added (after the scale)
):
    tok = tl.program_id(0)
    head = tl.program_id(1)  # q heads, then k heads, then v heads
    d = tl.arange(0, HALF)
    src = qkv_ptr + tok * stride_qkv_t + head * HEAD_DIM  # q | k | v are stacked on the row
    x1 = tl.load(src + d)  # [HALF], first half of the head
    x2 = tl.load(src + HALF + d)  # [HALF], second half
    slot = tl.load(slots_ptr + tok).to(tl.int64)
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    if SSQ_PAD > 0:  # the GEMM of r * norm_w: now the row's 1 / RMS
        inv_rms = ssq_inv_rms(ssq_ptr + tok * stride_sm, 0, 1, n_parts, hidden, eps, 1, SSQ_PAD)
        x1f, x2f = x1f * inv_rms, x2f * inv_rms
    if HAS_BIAS:
        x1f += tl.load(bias_ptr + head * HEAD_DIM + d).to(tl.float32)
        x2f += tl.load(bias_ptr + head * HEAD_DIM + HALF + d).to(tl.float32)
    if head >= N_HEADS + N_KV:  # -- value head: copy into the cache --
        dst = v_cache_ptr + slot * stride_cache_slot + (head - N_HEADS - N_KV) * HEAD_DIM
        tl.store(dst + d, x1f.to(x1.dtype))  # x1 itself unless scaled or biased
        tl.store(dst + HALF + d, x2f.to(x1.dtype))
    else:  # -- query or key head: rotate-half RoPE at this token's position --
        pos = tl.load(positions_ptr + tok).to(tl.int64)
        c1 = tl.load(cos_ptr + pos * stride_cos + d).to(tl.float32)
        c2 = tl.load(cos_ptr + pos * stride_cos + HALF + d).to(tl.float32)
        s1 = tl.load(sin_ptr + pos * stride_cos + d).to(tl.float32)
        s2 = tl.load(sin_ptr + pos * stride_cos + HALF + d).to(tl.float32)
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
    *,
    ssq: torch.Tensor | None = None,  # [>= T, parts] float32: qkv is (r * norm_w) @ W^T
    hidden: int = 0,  # r's width (with ssq)
    eps: float = 0.0,  # the norm's epsilon (with ssq)
    bias: torch.Tensor | None = None,  # [(n_heads + 2 * n_kv) * head_dim], added after
) -> torch.Tensor:  # [T, n_heads, head_dim], rotated q
    """Rotate q and k, store k and v at ``slots`` of the caches, return q: one launch.

    ``ssq``: each row of ``qkv`` is first multiplied by ``rsqrt(sum(ssq[t]) / hidden + eps)``,
    the 1 / RMS of the ``r`` whose ``r * norm_w`` the GEMM took (``norm_handoff``); ``bias`` is
    then added. Slots are not bounds-checked on the device (that would sync); as for
    ``write_kv``, padded graph rows must point at scratch slots."""
    t = qkv.shape[0]
    n_kv, hd = k_cache.shape[2], k_cache.shape[3]
    if ssq is not None and (type(hidden) is not int or hidden < 1):
        raise ConfigError(f"rope_kv: ssq needs hidden, r's width (an int >= 1), got {hidden!r}")
    width = (n_heads + 2 * n_kv) * hd
    if bias is not None and (tuple(bias.shape) != (width,) or bias.dtype != qkv.dtype):
        raise ConfigError(
            f"rope_kv: bias must be [{width}] in {qkv.dtype}, got {tuple(bias.shape)} {bias.dtype}"
        )
    sums, stride_s, n_parts, ssq_pad = ssq_args(ssq, t, qkv)
    q = torch.empty(t, n_heads, hd, dtype=qkv.dtype, device=qkv.device)
    if t:
        _rope_kv_kernel[(t, n_heads + 2 * n_kv)](
            qkv,
            positions,
            slots,
            cos_table,
            sin_table,
            q,
            k_cache,
            v_cache,
            qkv.stride(0),
            q.stride(0),
            cos_table.stride(0),
            k_cache.stride(1),
            sums,
            stride_s,
            n_parts,
            hidden,
            float(eps),
            bias if bias is not None else qkv,
            N_HEADS=n_heads,
            N_KV=n_kv,
            HEAD_DIM=hd,
            HALF=hd // 2,
            SSQ_PAD=ssq_pad,
            HAS_BIAS=bias is not None,
            num_warps=1,
        )
    return q


__all__ = ["apply_rope", "rope_kv", "rope_kv_reference"]
