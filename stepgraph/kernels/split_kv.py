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

from .pdl import pdl_trigger_late, pdl_wait_then_trigger_short
from .split_kv_partial import split_partial

MAIN_KERNEL_NAME = "_split_kv_kernel"
COMBINE_KERNEL_NAME = "_combine_kernel"
MAIN_PARTIAL_O_ARG = 0  # driver-level index, 8-byte pointer
COMBINE_PARTIAL_O_ARG = 0  # driver-level index, 8-byte pointer
COMBINE_N_SPLITS_ARG = 1  # driver-level index, 4-byte int32


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
    PREFETCH: tl.constexpr = False,  # the first tile's earlier keys before the PDL wait
):
    cur_batch = tl.program_id(0)
    cur_kv_head = tl.program_id(1)
    split_id = tl.program_id(2)
    # the PDL wait is in split_partial: before everything (q, the KV just written and seq_lens
    # are the predecessors'), or after the first tile's earlier keys (PREFETCH)
    o, lse, cur_heads, mask_g, _ = split_partial(
        q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, seq_lens_ptr, sm_scale,
        stride_qb, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
        stride_bt, cur_batch, cur_kv_head, split_id,
        GROUP, GROUP_PAD, HEAD_DIM, PAGE_SIZE, BLOCK_N, PAGE_TILE, K_ROWS, USE_DOT,
        DOT_PRECISION, NUM_STAGES, UPCAST, USE_PDL, PREFETCH,
    )  # fmt: skip
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
