"""Prefill ("extend") attention over the paged KV cache: one Triton kernel and its launcher.

A packed batch of ``bs`` requests: request ``b`` has ``prefix_len[b]`` tokens cached and
``q_len[b] >= 1`` new ones, whose K/V are already written into its pages (``rope_kv`` writes all
T tokens in one launch). Query ``i`` of request ``b`` sits at position ``prefix_len[b] + i`` and
attends to keys ``0 .. prefix_len[b] + i`` of its own request, every key and value read through
the block table; one online softmax over prefix and new tokens, float32 accumulation.

``_extend_kernel``, grid ``(n_heads, cdiv(max_q_len, BLOCK_M), bs)``: one program takes
``BLOCK_M`` queries of one head of one request. Heads run fastest, so the GQA siblings reading
one KV head run side by side (their K/V tiles hit L2); q blocks run latest-first, the longest
programs start first. A program past its request's ``q_len`` exits at once. Keys are visited in
two runs of the same loop (``_attend_keys``, a ``MASKED`` constexpr): ``[0, full_end)``, which
every query of the block sees (no mask), then ``[full_end, causal_end)``, the diagonal band up to
the block's last query, masked per element. Designs learnt from (not copied): SGLang's Triton
``extend_attention`` (prefix then new tokens, one softmax) and vLLM's
``triton_unified_attention`` (block tables; ``k < (seq_len - query_len) + q + 1``).

The torch references (float64, and the fast path of the model on the CPU) are in
``extend_reference.py``; ``benchmarks/extend_attention.py`` times this against torch SDPA.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..launch_math import cdiv
from .extend_inputs import ExtendTile, check_extend_inputs

# -- the tile per (head_dim, dtype); any other shape gets FALLBACK_TILE (fp32: FP32_TILE) --
# Edit after reading `benchmarks/extend_attention.py --sweep` on the target GPU. The H200's
# sweep chose m64n64w4s2 for both head dims (docs/experiments.md#extend-attention-tiles); fp16
# takes bf16's tile (not measured).
_MEASURED = ExtendTile(block_m=64, block_n=64, num_warps=4, num_stages=2)
FALLBACK_TILE = _MEASURED  # hd 16, 32, 256: correct (tests/gpu), not tuned
FP32_TILE = ExtendTile(block_m=64, block_n=32, num_warps=4, num_stages=2)  # ieee dots: FMA
DEFAULT_TILES: dict[tuple[int, torch.dtype], ExtendTile] = {
    (hd, dt): _MEASURED for hd in (64, 128) for dt in (torch.bfloat16, torch.float16)
}


def default_tile(head_dim: int, dtype: torch.dtype) -> ExtendTile:
    """The tile ``extend_attention`` launches when no ``tile`` is given."""
    if dtype == torch.float32:
        return FP32_TILE
    return DEFAULT_TILES.get((head_dim, dtype), FALLBACK_TILE)


@triton.jit
def _attend_keys(
    acc,  # [BLOCK_M, HEAD_DIM] fp32: the running state with l_i and m_i
    l_i,  # [BLOCK_M] fp32
    m_i,  # [BLOCK_M] fp32
    q,  # [BLOCK_M, HEAD_DIM]
    q_pos,  # [BLOCK_M] absolute position of each query
    k_head,  # K cache pointer, offset to this program's KV head
    v_head,  # V cache pointer, offset to this program's KV head
    bt_row,  # this request's block-table row
    start,  # keys [start, end); start is a multiple of BLOCK_N
    end,
    qk_scale,  # sm_scale * log2(e) > 0: the softmax runs on exp2
    stride_kp,
    stride_ks,
    stride_vp,
    stride_vs,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,  # the diagonal band: mask keys past each query and past `end`
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    for start_n in tl.range(start, end, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        k_idx = start_n + offs_n  # [BLOCK_N] key positions
        mask_n = k_idx < end
        # -- page lookup: logical key -> (page, slot); int64, a cache can pass 2**31 elements --
        if PAGE_SIZE % BLOCK_N == 0:  # the tile lies in one page: one lookup
            page = tl.load(bt_row + start_n // PAGE_SIZE).to(tl.int64)
        elif MASKED:  # keys past `end` may be past the request's pages
            page = tl.load(bt_row + k_idx // PAGE_SIZE, mask=mask_n, other=0).to(tl.int64)
        else:
            page = tl.load(bt_row + k_idx // PAGE_SIZE).to(tl.int64)
        slot = k_idx % PAGE_SIZE
        k_ptrs = k_head + (page * stride_kp + slot * stride_ks)[:, None] + offs_d[None, :]
        v_ptrs = v_head + (page * stride_vp + slot * stride_vs)[:, None] + offs_d[None, :]
        # K and V tiles: [BLOCK_N, HEAD_DIM]
        if MASKED:
            k = tl.load(k_ptrs, mask=mask_n[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=mask_n[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)

        # -- scores: [BLOCK_M, BLOCK_N], log2 units --
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # unscaled
        if MASKED:  # causal: key k_idx is visible to a query at q_pos >= k_idx
            visible = (k_idx[None, :] <= q_pos[:, None]) & mask_n[None, :]
            qk = tl.where(visible, qk, float("-inf"))

        # -- update m_i and l_i (qk_scale > 0, so the max commutes with the scaling) --
        # m_new is finite: a query's first tile always holds a key it sees (key 0 or an
        # unmasked run before the band), and later all-masked rows keep their m_i
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        alpha = tl.exp2(m_i - m_new)  # 0 on the first tile (m_i = -inf)
        p = tl.exp2(qk * qk_scale - m_new[:, None])  # [BLOCK_M, BLOCK_N], one FMA + exp2
        l_i = l_i * alpha + tl.sum(p, 1)

        # -- update acc: [BLOCK_M, HEAD_DIM] --
        acc = acc * alpha[:, None]
        acc += tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _extend_kernel(
    out_ptr,  # [T, n_heads, HEAD_DIM], q's dtype
    q_ptr,  # [T, n_heads, HEAD_DIM]
    k_cache_ptr,  # [num_pages, PAGE_SIZE, n_kv_heads, HEAD_DIM]
    v_cache_ptr,  # [num_pages, PAGE_SIZE, n_kv_heads, HEAD_DIM]
    qo_indptr_ptr,  # [bs + 1] int32: first new token of each request in q and out
    kv_lens_ptr,  # [bs] int32: prefix_len + q_len
    block_table_ptr,  # [bs, max_pages] int32
    sm_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kp,
    stride_ks,
    stride_kh,
    stride_vp,
    stride_vs,
    stride_vh,
    stride_bt,
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (no tf32), else None (the default)
    UPCAST: tl.constexpr,  # q, K, V in fp32: the interpreter's bf16 dot is wrong
):
    cur_head = tl.program_id(0)
    block_m = tl.num_programs(1) - 1 - tl.program_id(1)  # latest q block (most keys) first
    cur_batch = tl.program_id(2)
    cur_kv_head = cur_head // GROUP

    q_start = tl.load(qo_indptr_ptr + cur_batch)
    q_len = tl.load(qo_indptr_ptr + cur_batch + 1) - q_start
    if block_m * BLOCK_M >= q_len:  # past this request's new tokens (max_q_len sets the grid)
        return
    kv_len = tl.load(kv_lens_ptr + cur_batch)
    prefix = kv_len - q_len

    offs_m = block_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] query index in the chunk
    offs_d = tl.arange(0, HEAD_DIM)
    mask_m = offs_m < q_len
    q_pos = prefix + offs_m  # [BLOCK_M] absolute positions
    q_rows = (q_start + offs_m).to(tl.int64)
    q_ptrs = q_ptr + q_rows[:, None] * stride_qt + cur_head * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=mask_m[:, None], other=0.0)  # [BLOCK_M, HEAD_DIM]
    if UPCAST:
        q = q.to(tl.float32)
    qk_scale = sm_scale * 1.4426950408889634  # fold log2(e) in

    # -- key ranges: [0, full_end) every query of the block sees, the band up to causal_end --
    first_pos = prefix + block_m * BLOCK_M
    full_end = (first_pos + 1) // BLOCK_N * BLOCK_N
    causal_end = prefix + tl.minimum(q_len, (block_m + 1) * BLOCK_M)  # <= kv_len

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running max (log2 units)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running sum of exp2
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    bt_row = block_table_ptr + cur_batch * stride_bt
    k_head = k_cache_ptr + cur_kv_head * stride_kh
    v_head = v_cache_ptr + cur_kv_head * stride_vh
    acc, l_i, m_i = _attend_keys(
        acc,
        l_i,
        m_i,
        q,
        q_pos,
        k_head,
        v_head,
        bt_row,
        0,
        full_end,
        qk_scale,
        stride_kp,
        stride_ks,
        stride_vp,
        stride_vs,
        HEAD_DIM,
        PAGE_SIZE,
        BLOCK_N,
        False,
        DOT_PRECISION,
        UPCAST,
    )
    acc, l_i, m_i = _attend_keys(
        acc,
        l_i,
        m_i,
        q,
        q_pos,
        k_head,
        v_head,
        bt_row,
        full_end,
        causal_end,
        qk_scale,
        stride_kp,
        stride_ks,
        stride_vp,
        stride_vs,
        HEAD_DIM,
        PAGE_SIZE,
        BLOCK_N,
        True,
        DOT_PRECISION,
        UPCAST,
    )

    # -- normalise and write the block's live rows; l_i > 0 there (each sees key 0 at least) --
    o = acc / l_i[:, None]
    o_rows = (q_start + offs_m).to(tl.int64)
    o_ptrs = out_ptr + o_rows[:, None] * stride_ot + cur_head * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=mask_m[:, None])


_INTERPRETED = type(_extend_kernel).__name__ == "InterpretedFunction"  # TRITON_INTERPRET=1


def extend_attention(
    q: torch.Tensor,  # [T, n_heads, head_dim], rows may be strided, last dim contiguous
    k_cache: torch.Tensor,  # [num_pages, page_size, n_kv_heads, head_dim], contiguous
    v_cache: torch.Tensor,  # [num_pages, page_size, n_kv_heads, head_dim], contiguous
    qo_indptr: torch.Tensor,  # [bs + 1] int32: cumulative new tokens, 0 .. T
    kv_lens: torch.Tensor,  # [bs] int32: prefix_len + q_len
    block_table: torch.Tensor,  # [bs, max_pages] int32
    *,
    max_q_len: int,
    sm_scale: float,
    out: torch.Tensor | None = None,  # [T, n_heads, head_dim], q.dtype
    tile: ExtendTile | None = None,
) -> torch.Tensor:  # [T, n_heads, head_dim], q.dtype
    """Causal attention of each request's new tokens over its prefix and themselves.

    ``max_q_len`` (a host int, no device sync) must be at least every request's ``q_len``: it
    sets the grid, and rows past ``cdiv(max_q_len, block_m) * block_m`` of a longer request are
    never written (the launcher checks what it can without a sync: ``1 <= max_q_len <= T`` and
    ``max_q_len * bs >= T``). Every ``kv_lens[b] >= q_len[b]`` is the caller's contract, as are
    block-table entries below ``num_pages`` for each request's ``cdiv(kv_len, page_size)`` pages.
    ``tile`` overrides ``default_tile(head_dim, dtype)``. Returns ``out`` (allocated when None).
    """
    check_extend_inputs(
        q,
        k_cache,
        v_cache,
        qo_indptr,
        kv_lens,
        block_table,
        max_q_len,
        sm_scale,
        out,
        tile,
        interpreted=_INTERPRETED,
    )
    if out is None:
        out = torch.empty_like(q)
    total, n_heads, head_dim = q.shape
    bs = kv_lens.shape[0]
    if total == 0 or bs == 0:
        return out
    page_size, n_kv_heads = k_cache.shape[1], k_cache.shape[2]
    cfg = tile if tile is not None else default_tile(head_dim, q.dtype)
    upcast = _INTERPRETED and q.dtype == torch.bfloat16
    precision = "ieee" if q.dtype == torch.float32 or upcast else None  # None: the default

    grid = (n_heads, cdiv(max_q_len, cfg.block_m), bs)
    _extend_kernel[grid](
        out,
        q,
        k_cache,
        v_cache,
        qo_indptr,
        kv_lens,
        block_table,
        float(sm_scale),
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_table.stride(0),
        GROUP=n_heads // n_kv_heads,
        HEAD_DIM=head_dim,
        PAGE_SIZE=page_size,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        DOT_PRECISION=precision,
        UPCAST=upcast,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out


def causal_flops(q_lens: list[int], kv_lens: list[int], n_heads: int, head_dim: int) -> int:
    """Matmul FLOPs of the causal work (2 products of 2 FLOPs per visible query-key pair)."""
    pairs = sum(q * (kv - q) + q * (q + 1) // 2 for q, kv in zip(q_lens, kv_lens))
    return 4 * head_dim * n_heads * pairs


__all__ = [
    "DEFAULT_TILES",
    "ExtendTile",
    "causal_flops",
    "default_tile",
    "extend_attention",
]
