"""The fused decode step's attention: which split-KV launch serves a batch, and with what PDL.

- **One launch** (``kernels/decode/split_kv_fold``) where the ladder gives every row one split at
  any context for the batch size's class (``backend.bucket_splits(bucket) == 1``: from bs 34 for
  Llama-3.2-1B), and at the classes ``fold_merge`` names (``FOLD_MERGE_TABLE`` per attention
  shape, or ``DecodeTuning.fold_merge`` for every shape), where the last split of each (row,
  KV head) to finish merges the group's partials (docs/experiments.md#the-attention-in-one-launch).
- **Split + combine** (``backend.decode_attention``) everywhere else.
- **PDL** (``default_pdl``): at one row the split kernel is launched plainly but triggers at
  its start ("detached"), and the combine, a PDL launch, triggers before its wait ("early"), so
  the combine is resident when the split ends and o_proj streams its weights meanwhile; from two
  rows the combine alone, triggering at its exit, since o_proj's tensor-core tiles launched
  early lose. The split kernel takes no PDL launch: launched early it waits on the qkv kernel
  and ends later (docs/experiments.md#pdl-placement). ``DecodeTuning.pdl.attention``
  overrides these.

Every choice is a function of the batch size's class (``bucket``, ``fused_decode.kernel_class``),
so eager, graph and exact mode run the same kernels; the merge's block of splits is the class's
largest split count, so a live count below it (eager, or exact mode retuning grid z) reduces
over the same block. ``attention_plan`` makes the choice (``model/decode/step_plan.py`` holds it in
the step's plan); ``attention`` executes it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...kernels.decode.flash_decode import flash_decode
from ...kernels.decode.splits import H200_NUM_SMS, ladder_cap
from ...kernels.pdl import TRIGGER_MODES
from ...tuning import FOLD_MERGE_TABLE, DecodeTuning, default_tuning


def default_pdl(bucket: int) -> tuple[int | bool, int]:
    """The (split, combine) PDL modes at class ``bucket``: detached and early at one row, none
    and exit from two (above)."""
    if bucket == 1:
        return TRIGGER_MODES["detached"], TRIGGER_MODES["early"]
    return False, TRIGGER_MODES["exit"]


def attention_pdl(use_pdl, bucket: int, tuning: DecodeTuning | None = None) -> bool | tuple:
    """``flash_decode``'s ``use_pdl`` (split, combine) for the step's attention at class
    ``bucket``, where the projections run ``use_pdl``: none where they run without PDL, else
    ``default_pdl``'s; ``tuning.pdl.attention``, when set, in its modes or else the
    projections'."""
    modes = default_tuning(tuning).pdl.attention_modes
    if modes is None:
        off = use_pdl is not None and not use_pdl  # False (or 0): the step runs without PDL
        return False if off else default_pdl(bucket)
    split, combine, mode = modes
    mode = mode or use_pdl or None

    def one(part):  # True: the mode; a mode itself (SPLIT,COMBINE) as given
        return part if not isinstance(part, bool) else (mode if part else False)

    return (one(split), one(combine))


def merges(shape: tuple[int, int, int], bucket: int, tuning: DecodeTuning | None = None) -> bool:
    """Whether class ``bucket`` of attention ``shape`` (n_heads, n_kv_heads, head_dim) takes the
    fold with its merge: ``tuning.fold_merge`` if set, else ``tuning.fold_merge_table``."""
    t = default_tuning(tuning)
    if t.fold_merge is not None:
        return bucket in t.fold_merge
    return bucket in t.fold_merge_table.get(shape, ())


def fold_merge(backend, bucket: int, tuning: DecodeTuning | None = None) -> bool:
    """``merges`` at the backend's attention shape."""
    return merges((backend.num_heads, backend.num_kv_heads, backend.head_dim), bucket, tuning)


@dataclass(frozen=True)
class AttentionPlan:
    """The attention of one class: ``splits``, the class's largest split count (the merge's
    block); ``fold``: one launch (``split_kv_fold``), else split + combine; ``pdl``:
    ``flash_decode``'s ``use_pdl``."""

    splits: int
    fold: bool
    pdl: bool | tuple


def attention_plan(
    shape: tuple[int, int, int],
    splits: int,
    bucket: int,
    use_pdl=None,
    tuning: DecodeTuning | None = None,
    kernel: bool = True,
) -> AttentionPlan:
    """The attention of class ``bucket`` for attention ``shape`` with ``splits`` splits at most,
    where the projections run ``use_pdl``: one launch where every row has one split or the
    class merges (``merges``), with the kernels (``kernel``); else split + combine."""
    t = default_tuning(tuning)
    fold = kernel and (splits == 1 or merges(shape, bucket, t))
    return AttentionPlan(splits, fold, attention_pdl(use_pdl, bucket, t))


TRIGGER_TEXT = {
    1: "at its wait",
    2: "after its key loop",
    3: "at its exit",
    4: "before its wait",
    5: "at its start",
}


def attention_text(
    shape: tuple[int, int, int],
    bucket: int,
    num_sms: int = H200_NUM_SMS,
    use_pdl=None,
    tuning: DecodeTuning | None = None,
) -> str:
    """What ``attention`` launches for class ``bucket`` where the projections run ``use_pdl``
    (``stepgraph info``; the ladder's largest split count on ``num_sms`` multiprocessors, the
    H200's by default), and which of its launches take PDL."""
    t = default_tuning(tuning)
    cap = ladder_cap(shape[1], bucket, num_sms, ladder=t.split)
    return describe(attention_plan(shape, cap, bucket, use_pdl, t))


def describe(plan: AttentionPlan) -> str:
    """``plan`` as ``stepgraph info`` prints it: the launches, which take PDL, and how."""
    split, combine = plan.pdl or (False, False)

    def pdl(kernel: str, mode) -> str:  # mode None or True: the device's default, 1
        trigger = "" if mode is False else TRIGGER_TEXT[int(mode or 1)]
        how = "launched plainly" if mode == TRIGGER_MODES["detached"] else "with PDL"
        return trigger and f"; {kernel}{how}, trigger {trigger}"

    if plan.splits == 1:
        return f"split_kv_fold, one launch (one split at every context{pdl('', split)})"
    if plan.fold:
        return (
            f"split_kv_fold, one launch (up to {plan.splits} splits; the last of each row "
            f"merges them: FOLD_MERGE_TABLE{pdl('', split)})"
        )
    both = pdl("the split ", split) + pdl("the combine ", combine)
    return f"split_kv + combine (up to {plan.splits} splits{both})"


def attention(
    backend,
    layer_id: int,
    q: torch.Tensor,
    bucket: int,
    use_pdl=None,
    tuning: DecodeTuning | None = None,
    plan: AttentionPlan | None = None,
) -> torch.Tensor:
    """Split-KV decode of ``q [bs, n_heads, head_dim]`` over layer ``layer_id``'s pages (its
    K/V already written), for a batch of class ``bucket``: as ``plan`` says (the step's plan,
    ``model/decode/step_plan.py``), else as ``attention_plan`` says for ``backend``."""
    t = default_tuning(tuning)
    if plan is None:
        splits = backend.bucket_splits(bucket) if backend.use_kernel else 1
        shape = (backend.num_heads, backend.num_kv_heads, backend.head_dim)
        plan = attention_plan(shape, splits, bucket, use_pdl, t, backend.use_kernel)
    if not plan.fold:
        return backend.decode_attention(layer_id, q, plan.pdl)
    m, kv = backend.meta, backend.kv_cache
    return flash_decode(
        q,
        kv.k_caches[layer_id],
        kv.v_caches[layer_id],
        m.block_table,
        m.seq_lens,
        num_splits=m.num_splits,
        workspace=m.workspace,
        sm_scale=backend.sm_scale,
        num_sms=backend.num_sms,
        use_pdl=plan.pdl,
        fold_combine=True,
        merge_splits=plan.splits,
        tuning=t,
    )


__all__ = [
    "FOLD_MERGE_TABLE",
    "AttentionPlan",
    "attention",
    "attention_pdl",
    "attention_plan",
    "attention_text",
    "default_pdl",
    "describe",
    "fold_merge",
    "merges",
]
