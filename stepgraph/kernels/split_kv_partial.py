"""The body of both split-KV kernels (``split_kv._split_kv_kernel`` and
``split_kv_fold._split_kv_fold_kernel``): one split of one (request, KV head) as an online
softmax over tiles of ``BLOCK_N`` keys, and the kernels' PDL wait.

``split_partial`` reads the split's key range from ``seq_lens`` and the grid (``num_splits =
tl.num_programs(2)``, so exact mode's grid edit changes it), then loads tile by tile through the
block table (``kv_tile``) and folds each into the running max, sum and accumulator
(``attend_tile``). With ``PREFETCH`` (the launcher's ``prefetch_kv``) the first tile is peeled off
the loop so its loads go out before the PDL wait, all but the newest key (``seq_len - 1``, the
one the qkv kernel just before writes), which is read after it: the same tiles in the same order,
so the same bits, with the dependent loads (seq_lens, then the block table, then K/V) no longer
behind the predecessor's end.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .pdl import pdl_wait_then_trigger


@triton.jit
def kv_tile(
    k_head, v_head, bt_row, start_n, mask_n, any_n, offs_n, offs_d,
    stride_kp, stride_ks, stride_vp, stride_vs,
    PAGE_SIZE: tl.constexpr, PAGE_TILE: tl.constexpr, K_ROWS: tl.constexpr,
):  # fmt: skip
    # The K and V tiles of keys start_n + offs_n where mask_n, zeros elsewhere: V [BLOCK_N,
    # HEAD_DIM], K [BLOCK_N, HEAD_DIM] (K_ROWS) or [HEAD_DIM, BLOCK_N]. any_n (a scalar): some
    # of mask_n is true; when it is not, nothing is read (a split past the block table's end).
    k_idx = start_n + offs_n  # [BLOCK_N] key positions
    # -- page lookup: logical key -> (page, slot) --
    if PAGE_TILE:  # one block-table load per tile; the slots are contiguous
        page = tl.load(bt_row + start_n // PAGE_SIZE, mask=any_n, other=0).to(tl.int64)
        slot = start_n % PAGE_SIZE + offs_n  # [BLOCK_N]
    else:  # one lookup per key
        page = tl.load(bt_row + k_idx // PAGE_SIZE, mask=mask_n, other=0).to(tl.int64)
        slot = k_idx % PAGE_SIZE
    k_off = page * stride_kp + slot * stride_ks  # [BLOCK_N]
    v_off = page * stride_vp + slot * stride_vs  # [BLOCK_N]
    if K_ROWS:
        k = tl.load(k_head + k_off[:, None] + offs_d[None, :], mask=mask_n[:, None], other=0.0)
    else:
        k = tl.load(k_head + k_off[None, :] + offs_d[:, None], mask=mask_n[None, :], other=0.0)
    v = tl.load(v_head + v_off[:, None] + offs_d[None, :], mask=mask_n[:, None], other=0.0)
    return k, v


@triton.jit
def attend_tile(
    q, k, v, mask_n, m_i, l_i, acc, qk_scale,
    K_ROWS: tl.constexpr, USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):  # fmt: skip
    # One tile of the online softmax: (m_i, l_i, acc) updated by keys k, v where mask_n (at
    # least one live key).
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
    return m_new, l_i, acc


@triton.jit
def split_partial(
    q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, seq_lens_ptr, sm_scale,
    stride_qb, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    stride_bt, cur_batch, cur_kv_head, split_id,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_TILE: tl.constexpr,
    K_ROWS: tl.constexpr, USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    NUM_STAGES: tl.constexpr, UPCAST: tl.constexpr, USE_PDL: tl.constexpr,
    PREFETCH: tl.constexpr,
):  # fmt: skip
    # One split of one (request, KV head): -> (o [GROUP_PAD, HEAD_DIM] normalised, lse
    # [GROUP_PAD] natural log, query head ids, their mask, the split's chunk of keys). An empty
    # split gives o = 0, lse = -inf, never NaN. (The body of both split kernels; it holds their
    # PDL wait.)
    #
    # PREFETCH (with PDL): the first tile of the split is loaded before the wait, but for the
    # newest key (seq_len - 1), the one the predecessor (the qkv kernel) writes this step, which
    # is loaded after it. Everything else read before the wait was written before the
    # predecessor started, and the wait is transitive (kernels/pdl.py): seq_lens and the block
    # table (the step's inputs) and the keys of earlier steps. Same tiles, same order, same
    # arithmetic as without it: the same bits.
    num_splits = tl.num_programs(2)
    if not PREFETCH:  # q, the KV just written and seq_lens are the predecessors'
        pdl_wait_then_trigger(USE_PDL)

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
    bt_row = block_table_ptr + cur_batch * stride_bt
    k_head = k_cache_ptr + cur_kv_head * stride_kh
    v_head = v_cache_ptr + cur_kv_head * stride_vh

    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)  # running max (log2 units)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)  # running sum of exp2
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)
    loop_start = start
    if PREFETCH:
        # -- the first tile's earlier keys, then the wait, then the newest key --
        k_idx = start + offs_n
        mask0 = k_idx < end
        newest_key = seq_len - 1
        k0, v0 = kv_tile(
            k_head, v_head, bt_row, start, mask0 & (k_idx < newest_key),
            start < tl.minimum(end, newest_key), offs_n, offs_d,
            stride_kp, stride_ks, stride_vp, stride_vs, PAGE_SIZE, PAGE_TILE, K_ROWS,
        )  # fmt: skip
        pdl_wait_then_trigger(USE_PDL)
        newest = mask0 & (k_idx == newest_key)  # [BLOCK_N], one key at most
        k_new, v_new = kv_tile(
            k_head, v_head, bt_row, start, newest,
            (start <= newest_key) & (newest_key < tl.minimum(end, start + BLOCK_N)),
            offs_n, offs_d,
            stride_kp, stride_ks, stride_vp, stride_vs, PAGE_SIZE, PAGE_TILE, K_ROWS,
        )  # fmt: skip
        if K_ROWS:
            k0 = tl.where(newest[:, None], k_new, k0)
        else:
            k0 = tl.where(newest[None, :], k_new, k0)
        v0 = tl.where(newest[:, None], v_new, v0)

    # q tile: [GROUP_PAD, HEAD_DIM], padded rows are zero
    q_ptrs = q_ptr + cur_batch * stride_qb + cur_heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=mask_g[:, None], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    qk_scale = sm_scale * 1.4426950408889634  # fold log2(e) in: softmax runs on exp2

    if PREFETCH:
        if start < end:
            m_i, l_i, acc = attend_tile(
                q, k0, v0, mask0, m_i, l_i, acc, qk_scale, K_ROWS, USE_DOT, DOT_PRECISION, UPCAST
            )
        loop_start = start + BLOCK_N

    # pipelined NUM_STAGES deep (Triton 3.9 for sm_90 pipelines only the page lookup this way)
    for start_n in tl.range(loop_start, end, BLOCK_N, num_stages=NUM_STAGES):
        mask_n = start_n + offs_n < end
        k, v = kv_tile(
            k_head, v_head, bt_row, start_n, mask_n, start_n < end, offs_n, offs_d,
            stride_kp, stride_ks, stride_vp, stride_vs, PAGE_SIZE, PAGE_TILE, K_ROWS,
        )  # fmt: skip
        m_i, l_i, acc = attend_tile(
            q, k, v, mask_n, m_i, l_i, acc, qk_scale, K_ROWS, USE_DOT, DOT_PRECISION, UPCAST
        )

    live = l_i > 0.0
    o = acc / tl.where(live, l_i, 1.0)[:, None]
    lse = tl.where(
        live, (m_i + tl.log2(tl.where(live, l_i, 1.0))) * 0.6931471805599453, -float("inf")
    )
    return o, lse, cur_heads, mask_g, chunk
