"""Split-KV decode in one launch: the split kernel with the combine folded in (the fused decode
step's attention).

``_split_kv_fold_kernel``, grid ``(bs, n_kv_heads, num_splits)`` as ``split_kv._split_kv_kernel``
and the same body (``split_kv.split_partial``); then, per (request, KV head):

- a row whose keys fit in one split (``seq_len <= chunk``: every row at short context, e.g.
  ``seq_len <= 64``) is final after split 0: split 0 writes ``out`` directly, the other
  (empty) splits write nothing;
- otherwise every split writes its float32 partials as the two-kernel path does and takes a
  ticket (``tickets [bs * n_kv_heads]`` int32, zero between launches); the split that draws
  the last one merges the partials of the group's query heads with a stable log-sum-exp (the
  ``_combine_kernel``'s arithmetic, splits in index order) and resets the ticket.

So no combine launch, at any split count. The merge takes every query head of the group at
once over ``SPLITS_PAD`` splits, the class's largest count (``flash_decode(merge_splits=)``),
so a live count below it reduces over the same block. Merged head by head over 64 splits it
lost to split + combine; as now it wins at Llama-3.2-1B's classes 16-32 and ties at 8
(docs/experiments.md#the-attention-in-one-launch), and the fused step takes it where
``model/decode/step_attention`` says; also where every row has one split (``MERGE=False``: the
ladder gives one split at every context for the batch size, bs >= 34 for the 1B). The split
count is still ``tl.num_programs(2)``: mode ``exact`` retunes grid z alone
(``graph_update.registry.FLASH_DECODE_FOLD_SPEC``, a spec with no combine kernel).
Driver-level parameter 0 is ``partial_o`` (8 bytes), as for the two-kernel main.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..launch_math import next_pow2
from ..pdl import pdl_trigger_late, pdl_wait_then_trigger
from ..proj.gemv_tiles import gpu_fence
from .split_kv import split_partial

FOLD_KERNEL_NAME = "_split_kv_fold_kernel"
FOLD_PARTIAL_O_ARG = 0  # driver-level index, 8-byte pointer


@triton.jit
def _split_kv_fold_kernel(
    partial_o_ptr,  # [bs, n_heads, max_splits, HEAD_DIM] fp32, must stay argument 0
    partial_lse_ptr,  # [bs, n_heads, max_splits] fp32
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    seq_lens_ptr,
    sm_scale,
    out_ptr,  # [bs, n_heads, HEAD_DIM], q's dtype
    ticket_ptr,  # [>= bs * n_kv_heads] int32, zero
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
    stride_ob,
    stride_oh,
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
    SPLITS_PAD: tl.constexpr,  # next_pow2 of the class's largest split count (merge_splits)
    MERGE_G: tl.constexpr,  # next_pow2(GROUP): the merge's block of query heads
    MERGE: tl.constexpr,  # False: one split (grid z == 1), the merge is compiled out
    USE_PDL: tl.constexpr = False,
):
    cur_batch = tl.program_id(0)
    cur_kv_head = tl.program_id(1)
    split_id = tl.program_id(2)
    num_splits = tl.num_programs(2)
    pdl_wait_then_trigger(USE_PDL)  # q, the KV just written and seq_lens are predecessors'
    o, lse, cur_heads, mask_g, chunk = split_partial(
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
    seq_len = tl.load(seq_lens_ptr + cur_batch)
    dtype = out_ptr.dtype.element_ty
    out_ptrs = out_ptr + cur_batch * stride_ob + cur_heads[:, None] * stride_oh + offs_d[None, :]
    if not MERGE:  # -- one split: final --
        tl.store(out_ptrs, o.to(dtype), mask=mask_g[:, None])
    elif seq_len <= chunk:  # -- one split holds every key: split 0 is final, no partials --
        if split_id == 0:
            tl.store(out_ptrs, o.to(dtype), mask=mask_g[:, None])
    else:
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
        gpu_fence()  # stored and fenced (every thread) before the ticket is taken
        tl.debug_barrier()
        tk = ticket_ptr + cur_batch * tl.num_programs(1) + cur_kv_head
        ticket = tl.atomic_add(tk, 1, sem="acq_rel", scope="gpu")
        tl.debug_barrier()
        gpu_fence()
        if ticket == num_splits - 1:  # -- the last split merges the group's partials --
            # every query head of the group at once: [MERGE_G, SPLITS_PAD(, HEAD_DIM)]
            offs_s = tl.arange(0, SPLITS_PAD)
            offs_h = tl.arange(0, MERGE_G)
            heads = cur_kv_head * GROUP + offs_h
            mask_hs = (offs_h < GROUP)[:, None] & (offs_s < num_splits)[None, :]
            ls = tl.load(
                partial_lse_ptr
                + cur_batch * stride_lb
                + heads[:, None] * stride_lh
                + offs_s[None, :],
                mask=mask_hs,
                other=float("-inf"),
                cache_modifier=".cg",
            )
            m = tl.max(ls, 1)  # finite on live heads: split 0 holds keys
            m = tl.where(m == float("-inf"), 0.0, m)  # the padded heads
            live = ls > float("-inf")
            w = tl.where(live, tl.exp2((ls - m[:, None]) * 1.4426950408889634), 0.0)
            po = tl.load(
                partial_o_ptr
                + cur_batch * stride_pob
                + heads[:, None, None] * stride_poh
                + offs_s[None, :, None] * stride_pos
                + offs_d[None, None, :],
                mask=mask_hs[:, :, None],
                other=0.0,
                cache_modifier=".cg",
            )
            po = tl.where(live[:, :, None], po, 0.0)
            denom = tl.sum(w, 1)
            merged = tl.sum(po * w[:, :, None], 1) / tl.where(denom > 0.0, denom, 1.0)[:, None]
            dst = out_ptr + cur_batch * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
            tl.store(dst, merged.to(dtype), mask=(offs_h < GROUP)[:, None])
            tl.atomic_xchg(tk, 0, sem="relaxed", scope="gpu")


def launch_fold(
    q,
    k_cache,
    v_cache,
    block_table,
    seq_lens,
    workspace,
    out,
    num_splits,
    sm_scale,
    cfg,
    group,
    group_pad,
    precision,
    upcast,
    splits_pad,
    pdl,
    options,
):
    """``flash_decode(..., fold_combine=True)``'s launch (its checks done there)."""
    bs, n_kv = q.shape[0], k_cache.shape[2]
    po, lse = workspace.partial_o, workspace.partial_lse
    page_size = k_cache.shape[1]
    _split_kv_fold_kernel[(bs, n_kv, num_splits)](
        po,
        lse,
        q,
        k_cache,
        v_cache,
        block_table,
        seq_lens,
        float(sm_scale),
        out,
        workspace.tickets,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_table.stride(0),
        po.stride(0),
        po.stride(1),
        po.stride(2),
        lse.stride(0),
        lse.stride(1),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        GROUP_PAD=group_pad,
        HEAD_DIM=q.shape[2],
        PAGE_SIZE=page_size,
        BLOCK_N=cfg.block_n,
        PAGE_TILE=cfg.page_tile and page_size % cfg.block_n == 0,
        K_ROWS=cfg.k_rows,
        USE_DOT=cfg.use_dot,
        DOT_PRECISION=precision,
        UPCAST=upcast,
        NUM_STAGES=cfg.num_stages,
        SPLITS_PAD=splits_pad,
        MERGE_G=next_pow2(group),
        MERGE=num_splits > 1,
        USE_PDL=pdl,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **options,
    )
    return out


__all__ = ["FOLD_KERNEL_NAME", "FOLD_PARTIAL_O_ARG", "launch_fold"]
