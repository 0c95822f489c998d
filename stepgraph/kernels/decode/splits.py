"""The split-count ladder of the split-KV decode kernel (pure Python, no torch).

Eager decode and the graph paths (``mode="graph"`` captures with ``ns(max_context)``; exact mode
retunes ``grid.z`` per token) call the same two functions, so one request length always gets the
same geometry wherever it runs.

The ladder: the main kernel runs ``bs * n_kv_heads * ns`` programs, and we want about
``programs_per_sm`` of them per multiprocessor (``SplitLadder.programs_per_sm``, 4). The split
count is one per ``least`` keys, up to the cap,

    ns(t_kv) = min(cap, ceil(t_kv / least))  (1 when t_kv < 2 * least)
    cap      = min(LADDER_MAX_SPLITS, pow2_floor(programs_per_sm * num_sms // (bs * n_kv)))
    least    = CAP2_MIN_SPLIT_KEYS (384) where cap == 2, else MIN_SPLIT_KEYS (128);
               WIDE_MIN_SPLIT_KEYS (64) instead of 128 for heads wider than 64 (``head_dim``)

and ``fa_split_keys`` returns ``ceil(t_kv / ns)`` keys per split, which gives back exactly
``ns = ceil(t_kv / split_keys)``. Hence:

- below the cap every split fits one tile of the kernel variant (``least`` keys: the tuned
  variant's 128, ``flash_decode.DEFAULT_VARIANTS``; 64 for wider heads, whose variant takes
  64-key tiles), and holds at least two thirds of one (a shorter split would leave its tile
  mostly empty);
- the earlier ladder took a power of two, ``min(cap, pow2_floor(t_kv // least))``
  (``SplitLadder.pow2_splits``): one tile a split only where ``t_kv`` is a power of two times
  ``least``, and just past one (513 keys: four splits of 129) two tiles, the second nearly
  empty, which cost the 1B's step 5% at 535 keys (docs/experiments.md#whole-tiles-a-split);
- ``ns`` is non-decreasing in ``t_kv``; it changes every ``least`` keys up to the cap (each
  change is a graph-node edit in exact mode: one every 128 steps at most, host work only);
- for long contexts the grid holds ``bs * n_kv * cap`` programs: between ``programs_per_sm / 2``
  and ``programs_per_sm`` per SM while ``bs * n_kv <= programs_per_sm * num_sms`` (and the cap
  of 64 splits is not reached), one split per (request, KV head) beyond that.

Why 4 per SM: one program streams one split serially, so the bytes in flight per SM are about
programs x (num_stages - 1) x one K+V tile (16 KB at BLOCK_N=64, head_dim 64, bf16). At 2 per
SM (the first ladder) the kernel reached ~60% of copy bandwidth; 4 programs of 4 warps with a
3-stage pipeline (48 KB of shared memory each) fit on one SM together, in a single wave.
``benchmarks/flash_decode_sweep.py`` times 2, 4 and 8 on the device.

Example, Llama-3.2-1B (8 KV heads) on an H200 (132 SMs), 4 per SM: bs=1 caps at 64 splits
(512 programs), bs=8 at 8 (512), bs=32 at 2 (512).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

BLOCK_N = 64  # keys per tile of the fallback variant; the ladder's keys are multiples of it
# The ladder never gives a split fewer keys than this: 128, the tile of the tuned variant (a
# 64-key split would leave half of its tile empty; docs/experiments.md#split-ladder).
MIN_SPLIT_KEYS_DEFAULT = MIN_SPLIT_KEYS = 2 * BLOCK_N
# Where the grid holds two splits at most (cap 2: the 1B preset's bucket 32), a split takes at
# least this many keys: one split below 768 keys, so no merge (docs/experiments.md#split-ladder).
CAP2_MIN_SPLIT_KEYS_DEFAULT = CAP2_MIN_SPLIT_KEYS = 6 * BLOCK_N
# Heads wider than 64 (head_dim 128: Llama-3.1-8B, most 7B+ models) take at least this many keys
# a split instead of MIN_SPLIT_KEYS: 64 keys hold the 16 KB of K that 128 keys hold at head_dim
# 64 (docs/experiments.md#split-ladder). The ladder takes head_dim where its caller knows it
# (the model's attention backend, which hands the same ladder to exact mode: ``ladder_for``).
WIDE_MIN_SPLIT_KEYS_DEFAULT = WIDE_MIN_SPLIT_KEYS = BLOCK_N
PROGRAMS_PER_SM = 4  # the main kernel's occupancy target (the sweep tries 2, 4, 8)


@dataclass(frozen=True)
class SplitLadder:
    """The ladder's measured choices (``DecodeTuning.split``): the keys of one split's tile below
    cap 2 (``min_keys``), at cap 2 (``cap2_min_keys``), for heads wider than 64
    (``wide_min_keys``), each a positive multiple of ``BLOCK_N``; the programs a
    multiprocessor the grid aims at (``programs_per_sm``, at least 1); and ``pow2_splits``,
    the earlier power-of-two split counts."""

    min_keys: int = MIN_SPLIT_KEYS
    cap2_min_keys: int = CAP2_MIN_SPLIT_KEYS
    wide_min_keys: int = WIDE_MIN_SPLIT_KEYS
    programs_per_sm: int = PROGRAMS_PER_SM
    pow2_splits: bool = False  # the earlier ladder: power-of-two split counts (module docstring)

    def __post_init__(self) -> None:
        for name in ("min_keys", "cap2_min_keys", "wide_min_keys"):
            keys = getattr(self, name)
            if type(keys) is not int or keys < BLOCK_N or keys % BLOCK_N:
                raise ValueError(
                    f"split.{name}={keys!r} must be a positive multiple of {BLOCK_N} (BLOCK_N)"
                )
        pps = self.programs_per_sm
        if type(pps) is not int or pps < 1:
            raise ValueError(f"split.programs_per_sm={pps!r} must be an int of at least 1")
        if type(self.pow2_splits) is not bool:
            raise ValueError(f"split.pow2_splits={self.pow2_splits!r} must be a bool")


DEFAULT_LADDER = SplitLadder()
LADDER_MAX_SPLITS = 64  # ladder cap; with ns <= 64 <= keys per split, ceil(t / ceil(t / ns)) == ns
H200_NUM_SMS = 132


def _pow2_floor(x: int) -> int:
    return 1 << (max(1, x).bit_length() - 1)


def _check(t_kv: int, n_kv_heads: int, bs: int, num_sms: int) -> None:
    if t_kv < 0 or n_kv_heads < 1 or bs < 1 or num_sms < 1:
        raise ValueError(
            f"split ladder needs t_kv >= 0 and n_kv_heads, bs, num_sms >= 1; got "
            f"t_kv={t_kv}, n_kv_heads={n_kv_heads}, bs={bs}, num_sms={num_sms}"
        )


def ladder_cap(
    n_kv_heads: int,
    bs: int,
    num_sms: int,
    programs_per_sm: int | None = None,
    ladder: SplitLadder = DEFAULT_LADDER,
) -> int:
    """The largest split count the ladder uses for this grid (a power of two, <= 64);
    ``programs_per_sm`` None: ``ladder.programs_per_sm``."""
    _check(0, n_kv_heads, bs, num_sms)
    if programs_per_sm is None:
        programs_per_sm = ladder.programs_per_sm
    if programs_per_sm < 1:
        raise ValueError(f"split ladder needs programs_per_sm >= 1, got {programs_per_sm}")
    base = bs * n_kv_heads
    wanted = max(1, programs_per_sm * num_sms // base)
    return min(LADDER_MAX_SPLITS, _pow2_floor(wanted))


def _uncapped_least(head_dim: int | None, ladder: SplitLadder = DEFAULT_LADDER) -> int:
    """The least keys a split below cap 2: ``ladder.wide_min_keys`` for heads wider than 64,
    else (or with no ``head_dim``) ``ladder.min_keys``."""
    return ladder.wide_min_keys if head_dim is not None and head_dim > 64 else ladder.min_keys


def least_keys(cap: int, head_dim: int | None = None, ladder: SplitLadder = DEFAULT_LADDER) -> int:
    """The fewest keys the ladder gives a split at cap ``cap`` for heads of ``head_dim`` (None:
    64): ``ladder.cap2_min_keys`` at cap 2 (for every head_dim), else ``_uncapped_least``."""
    if cap == 2:
        return max(ladder.min_keys, ladder.cap2_min_keys)
    return _uncapped_least(head_dim, ladder)


def fa_split_keys(
    t_kv: int,
    n_kv_heads: int,
    bs: int,
    num_sms: int,
    programs_per_sm: int | None = None,
    head_dim: int | None = None,
    ladder: SplitLadder = DEFAULT_LADDER,
) -> int:
    """Keys per split for a live maximum length ``t_kv``: ``ceil(t_kv / ns)`` for the ladder's
    ``ns`` (module docstring); ``least_keys`` or more while one split takes it all."""
    _check(t_kv, n_kv_heads, bs, num_sms)
    cap = ladder_cap(n_kv_heads, bs, num_sms, programs_per_sm, ladder)
    least = least_keys(cap, head_dim, ladder)
    if t_kv < 2 * least:
        return max(least, t_kv)
    if ladder.pow2_splits:
        ns = min(cap, _pow2_floor(t_kv // least))
    else:
        ns = min(cap, -(-t_kv // least))
    return -(-t_kv // ns)


def splits_from_keys(t_kv: int, split_keys: int, max_splits: int) -> int:
    """``ns = ceil(t_kv / split_keys)`` clamped to ``[1, max_splits]``: what a ladder's keys per
    split mean as a split count (eager, graph capture and exact mode all go through here)."""
    return max(1, min(max_splits, -(-t_kv // split_keys)))


def num_splits_for(
    t_kv: int,
    n_kv_heads: int,
    bs: int,
    num_sms: int,
    max_splits: int,
    programs_per_sm: int | None = None,
    head_dim: int | None = None,
    ladder: SplitLadder = DEFAULT_LADDER,
) -> int:
    """``ns = ceil(t_kv / fa_split_keys(...))`` clamped to ``[1, max_splits]``."""
    if max_splits < 1:
        raise ValueError(f"max_splits must be >= 1, got {max_splits}")
    split_keys = fa_split_keys(t_kv, n_kv_heads, bs, num_sms, programs_per_sm, head_dim, ladder)
    return splits_from_keys(t_kv, split_keys, max_splits)


def monotone_steps(ns_of: Callable[[int], int], t_max: int) -> tuple[list[int], list[int]]:
    """The steps of a non-decreasing step function on ``[1, t_max]``: ``(starts, values)``, where
    ``values[i]`` holds from ``starts[i]`` up to the next start.

    Found by bisection (about 17 evaluations per step for 128k), so a ladder of a handful of
    steps costs well under a millisecond once, and every later look-up is a ``bisect``.
    """
    starts, values = [1], [ns_of(1)]
    last = ns_of(t_max)
    while values[-1] != last and starts[-1] < t_max:
        lo, hi = starts[-1], t_max  # ns_of(lo) == values[-1] != ns_of(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if ns_of(mid) == values[-1] else (lo, mid)
        starts.append(hi)
        values.append(ns_of(hi))
    return starts, values


def ladder_steps(
    n_kv_heads: int,
    bs: int,
    num_sms: int,
    max_splits: int,
    t_max: int = 131072,
    programs_per_sm: int | None = None,
    head_dim: int | None = None,
    ladder: SplitLadder = DEFAULT_LADDER,
) -> list[tuple[int, int]]:
    """``[(t_kv, ns), ...]``: ``(1, ns(1))`` and then every ``t_kv <= t_max`` where ``ns`` changes.

    ``len(result) - 1`` is the number of steps (node edits in exact mode) from 1 to ``t_max``.
    Relies on ``ns`` being non-decreasing in ``t_kv`` (tests/test_splits.py checks that on a
    dense sweep).
    """

    def ns_of(t: int) -> int:
        return num_splits_for(
            t, n_kv_heads, bs, num_sms, max_splits, programs_per_sm, head_dim, ladder
        )

    return list(zip(*monotone_steps(ns_of, t_max)))


def ladder_for(
    head_dim: int | None, ladder: SplitLadder = DEFAULT_LADDER
) -> Callable[[int, int, int, int], int]:
    """The ladder ``split_keys(t_kv, n_kv_heads, bs, num_sms)`` for heads of ``head_dim`` with
    ``ladder``'s choices: ``fa_split_keys`` itself where that is the default head_dim-64
    ladder, else a copy bound to both and marked ``monotone`` (``graph_update.fa_apply``
    tabulates it once). Exact mode must retune with the ladder eager takes: the attention
    backend hands out this one."""
    if ladder == DEFAULT_LADDER and _uncapped_least(head_dim) == _uncapped_least(None):
        return fa_split_keys
    return _bound_ladder(head_dim, ladder)


@functools.cache  # one object a (head_dim, ladder): fa_apply's cached intervals hold across calls
def _bound_ladder(head_dim: int | None, ladder: SplitLadder) -> Callable[[int, int, int, int], int]:
    def split_keys(t_kv: int, n_kv_heads: int, bs: int, num_sms: int) -> int:
        return fa_split_keys(t_kv, n_kv_heads, bs, num_sms, head_dim=head_dim, ladder=ladder)

    split_keys.monotone = True  # type: ignore[attr-defined]
    split_keys.head_dim = head_dim  # type: ignore[attr-defined]
    split_keys.ladder = ladder  # type: ignore[attr-defined]
    return split_keys


__all__ = [
    "BLOCK_N",
    "CAP2_MIN_SPLIT_KEYS",
    "DEFAULT_LADDER",
    "H200_NUM_SMS",
    "LADDER_MAX_SPLITS",
    "MIN_SPLIT_KEYS",
    "MIN_SPLIT_KEYS_DEFAULT",
    "PROGRAMS_PER_SM",
    "SplitLadder",
    "WIDE_MIN_SPLIT_KEYS",
    "fa_split_keys",
    "ladder_cap",
    "ladder_for",
    "least_keys",
    "ladder_steps",
    "monotone_steps",
    "num_splits_for",
    "splits_from_keys",
]
