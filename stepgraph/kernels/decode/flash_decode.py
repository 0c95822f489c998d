"""Split-KV flash-decode attention over a paged KV cache: the launcher.

``flash_decode`` launches the two kernels of ``split_kv.py``: ``_split_kv_kernel`` over grid
``(bs, n_kv_heads, num_splits)`` writes fp32 partials per split, ``_combine_kernel`` over
``(bs, n_heads)`` merges the first ``n_splits`` of them. The split count comes from the ladder
(``splits.py``) at the live maximum length, or is given (graphs pass the captured one; exact mode
retunes the captured nodes per token through ``graph_update``).

Variants of the main kernel (``KernelVariant``: tile, warps, pipelining depth, page-per-tile
lookup, K layout, tensor cores or not) are constexprs and launch options of this one kernel, so
every variant keeps the driver-level argument layout of ``split_kv.py``. ``DEFAULT_VARIANTS``
holds the chosen one per shape; ``benchmarks/flash_decode_sweep.py`` times the candidates.
"""

from __future__ import annotations

import functools
import math

import torch

from ...errors import ConfigError
from ...tuning import DecodeTuning, default_tuning
from ..pdl import launch_options, resolve_pdl
from .decode_inputs import DecodeWorkspace, KernelVariant, _check_inputs
from .split_kv import (
    _INTERPRETED,
    COMBINE_KERNEL_NAME,
    COMBINE_N_SPLITS_ARG,
    COMBINE_PARTIAL_O_ARG,
    MAIN_KERNEL_NAME,
    MAIN_PARTIAL_O_ARG,
    _combine_kernel,
    _split_kv_kernel,
)
from .split_kv_fold import launch_fold
from .splits import H200_NUM_SMS, num_splits_for

DEFAULT_MAX_SPLITS = 64

# -- the default variant per (head_dim, page_size, dtype); any other shape gets FALLBACK_VARIANT --
# Edit after reading the "best overall" line of benchmarks/flash_decode_sweep.py on the target GPU.
# The H200's sweep chose n128w4s2 for the 1B's attention; other shapes keep the unmeasured
# fallback (docs/experiments.md#split-kv-kernel-variants).
FALLBACK_VARIANT = KernelVariant(block_n=64, num_warps=4, num_stages=3)
DEFAULT_VARIANTS: dict[tuple[int, int, torch.dtype], KernelVariant] = {
    (64, 64, torch.bfloat16): KernelVariant(block_n=128, num_warps=4, num_stages=2),
}


def default_variant(
    head_dim: int, page_size: int, dtype: torch.dtype, override: str | None = None
) -> KernelVariant:
    """The kernel variant ``flash_decode`` launches when no ``variant`` is given: ``override``
    (a ``KernelVariant.from_name`` name, ``DecodeTuning.attention_variant``) for every shape
    where given, else the table's."""
    name = override
    if name:
        return KernelVariant.from_name(name)
    return DEFAULT_VARIANTS.get((head_dim, page_size, dtype), FALLBACK_VARIANT)


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
    variant: KernelVariant | None = None,
    use_pdl: bool | None = False,
    fold_combine: bool = False,
    merge_splits: int | None = None,
    tuning: DecodeTuning | None = None,
) -> torch.Tensor:  # [bs, n_heads, head_dim], q.dtype
    """Decode attention of one new token per request over its paged keys and values.

    ``num_splits=None`` picks the split count from the ladder (``splits.num_splits_for``) at the
    live maximum length: the host int ``max_seq_len`` when given, else ``seq_lens.max().item()``
    (a device sync, refused during graph capture). Inside a graph, pass ``num_splits`` and a
    ``workspace`` so the graph owns its partials. ``variant`` picks the kernel variant (default:
    ``default_variant(head_dim, page_size, dtype)``). Returns ``out`` (allocated when None).

    ``use_pdl``: launch both kernels with programmatic dependent launch (``kernels/pdl.py``;
    None: wherever the GPU has it; a pair: the split kernel's and the combine's). Off by
    default: it made the fused step slower (docs/experiments.md#the-split-kernel-without-pdl);
    the parameters that mode exact edits are the same either way.

    ``fold_combine``: one launch, ``split_kv_fold._split_kv_fold_kernel`` (the last split of a
    row merges the partials; a row that fits in one split is written by split 0). The fused
    decode step uses it; the reference path keeps the two kernels. ``merge_splits``: the most
    splits any launch of this batch's class takes (the merge reduces over a block of its next
    power of two, so every count up to it gives the same bits); default ``max_splits``.

    ``tuning`` (``DecodeTuning``; None: ``DecodeTuning.default()``): PDL on or off and its
    trigger, the ladder ``num_splits=None`` takes, and the variant where none is given.
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
        num_splits = num_splits_for(
            max_seq_len,
            n_kv_heads,
            max(bs, 1),
            sms,
            max_splits,
            ladder=default_tuning(tuning).split,
        )
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
    t = default_tuning(tuning)
    cfg = (
        variant
        if variant is not None
        else default_variant(head_dim, page_size, q.dtype, t.attention_variant)
    )
    group = n_heads // n_kv_heads
    group_pad = max(16, _next_pow2(group)) if cfg.use_dot else _next_pow2(group)
    po, lse = workspace.partial_o, workspace.partial_lse
    upcast = _INTERPRETED and q.dtype == torch.bfloat16
    precision = "ieee" if q.dtype == torch.float32 or upcast else None  # None: the default
    upcast = upcast or not cfg.use_dot  # the FMA path computes in fp32
    # PDL: a constexpr and a launch option only; the driver-level parameters (what graph_update
    # edits in mode "exact") are unchanged
    split_pdl, combine_pdl = use_pdl if isinstance(use_pdl, tuple) else (use_pdl, use_pdl)
    pdl = resolve_pdl(split_pdl, q.device, t)
    cpdl = resolve_pdl(combine_pdl, q.device, t)
    if fold_combine:
        if workspace.tickets is None or workspace.tickets.numel() < bs * n_kv_heads:
            raise ConfigError(
                "flash_decode(fold_combine=True) needs a workspace with tickets (at least "
                f"bs * n_kv_heads = {bs * n_kv_heads} int32 zeros): DecodeWorkspace.allocate"
            )
        merge = workspace.max_splits if merge_splits is None else merge_splits
        if not num_splits <= merge <= workspace.max_splits:
            raise ConfigError(
                f"flash_decode: merge_splits={merge} must lie in [num_splits={num_splits}, "
                f"workspace.max_splits={workspace.max_splits}]: pass the class's largest count"
            )
        return launch_fold(
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
            _next_pow2(merge),
            pdl,
            launch_options(pdl),
        )

    _split_kv_kernel[(bs, n_kv_heads, num_splits)](
        po,
        lse,
        q,
        k_cache,
        v_cache,
        block_table,
        seq_lens,
        float(sm_scale),
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
        GROUP=group,
        GROUP_PAD=group_pad,
        HEAD_DIM=head_dim,
        PAGE_SIZE=page_size,
        BLOCK_N=cfg.block_n,
        PAGE_TILE=cfg.page_tile and page_size % cfg.block_n == 0,
        K_ROWS=cfg.k_rows,
        USE_DOT=cfg.use_dot,
        DOT_PRECISION=precision,
        UPCAST=upcast,
        NUM_STAGES=cfg.num_stages,
        USE_PDL=pdl,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **launch_options(pdl),
    )
    _combine_kernel[(bs, n_heads)](
        po,
        num_splits,
        lse,
        out,
        po.stride(0),
        po.stride(1),
        po.stride(2),
        lse.stride(0),
        lse.stride(1),
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        SPLITS_PAD=_next_pow2(workspace.max_splits),
        USE_PDL=cpdl,
        num_warps=4,
        **launch_options(cpdl),
    )
    return out


__all__ = [
    "COMBINE_KERNEL_NAME",
    "COMBINE_N_SPLITS_ARG",
    "COMBINE_PARTIAL_O_ARG",
    "DEFAULT_VARIANTS",
    "DecodeWorkspace",
    "FALLBACK_VARIANT",
    "KernelVariant",
    "MAIN_KERNEL_NAME",
    "MAIN_PARTIAL_O_ARG",
    "default_variant",
    "flash_decode",
]
