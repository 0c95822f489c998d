"""The two Triton kernels of split-KV flash decode (launched by ``flash_decode.py``).

``_split_kv_kernel``, grid ``(bs, n_kv_heads, num_splits)``: one program takes every query head
of one KV head (the GQA group) over one split of one request's keys. Split ``s`` of request ``b``
handles keys ``[s * chunk_b, min((s + 1) * chunk_b, seq_len_b))`` with
``chunk_b = round_up(ceil(seq_len_b / num_splits), BLOCK_N)``; ``num_splits`` is
``tl.num_programs(2)``, read from the grid, so editing grid.z of a captured node changes it.
It writes fp32 partials ``partial_o [bs, n_heads, max_splits, head_dim]`` (normalised) and
``partial_lse [bs, n_heads, max_splits]`` (natural log). An empty split writes ``o = 0`` and
``lse = -inf``.

``_combine_kernel``, grid ``(bs, n_heads)``: merges the first ``n_splits`` partials with a stable
log-sum-exp and writes ``out [bs, n_heads, head_dim]`` in the input dtype.

Driver-level parameters (what ``cuGraphKernelNodeGetParams`` shows; constexprs are dropped, an
int equal to 1 at the first call is specialised away, and Triton appends two pointers):

    _split_kv_kernel                           _combine_kernel
     0 partial_o_ptr    ptr, 8 B  (editable)    0 partial_o_ptr  ptr, 8 B  (editable pairing key)
     1 partial_lse_ptr  ptr, 8 B                1 n_splits       i32, 4 B  (editable,
     2 q_ptr            ptr, 8 B                                 do_not_specialize)
     3 k_cache_ptr      ptr, 8 B                2 partial_lse_ptr ptr, 8 B
     4 v_cache_ptr      ptr, 8 B                3 out_ptr        ptr, 8 B
     5 block_table_ptr  ptr, 8 B                4.. strides      i32 each (one equal to 1
     6 seq_lens_ptr     ptr, 8 B                                 vanishes)
     7 sm_scale         f32, 4 B                then global_scratch, profile_scratch (ptr, 8 B)
     8.. strides        i32 each (one equal to 1 vanishes)
     then global_scratch, profile_scratch (ptr, 8 B)

Positions up to 7 (main) and 3 (combine) are fixed; the grid of the main node (grid.z) is the
split count. The head-dim stride of every tensor must be 1 (it is not passed).

The names and argument indices below are what ``graph_update.registry.FLASH_DECODE_SPEC`` is
built from; ``tests/test_graph_update_flash.py`` checks them against the compiled kernels.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..pdl import pdl_trigger_late, pdl_wait_then_trigger, pdl_wait_then_trigger_short

MAIN_KERNEL_NAME = "_split_kv_kernel"
COMBINE_KERNEL_NAME = "_combine_kernel"
MAIN_PARTIAL_O_ARG = 0  # driver-level index, 8-byte pointer
COMBINE_PARTIAL_O_ARG = 0  # driver-level index, 8-byte pointer
COMBINE_N_SPLITS_ARG = 1  # driver-level index, 4-byte int32


@triton.jit
def split_partial(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    seq_lens_ptr,
    sm_scale,
    stride_qb,
    stride_qh,
    stride_kp,
    stride_ks,
    stride_kh,
    stride_vp,
    stride_vs,
    stride_vh,
    stride_bt,
    cur_batch,
    cur_kv_head,
    split_id,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_TILE: tl.constexpr,
    K_ROWS: tl.constexpr,
    USE_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    UPCAST: tl.constexpr,
):
    # One split of one (request, KV head): -> (o [GROUP_PAD, HEAD_DIM] normalised, lse
    # [GROUP_PAD] natural log, query head ids, their mask, the split's chunk of keys). An empty
    # split gives o = 0, lse = -inf, never NaN. (The body of both split kernels.)
    num_splits = tl.num_programs(2)

    # -- this split's key range; chunk is a multiple of BLOCK_N, so every tile starts on one --
    seq_len = tl.load(seq_lens_ptr + cur_batch)
    chunk = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split_id * chunk
    end = tl.minimum(start + chunk, seq_len)

    offs_g = tl.arange(0, GROUP_PAD)  # [GROUP_PAD] query head within the group
    offs_d = tl.arange(0, HEAD_DIM)  # [HEAD_DIM]
    offs_n = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    mask_g = offs_g < GROUP
    cur_heads = cur_kv_head * GROUP + offs_g  # [GROUP_PAD] query head ids

    # q tile: [GROUP_PAD, HEAD_DIM], padded rows are zero
    q_ptrs = q_ptr + cur_batch * stride_qb + cur_heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=mask_g[:, None], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    qk_scale = sm_scale * 1.4426950408889634  # fold log2(e) in: softmax runs on exp2

    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)  # running max (log2 units)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)  # running sum of exp2
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)
    bt_row = block_table_ptr + cur_batch * stride_bt
    k_head = k_cache_ptr + cur_kv_head * stride_kh
    v_head = v_cache_ptr + cur_kv_head * stride_vh

    # pipelined NUM_STAGES deep (Triton 3.9 for sm_90 pipelines only the page lookup this way)
    for start_n in tl.range(start, end, BLOCK_N, num_stages=NUM_STAGES):
        k_idx = start_n + offs_n  # [BLOCK_N] key positions
        mask_n = k_idx < end
        # -- page lookup: logical key -> (page, slot) --
        if PAGE_TILE:  # one block-table load per tile; the slots are contiguous
            page = tl.load(bt_row + start_n // PAGE_SIZE).to(tl.int64)  # scalar
            slot = start_n % PAGE_SIZE + offs_n  # [BLOCK_N]
        else:  # one lookup per key
            page = tl.load(bt_row + k_idx // PAGE_SIZE, mask=mask_n, other=0).to(tl.int64)
            slot = k_idx % PAGE_SIZE
        k_off = page * stride_kp + slot * stride_ks  # [BLOCK_N]
        v_off = page * stride_vp + slot * stride_vs  # [BLOCK_N]
        # V tile [BLOCK_N, HEAD_DIM]; K tile [BLOCK_N, HEAD_DIM] (K_ROWS) or [HEAD_DIM, BLOCK_N]
        if K_ROWS:
            k = tl.load(k_head + k_off[:, None] + offs_d[None, :], mask=mask_n[:, None], other=0.0)
        else:
            k = tl.load(k_head + k_off[None, :] + offs_d[:, None], mask=mask_n[None, :], other=0.0)
        v = tl.load(v_head + v_off[:, None] + offs_d[None, :], mask=mask_n[:, None], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)

        # -- scores: [GROUP_PAD, BLOCK_N] in log2 units --
        if USE_DOT:
            if K_ROWS:
                qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
            else:
                qk = tl.dot(q, k, input_precision=DOT_PRECISION)
        elif K_ROWS:
            qk = tl.sum(q[:, None, :] * k[None, :, :], 2)
        else:
            qk = tl.sum(q[:, :, None] * k[None, :, :], 1)
        qk = tl.where(mask_n[None, :], qk * qk_scale, float("-inf"))

        # -- update m_i and l_i --
        m_new = tl.maximum(m_i, tl.max(qk, 1))  # finite: every tile holds a live key
        alpha = tl.exp2(m_i - m_new)  # 0 on the first tile (m_i = -inf)
        p = tl.exp2(qk - m_new[:, None])  # [GROUP_PAD, BLOCK_N]
        l_i = l_i * alpha + tl.sum(p, 1)

        # -- update acc: [GROUP_PAD, HEAD_DIM] --
        acc = acc * alpha[:, None]
        if USE_DOT:
            acc += tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        else:
            acc += tl.sum(p[:, :, None] * v[None, :, :], 1)
        m_i = m_new

    live = l_i > 0.0
    o = acc / tl.where(live, l_i, 1.0)[:, None]
    lse = tl.where(
        live, (m_i + tl.log2(tl.where(live, l_i, 1.0))) * 0.6931471805599453, -float("inf")
    )
    return o, lse, cur_heads, mask_g, chunk


@triton.jit
def _split_kv_kernel(
    partial_o_ptr,  # [bs, n_heads, max_splits, HEAD_DIM] fp32, must stay argument 0
    partial_lse_ptr,  # [bs, n_heads, max_splits] fp32
    q_ptr,  # [bs, n_heads, HEAD_DIM]
    k_cache_ptr,  # [num_pages, PAGE_SIZE, n_kv_heads, HEAD_DIM]
    v_cache_ptr,  # [num_pages, PAGE_SIZE, n_kv_heads, HEAD_DIM]
    block_table_ptr,  # [bs, max_pages] int32
    seq_lens_ptr,  # [bs] int32
    sm_scale,
    stride_qb,
    stride_qh,
    stride_kp,
    stride_ks,
    stride_kh,
    stride_vp,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_pob,
    stride_poh,
    stride_pos,
    stride_lb,
    stride_lh,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # rows of the q tile: max(16, next_pow2(GROUP)) for tl.dot
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_TILE: tl.constexpr,  # PAGE_SIZE % BLOCK_N == 0: each tile lies in one page
    K_ROWS: tl.constexpr,  # K as [BLOCK_N, HEAD_DIM], q @ trans(k); else K^T [HEAD_DIM, BLOCK_N]
    USE_DOT: tl.constexpr,  # tl.dot (tensor cores); else broadcast multiply-and-sum in fp32
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (no tf32), else None (the default)
    NUM_STAGES: tl.constexpr,  # software-pipelining depth of the key loop (also a launch option)
    UPCAST: tl.constexpr,  # q, K, V in fp32: the FMA path, or the interpreter's bf16 dot (wrong)
    USE_PDL: tl.constexpr = False,  # launched with PDL (kernels/pdl.py); adds no parameter
):
    cur_batch = tl.program_id(0)
    cur_kv_head = tl.program_id(1)
    split_id = tl.program_id(2)
    # everything below reads the predecessors' output (q, the KV just written, seq_lens):
    # wait first, before the pipelined key loop
    pdl_wait_then_trigger(USE_PDL)
    o, lse, cur_heads, mask_g, _ = split_partial(
        q_ptr,
        k_cache_ptr,
        v_cache_ptr,
        block_table_ptr,
        seq_lens_ptr,
        sm_scale,
        stride_qb,
        stride_qh,
        stride_kp,
        stride_ks,
        stride_kh,
        stride_vp,
        stride_vs,
        stride_vh,
        stride_bt,
        cur_batch,
        cur_kv_head,
        split_id,
        GROUP,
        GROUP_PAD,
        HEAD_DIM,
        PAGE_SIZE,
        BLOCK_N,
        PAGE_TILE,
        K_ROWS,
        USE_DOT,
        DOT_PRECISION,
        NUM_STAGES,
        UPCAST,
    )
    pdl_trigger_late(USE_PDL)
    offs_d = tl.arange(0, HEAD_DIM)
    # -- write partials; an empty split gives o = 0, lse = -inf, never NaN --
    po_ptrs = (
        partial_o_ptr
        + cur_batch * stride_pob
        + cur_heads[:, None] * stride_poh
        + split_id * stride_pos
        + offs_d[None, :]
    )
    tl.store(po_ptrs, o, mask=mask_g[:, None])
    lse_ptrs = partial_lse_ptr + cur_batch * stride_lb + cur_heads * stride_lh + split_id
    tl.store(lse_ptrs, lse, mask=mask_g)


@triton.jit(do_not_specialize=["n_splits"])
def _combine_kernel(
    partial_o_ptr,  # [bs, n_heads, max_splits, HEAD_DIM] fp32, must stay argument 0
    n_splits,  # int32, must stay argument 1 (edited per token in exact mode)
    partial_lse_ptr,  # [bs, n_heads, max_splits] fp32
    out_ptr,  # [bs, n_heads, HEAD_DIM], input dtype
    stride_pob,
    stride_poh,
    stride_pos,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    SPLITS_PAD: tl.constexpr,  # next_pow2(max_splits): fixed per workspace, not per n_splits
    USE_PDL: tl.constexpr = False,  # launched with PDL (kernels/pdl.py); adds no parameter
):
    cur_batch = tl.program_id(0)
    cur_head = tl.program_id(1)
    pdl_wait_then_trigger_short(USE_PDL)  # the partials are the split kernel's output

    offs_s = tl.arange(0, SPLITS_PAD)  # [SPLITS_PAD]
    offs_d = tl.arange(0, HEAD_DIM)  # [HEAD_DIM]
    mask_s = offs_s < n_splits

    lse_ptrs = partial_lse_ptr + cur_batch * stride_lb + cur_head * stride_lh + offs_s
    lse = tl.load(lse_ptrs, mask=mask_s, other=float("-inf"))  # [SPLITS_PAD]

    # -- stable log-sum-exp: subtract the max; -inf splits weigh 0 --
    m = tl.max(lse, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    live = lse > float("-inf")
    w = tl.where(live, tl.exp2((lse - m_safe) * 1.4426950408889634), 0.0)  # [SPLITS_PAD]
    denom = tl.sum(w, 0)

    po_ptrs = (
        partial_o_ptr
        + cur_batch * stride_pob
        + cur_head * stride_poh
        + offs_s[:, None] * stride_pos
        + offs_d[None, :]
    )
    # issued together with the lse load (not masked by `live`, which would wait for it); the
    # first n_splits partials are always written, an empty split's as zeros
    po = tl.load(po_ptrs, mask=mask_s[:, None], other=0.0)  # [SPLITS_PAD, HEAD_DIM]
    po = tl.where(live[:, None], po, 0.0)
    o = tl.sum(po * w[:, None], 0) / tl.where(denom > 0.0, denom, 1.0)  # [HEAD_DIM]
    out_ptrs = out_ptr + cur_batch * stride_ob + cur_head * stride_oh + offs_d
    tl.store(out_ptrs, o.to(out_ptr.dtype.element_ty))


_INTERPRETED = type(_split_kv_kernel).__name__ == "InterpretedFunction"  # TRITON_INTERPRET=1
