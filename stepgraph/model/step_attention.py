"""The fused decode step's attention: which split-KV launch serves a batch, and with what PDL.

- **One launch** (``kernels/split_kv_fold``) where the ladder gives every row one split at any
  context for the batch size's class (``backend.bucket_splits(bucket) == 1``: from bs 34 for
  Llama-3.2-1B), and at the classes ``fold_merge`` names (``FOLD_MERGE_TABLE`` per attention
  shape, or ``DecodeTuning.fold_merge`` for every shape), where the last split of each (row,
  KV head) to finish merges the group's partials.
- **Split + combine** (``backend.decode_attention``) everywhere else.
- **PDL** (``default_pdl``): at one row the split kernel is launched plainly (it starts once the
  qkv kernel has finished) but triggers at its start ("detached"), and the combine, a PDL
  launch, triggers before its wait ("early"): the combine is resident when the split ends,
  and o_proj's GEMV launches and streams its weights while the split runs (run K1,
  ``benchmarks/ab_step.py``, graph, three rounds, ms, ctx 512 / 4096: 0.765 / 0.815 against
  0.773 / 0.828 for the combine alone triggering at its wait; ``step_timeline.py``: a layer
  39.8 µs). That keeps the rule of ``kernels/pdl.py`` that no more than one kernel waits
  ahead: o_proj triggers after its own wait. From two rows the combine alone, with no explicit
  trigger ("exit": it launches as the split's programs end; E5: bs 2 / 4 / 8 0.960 / 0.977 /
  1.004 against 0.965 / 0.979 / 1.006 with none at ctx 512), since o_proj's tensor-core tiles
  launched early lose (E5, the combine triggering at its wait: bs 8 1.093; K1, detached and
  early: bs 2 / 4 / 8 0.985 / 1.000 / 1.027 against 0.950 / 0.961 / 0.988; detached and exit
  tied, 0.946 / 0.958 / 0.987, and 1.219 against 1.216 at bs 8 ctx 4096). The split kernel
  takes no PDL launch: launched early it waits on the qkv kernel and ends later than a plain
  launch would (run E4, ``step_timeline.py``, bs 1: it advances the step 5.8 µs a layer against
  3.9), also with its first tile loaded before the wait (runs E1-E2: bs 1 0.807 against 0.796,
  the one launch at bs 16-64 slower still; reverted). Earlier runs: D1 (ctx 512, bs 8 / 16 /
  32, ms): none 1.018 / 1.070 / 1.196; both kernels in the step's mode 1.111 / 1.153 / 1.257;
  the split alone 1.027 / 1.072 / 1.200; D7, the one launch at bs 16 / 32: none 1.069 / 1.171,
  late 1.099 / 1.209, exit 1.075 / 1.173. ``DecodeTuning.pdl.attention`` (``0``: none)
  overrides the defaults for every class.

Every choice is a function of the batch size's class (``bucket``, ``fused_decode.kernel_class``),
so eager, graph and exact mode run the same kernels; the merge's block of splits is the class's
largest split count, so a live count below it (eager, or exact mode retuning grid z) reduces
over the same block.
"""

from __future__ import annotations

import torch

from ..kernels.flash_decode import flash_decode
from ..kernels.pdl import TRIGGER_MODES
from ..kernels.splits import H200_NUM_SMS, ladder_cap
from ..tuning import FOLD_MERGE_TABLE, DecodeTuning, default_tuning


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


TRIGGER_TEXT = {1: "at its wait", 2: "after its key loop", 3: "at its exit",
                4: "before its wait", 5: "at its start"}  # fmt: skip


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
    split, combine = attention_pdl(use_pdl, bucket, t) or (False, False)

    def pdl(kernel: str, mode) -> str:  # mode None or True: the device's default, 1
        trigger = "" if mode is False else TRIGGER_TEXT[int(mode or 1)]
        how = "launched plainly" if mode == TRIGGER_MODES["detached"] else "with PDL"
        return trigger and f"; {kernel}{how}, trigger {trigger}"

    if cap == 1:
        return f"split_kv_fold, one launch (one split at every context{pdl('', split)})"
    if merges(shape, bucket, t):
        return (f"split_kv_fold, one launch (up to {cap} splits; the last of each row merges "
                f"them: FOLD_MERGE_TABLE{pdl('', split)})")  # fmt: skip
    both = pdl("the split ", split) + pdl("the combine ", combine)
    return f"split_kv + combine (up to {cap} splits{both})"


def attention(
    backend, layer_id: int, q: torch.Tensor, bucket: int, use_pdl=None,
    tuning: DecodeTuning | None = None,
) -> torch.Tensor:  # fmt: skip
    """Split-KV decode of ``q [bs, n_heads, head_dim]`` over layer ``layer_id``'s pages (its
    K/V already written), for a batch of class ``bucket``."""
    t = default_tuning(tuning)
    pdl = attention_pdl(use_pdl, bucket, t)
    splits = backend.bucket_splits(bucket) if backend.use_kernel else 1
    if not backend.use_kernel or (splits > 1 and not fold_merge(backend, bucket, t)):
        return backend.decode_attention(layer_id, q, pdl)
    m, kv = backend.meta, backend.kv_cache
    return flash_decode(
        q, kv.k_caches[layer_id], kv.v_caches[layer_id], m.block_table, m.seq_lens,
        num_splits=m.num_splits, workspace=m.workspace, sm_scale=backend.sm_scale,
        num_sms=backend.num_sms, use_pdl=pdl, fold_combine=True, merge_splits=splits, tuning=t,
    )  # fmt: skip


__all__ = ["FOLD_MERGE_TABLE", "attention", "attention_pdl", "attention_text", "default_pdl",
           "fold_merge", "merges"]  # fmt: skip
