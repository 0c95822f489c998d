"""Split-KV flash-decode attention over a paged KV cache: two Triton launches and a launcher.

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

Variants of the main kernel (``KernelConfig``: tile, warps, pipelining depth, page-per-tile
lookup, K layout, tensor cores or not) are constexprs and launch options of this one kernel, so
every variant keeps the layout above. ``DEFAULT_CONFIGS`` holds the chosen one per shape;
``benchmarks/flash_decode_sweep.py`` times the candidates.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from ..errors import ConfigError
from .decode_inputs import DecodeWorkspace, KernelConfig, _check_inputs
from .splits import H200_NUM_SMS, num_splits_for

MAIN_KERNEL_NAME = "_split_kv_kernel"
COMBINE_KERNEL_NAME = "_combine_kernel"
MAIN_PARTIAL_O_ARG = 0  # driver-level index, 8-byte pointer
COMBINE_PARTIAL_O_ARG = 0  # driver-level index, 8-byte pointer
COMBINE_N_SPLITS_ARG = 1  # driver-level index, 4-byte int32

DEFAULT_MAX_SPLITS = 64

# -- the default variant per (head_dim, page_size, dtype); any other shape gets FALLBACK_CONFIG --
# Edit after reading the "best overall" line of benchmarks/flash_decode_sweep.py on the target GPU.
# Measured on the H200 (2026-11-29, flash_decode_sweep.py, Llama-3.2-1B attention, pps 4):
# n128w4s2 was best overall (geomean 83.5 us vs 83.8 for n64w4s3; 91-100% of copy bandwidth
# at >= 32k keys for bs 8 and 32, 64% at bs=1/32k). Other shapes keep the unmeasured fallback.
FALLBACK_CONFIG = KernelConfig(block_n=64, num_warps=4, num_stages=3)
DEFAULT_CONFIGS: dict[tuple[int, int, torch.dtype], KernelConfig] = {
    (64, 64, torch.bfloat16): KernelConfig(block_n=128, num_warps=4, num_stages=2),
}


def default_config(head_dim: int, page_size: int, dtype: torch.dtype) -> KernelConfig:
    """The kernel variant ``flash_decode`` launches when no ``config`` is given."""
    return DEFAULT_CONFIGS.get((head_dim, page_size, dtype), FALLBACK_CONFIG)


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
):
    cur_batch = tl.program_id(0)
    cur_kv_head = tl.program_id(1)
    split_id = tl.program_id(2)
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

    # -- write partials; an empty split gives o = 0, lse = -inf, never NaN --
    live = l_i > 0.0
    o = acc / tl.where(live, l_i, 1.0)[:, None]
    lse = tl.where(
        live, (m_i + tl.log2(tl.where(live, l_i, 1.0))) * 0.6931471805599453, -float("inf")
    )
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
):
    cur_batch = tl.program_id(0)
    cur_head = tl.program_id(1)

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


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _is_capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


@functools.cache
def _device_num_sms(device: torch.device) -> int:  # cached: eager calls it per layer per token
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return H200_NUM_SMS  # the interpreter: pretend the target GPU, so geometry matches it


def flash_decode(
    q: torch.Tensor,  # [bs, n_heads, head_dim]
    k_cache: torch.Tensor,  # [num_pages, page_size, n_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_pages, page_size, n_kv_heads, head_dim]
    block_table: torch.Tensor,  # [bs, max_pages] int32
    seq_lens: torch.Tensor,  # [bs] int32, on q's device
    *,
    num_splits: int | None = None,
    max_splits: int | None = None,
    workspace: DecodeWorkspace | None = None,
    out: torch.Tensor | None = None,  # [bs, n_heads, head_dim], q.dtype
    sm_scale: float | None = None,
    max_seq_len: int | None = None,
    num_sms: int | None = None,
    config: KernelConfig | None = None,
) -> torch.Tensor:  # [bs, n_heads, head_dim], q.dtype
    """Decode attention of one new token per request over its paged keys and values.

    ``num_splits=None`` picks the split count from the ladder (``splits.num_splits_for``) at the
    live maximum length: the host int ``max_seq_len`` when given, else ``seq_lens.max().item()``
    (a device sync, refused during graph capture). Inside a graph, pass ``num_splits`` and a
    ``workspace`` so the graph owns its partials. ``config`` picks the kernel variant (default:
    ``default_config(head_dim, page_size, dtype)``). Returns ``out`` (allocated when None).
    """
    bs, n_heads, head_dim = q.shape if q.dim() == 3 else (0, 0, 0)
    if max_splits is None:
        max_splits = workspace.max_splits if workspace is not None else DEFAULT_MAX_SPLITS
    _check_inputs(q, k_cache, v_cache, block_table, seq_lens, workspace, out, max_splits)
    page_size, n_kv_heads = k_cache.shape[1], k_cache.shape[2]
    capacity = block_table.shape[1] * page_size

    if max_seq_len is None and num_splits is None:
        if _is_capturing(q.device):
            raise ConfigError(
                "flash_decode: num_splits=None and max_seq_len=None during CUDA graph capture; "
                "reading seq_lens.max() would sync the device. Pass num_splits (the captured "
                "split count) or max_seq_len (a host int)."
            )
        max_seq_len = int(seq_lens.max().item()) if bs > 0 else 0
    if max_seq_len is not None and not 0 <= max_seq_len <= capacity:
        raise ConfigError(
            f"flash_decode: max_seq_len={max_seq_len} (the longest of seq_lens) is outside "
            f"[0, max_pages * page_size = {capacity}] of block_table "
            f"{tuple(block_table.shape)}; grow the block table or shorten the request."
        )
    if num_splits is None:
        sms = num_sms if num_sms is not None else _device_num_sms(q.device)
        num_splits = num_splits_for(max_seq_len, n_kv_heads, max(bs, 1), sms, max_splits)
    if not isinstance(num_splits, int) or not 1 <= num_splits <= max_splits:
        raise ConfigError(
            f"flash_decode: num_splits={num_splits!r} must be an int in [1, max_splits="
            f"{max_splits}]; pass a larger max_splits (and workspace) or fewer splits."
        )

    if workspace is None:
        workspace = DecodeWorkspace.allocate(bs, n_heads, head_dim, max_splits, q.device)
    if out is None:
        out = torch.empty_like(q)
    if bs == 0:
        return out
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(head_dim)
    cfg = config if config is not None else default_config(head_dim, page_size, q.dtype)
    group = n_heads // n_kv_heads
    group_pad = max(16, _next_pow2(group)) if cfg.use_dot else _next_pow2(group)
    po, lse = workspace.partial_o, workspace.partial_lse
    upcast = _INTERPRETED and q.dtype == torch.bfloat16
    precision = "ieee" if q.dtype == torch.float32 or upcast else None  # None: the default
    upcast = upcast or not cfg.use_dot  # the FMA path computes in fp32

    _split_kv_kernel[(bs, n_kv_heads, num_splits)](
        po, lse, q, k_cache, v_cache, block_table, seq_lens, float(sm_scale),
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_table.stride(0),
        po.stride(0), po.stride(1), po.stride(2),
        lse.stride(0), lse.stride(1),
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, PAGE_SIZE=page_size,
        BLOCK_N=cfg.block_n, PAGE_TILE=cfg.page_tile and page_size % cfg.block_n == 0,
        K_ROWS=cfg.k_rows, USE_DOT=cfg.use_dot, DOT_PRECISION=precision, UPCAST=upcast,
        NUM_STAGES=cfg.num_stages,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    _combine_kernel[(bs, n_heads)](
        po, num_splits, lse, out,
        po.stride(0), po.stride(1), po.stride(2),
        lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, SPLITS_PAD=_next_pow2(workspace.max_splits),
        num_warps=4,
    )  # fmt: skip
    return out


__all__ = [
    "COMBINE_KERNEL_NAME",
    "COMBINE_N_SPLITS_ARG",
    "COMBINE_PARTIAL_O_ARG",
    "DEFAULT_CONFIGS",
    "DecodeWorkspace",
    "FALLBACK_CONFIG",
    "KernelConfig",
    "MAIN_KERNEL_NAME",
    "MAIN_PARTIAL_O_ARG",
    "default_config",
    "flash_decode",
]
