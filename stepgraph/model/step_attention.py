"""The fused decode step's attention: which split-KV launch serves a batch, and with what PDL.

- **One launch** (``kernels/split_kv_fold``) where the ladder gives every row one split at any
  context for the batch size's class (``backend.bucket_splits(bucket) == 1``: from bs 34 for
  Llama-3.2-1B), and at the classes ``fold_merge`` names (``FOLD_MERGE_TABLE`` per attention
  shape, or ``STEPGRAPH_FOLD_MERGE=LO-HI|none``), where the last split of each (row, KV head) to
  finish merges the group's partials.
- **Split + combine** (``backend.decode_attention``) everywhere else.
- **PDL** off unless ``ATTENTION_PDL`` (``STEPGRAPH_ATTENTION_PDL``, parsed by
  ``kernel_choice.attention_pdl_env``): run D1 (``benchmarks/ab_step.py``, graph, ctx 512, bs
  8 / 16 / 32, ms): none 1.018 / 1.070 / 1.196; both kernels in the step's mode 1.111 / 1.153
  / 1.257; the combine alone 1.105 / 1.150 / 1.256; the split alone 1.027 / 1.072 / 1.200;
  both with the trigger at the wait 1.049 / 1.105 / 1.250, at the exit 1.022 / 1.070 / 1.195.
  On the one launch at bs 16 / 32 (run D7, ctx 512): none 1.069 / 1.171, late 1.099 / 1.209,
  exit 1.075 / 1.173.

Every choice is a function of the batch size's class (``bucket``, ``fused_decode.kernel_class``),
so eager, graph and exact mode run the same kernels; the merge's block of splits is the class's
largest split count, so a live count below it (eager, or exact mode retuning grid z) reduces
over the same block.
"""

from __future__ import annotations

import torch

from ..kernels.flash_decode import flash_decode
from ..kernels.splits import H200_NUM_SMS, ladder_cap
from . import kernel_choice

ATTENTION_PDL = kernel_choice.attention_pdl_env()
# (n_heads, n_kv_heads, head_dim) -> the classes that take the fold with its merge where they
# have more than one split. Llama-3.2-1B: 16-32 (run D2, benchmarks/ab_step.py, graph, two
# interleaved rounds, ms, split + combine against the fold: ctx 512 bs 16 1.068 / 1.061, bs 32
# 1.194 / 1.170; ctx 4096 bs 16 1.511 / 1.505, bs 32 2.070 / 2.041; same logits bits); bs 8
# tied (1.015 / 1.017, 1.236 / 1.236) and bs 1 lost (0.796 / 0.801, 0.851 / 0.868). Llama-3.1-8B
# (head_dim 128) lost at bs 16 (run D3, ctx 4096: 6.805 against 6.356): none.
FOLD_MERGE_TABLE: dict[tuple[int, int, int], range] = {(32, 8, 64): range(16, 33)}
# STEPGRAPH_FOLD_MERGE=LO-HI|none: those classes for every shape (None: the table)
FOLD_MERGE = kernel_choice.buckets_env("STEPGRAPH_FOLD_MERGE", None)


def attention_pdl(use_pdl) -> bool | tuple:
    """``flash_decode``'s ``use_pdl`` for the step's attention: False, or (split, combine) in
    ``ATTENTION_PDL``'s mode, else the projections' ``use_pdl``."""
    if ATTENTION_PDL is None:
        return False
    split, combine, mode = ATTENTION_PDL
    mode = mode or use_pdl or None
    return (mode if split else False, mode if combine else False)


def merges(shape: tuple[int, int, int], bucket: int) -> bool:
    """Whether class ``bucket`` of attention ``shape`` (n_heads, n_kv_heads, head_dim) takes the
    fold with its merge: ``FOLD_MERGE`` if set, else ``FOLD_MERGE_TABLE``."""
    if FOLD_MERGE is not None:
        return bucket in FOLD_MERGE
    return bucket in FOLD_MERGE_TABLE.get(shape, ())


def fold_merge(backend, bucket: int) -> bool:
    """``merges`` at the backend's attention shape."""
    return merges((backend.num_heads, backend.num_kv_heads, backend.head_dim), bucket)


def attention_text(shape: tuple[int, int, int], bucket: int, num_sms: int = H200_NUM_SMS) -> str:
    """What ``attention`` launches for class ``bucket`` (``stepgraph info``; the ladder's
    largest split count on ``num_sms`` multiprocessors, the H200's by default)."""
    cap = ladder_cap(shape[1], bucket, num_sms)
    if cap == 1:
        return "split_kv_fold, one launch (one split at every context)"
    if merges(shape, bucket):
        return (f"split_kv_fold, one launch (up to {cap} splits; the last of each row merges "
                "them: FOLD_MERGE_TABLE)")  # fmt: skip
    return f"split_kv + combine (up to {cap} splits)"


def attention(backend, layer_id: int, q: torch.Tensor, bucket: int, use_pdl=None) -> torch.Tensor:
    """Split-KV decode of ``q [bs, n_heads, head_dim]`` over layer ``layer_id``'s pages (its
    K/V already written), for a batch of class ``bucket``."""
    pdl = attention_pdl(use_pdl)
    splits = backend.bucket_splits(bucket) if backend.use_kernel else 1
    if not backend.use_kernel or (splits > 1 and not fold_merge(backend, bucket)):
        return backend.decode_attention(layer_id, q, pdl)
    m, kv = backend.meta, backend.kv_cache
    return flash_decode(
        q, kv.k_caches[layer_id], kv.v_caches[layer_id], m.block_table, m.seq_lens,
        num_splits=m.num_splits, workspace=m.workspace, sm_scale=backend.sm_scale,
        num_sms=backend.num_sms, use_pdl=pdl, fold_combine=True, merge_splits=splits,
    )  # fmt: skip


__all__ = ["ATTENTION_PDL", "FOLD_MERGE", "FOLD_MERGE_TABLE", "attention", "attention_pdl",
           "attention_text", "fold_merge", "merges"]  # fmt: skip
