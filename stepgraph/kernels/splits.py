"""The split-count ladder of the split-KV decode kernel (pure Python, no torch).

Eager decode and the graph paths (``mode="graph"`` captures with ``ns(max_context)``; exact mode
retunes ``grid.z`` per token) call the same two functions, so one request length always gets the
same geometry wherever it runs.

The ladder: the main kernel runs ``bs * n_kv_heads * ns`` programs, and we want about
``programs_per_sm`` of them per multiprocessor (default ``PROGRAMS_PER_SM``). The split count is
a power of two,

    ns(t_kv) = min(cap, pow2_floor(t_kv // least))  (1 when t_kv < 2 * least)
    cap      = min(LADDER_MAX_SPLITS, pow2_floor(programs_per_sm * num_sms // (bs * n_kv)))
    least    = CAP2_MIN_SPLIT_KEYS (384) where cap == 2, else MIN_SPLIT_KEYS (128);
               WIDE_MIN_SPLIT_KEYS (64) instead of 128 for heads wider than 64 (``head_dim``)

and ``fa_split_keys`` returns ``ceil(t_kv / ns)`` keys per split (at least ``least``), which
gives back exactly ``ns = ceil(t_kv / split_keys)``. Hence:

- no split is given fewer than ``MIN_SPLIT_KEYS`` keys (two ``BLOCK_N`` tiles; one tile of the
  tuned variant, ``flash_decode.DEFAULT_VARIANTS``, whose 128-key tile would round a 64-key
  split up and leave half the splits empty), or ``WIDE_MIN_SPLIT_KEYS`` for wider heads, whose
  kernel variant takes 64-key tiles;
- ``ns`` is non-decreasing in ``t_kv`` and changes at most ``log2(cap)`` <= 6 times from 1 to
  128k keys (each change is a graph-node edit in exact mode, so rare steps are the point);
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
import os
from collections.abc import Callable

BLOCK_N = 64  # keys per tile of the fallback variant; the ladder's keys are multiples of it
# The ladder never gives a split fewer keys than this: 128, the tile of the tuned variant (runs
# D2-D3, benchmarks/ab_step.py, graph: 1B bs 1 ctx 4096 0.841 ms against 0.851 with 64, where
# the 64-key splits left half of the 64 empty; bs 8 ctx 512 1.007 against 1.015). The
# STEPGRAPH_MIN_SPLIT_KEYS (a multiple of BLOCK_N) is the A/B switch.
MIN_SPLIT_KEYS_DEFAULT = 2 * BLOCK_N


def _keys_env(name: str, default: int) -> int:
    """``$name`` (default ``default``), refused unless a positive multiple of ``BLOCK_N``."""
    keys = int(os.environ.get(name, default))
    if keys < BLOCK_N or keys % BLOCK_N:
        raise ValueError(f"{name}={keys} must be a positive multiple of {BLOCK_N}")
    return keys


def min_split_keys_env() -> int:
    """``$STEPGRAPH_MIN_SPLIT_KEYS`` (default ``MIN_SPLIT_KEYS_DEFAULT``), refused unless a
    positive multiple of ``BLOCK_N``; ``benchmarks/ab_step.py`` re-reads it per variant."""
    return _keys_env("STEPGRAPH_MIN_SPLIT_KEYS", MIN_SPLIT_KEYS_DEFAULT)


MIN_SPLIT_KEYS = min_split_keys_env()
# Where the grid holds two splits at most (cap 2: the 1B preset's bucket 32), a split takes at
# least this many keys: one split below 768 keys, so no merge, two from 768 (runs M1-M2,
# ab_step graph ms at bs 32: ctx 512 1.151 against 1.172, 640 1.193 against 1.206, 768 to 4096
# within 0.1%; bs 20 at 512 1.119 against 1.128; one split of 768 had lost in the twelfth
# session, 1.230 against 1.224).
# STEPGRAPH_CAP2_MIN_SPLIT_KEYS (a multiple of BLOCK_N) is the A/B switch; ab_step re-reads it.
CAP2_MIN_SPLIT_KEYS_DEFAULT = 6 * BLOCK_N


def cap2_min_split_keys_env() -> int:
    """``$STEPGRAPH_CAP2_MIN_SPLIT_KEYS`` (default ``CAP2_MIN_SPLIT_KEYS_DEFAULT``), refused
    unless a positive multiple of ``BLOCK_N``."""
    return _keys_env("STEPGRAPH_CAP2_MIN_SPLIT_KEYS", CAP2_MIN_SPLIT_KEYS_DEFAULT)


CAP2_MIN_SPLIT_KEYS = cap2_min_split_keys_env()
# Heads wider than 64 (head_dim 128: Llama-3.1-8B, most 7B+ models) take at least this many keys
# a split instead of MIN_SPLIT_KEYS: 64 keys hold the 16 KB of K that 128 keys hold at head_dim
# 64. Run N4 (ab_step.py --model llama-3.1-8b --batch-sizes 1,2, three interleaved rounds,
# graph ms against 128 keys): bs 1 at ctx 512 / 1024 / 2048 / 4096 3.989 / 4.040 / 4.097 /
# 4.165 against 4.056 / 4.069 / 4.121 / 4.193; bs 2 4.290 / 4.336 / 4.415 / 4.528 against
# 4.338 / 4.369 / 4.424 / 4.529. bs 4-16 take the same counts at ctx 4096 (N1), more splits
# at shorter contexts.
# The ladder takes head_dim where its caller knows it (the model's attention backend, which
# hands the same ladder to exact mode: ``ladder_for``); without it, the head_dim-64 ladder.
# STEPGRAPH_WIDE_MIN_SPLIT_KEYS (a multiple of BLOCK_N) is the A/B switch; ab_step re-reads it.
WIDE_MIN_SPLIT_KEYS_DEFAULT = BLOCK_N


def wide_min_split_keys_env() -> int:
    """``$STEPGRAPH_WIDE_MIN_SPLIT_KEYS`` (default ``WIDE_MIN_SPLIT_KEYS_DEFAULT``), refused
    unless a positive multiple of ``BLOCK_N``."""
    return _keys_env("STEPGRAPH_WIDE_MIN_SPLIT_KEYS", WIDE_MIN_SPLIT_KEYS_DEFAULT)


WIDE_MIN_SPLIT_KEYS = wide_min_split_keys_env()


def programs_per_sm_env() -> int:
    """``$STEPGRAPH_PROGRAMS_PER_SM`` (default 4), the occupancy target of the main kernel's grid
    (the sweep tries 2, 4, 8); ``benchmarks/ab_step.py`` re-reads it per variant."""
    pps = int(os.environ.get("STEPGRAPH_PROGRAMS_PER_SM", 4))
    if pps < 1:
        raise ValueError(f"STEPGRAPH_PROGRAMS_PER_SM={pps} must be at least 1")
    return pps


# Read at each call where a caller passes none, so a re-read (ab_step) takes effect.
PROGRAMS_PER_SM = programs_per_sm_env()
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


def ladder_cap(n_kv_heads: int, bs: int, num_sms: int, programs_per_sm: int | None = None) -> int:
    """The largest split count the ladder uses for this grid (a power of two, <= 64)."""
    _check(0, n_kv_heads, bs, num_sms)
    if programs_per_sm is None:
        programs_per_sm = PROGRAMS_PER_SM
    if programs_per_sm < 1:
        raise ValueError(f"split ladder needs programs_per_sm >= 1, got {programs_per_sm}")
    base = bs * n_kv_heads
    wanted = max(1, programs_per_sm * num_sms // base)
    return min(LADDER_MAX_SPLITS, _pow2_floor(wanted))


def _uncapped_least(head_dim: int | None) -> int:
    """The least keys a split below cap 2: ``WIDE_MIN_SPLIT_KEYS`` for heads wider than 64,
    else (or with no ``head_dim``) ``MIN_SPLIT_KEYS``."""
    return WIDE_MIN_SPLIT_KEYS if head_dim is not None and head_dim > 64 else MIN_SPLIT_KEYS


def least_keys(cap: int, head_dim: int | None = None) -> int:
    """The fewest keys the ladder gives a split at cap ``cap`` for heads of ``head_dim`` (None:
    64): ``CAP2_MIN_SPLIT_KEYS`` at cap 2 (for every head_dim), else ``_uncapped_least``."""
    if cap == 2:
        return max(MIN_SPLIT_KEYS, CAP2_MIN_SPLIT_KEYS)
    return _uncapped_least(head_dim)


def fa_split_keys(
    t_kv: int,
    n_kv_heads: int,
    bs: int,
    num_sms: int,
    programs_per_sm: int | None = None,
    head_dim: int | None = None,
) -> int:
    """Keys per split for a live maximum length ``t_kv`` (always >= ``least_keys``)."""
    _check(t_kv, n_kv_heads, bs, num_sms)
    cap = ladder_cap(n_kv_heads, bs, num_sms, programs_per_sm)
    least = least_keys(cap, head_dim)
    ns = min(cap, _pow2_floor(t_kv // least))
    return max(least, -(-t_kv // ns))


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
) -> int:
    """``ns = ceil(t_kv / fa_split_keys(...))`` clamped to ``[1, max_splits]``."""
    if max_splits < 1:
        raise ValueError(f"max_splits must be >= 1, got {max_splits}")
    split_keys = fa_split_keys(t_kv, n_kv_heads, bs, num_sms, programs_per_sm, head_dim)
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
) -> list[tuple[int, int]]:
    """``[(t_kv, ns), ...]``: ``(1, ns(1))`` and then every ``t_kv <= t_max`` where ``ns`` changes.

    ``len(result) - 1`` is the number of steps (node edits in exact mode) from 1 to ``t_max``.
    Relies on ``ns`` being non-decreasing in ``t_kv`` (tests/test_splits.py checks that on a
    dense sweep).
    """

    def ns_of(t: int) -> int:
        return num_splits_for(t, n_kv_heads, bs, num_sms, max_splits, programs_per_sm, head_dim)

    return list(zip(*monotone_steps(ns_of, t_max)))


def ladder_for(head_dim: int | None) -> Callable[[int, int, int, int], int]:
    """The ladder ``split_keys(t_kv, n_kv_heads, bs, num_sms)`` for heads of ``head_dim``:
    ``fa_split_keys`` itself where that is the head_dim-64 ladder, else a copy bound to
    ``head_dim`` and marked ``monotone`` (``graph_update.fa_apply`` tabulates it once). Exact
    mode must retune with the ladder eager takes: the attention backend hands out this one."""
    if _uncapped_least(head_dim) == _uncapped_least(None):
        return fa_split_keys
    return _wide_ladder(head_dim)


@functools.cache  # one object a head_dim, so fa_apply's cached intervals hold across calls
def _wide_ladder(head_dim: int) -> Callable[[int, int, int, int], int]:
    def split_keys(t_kv: int, n_kv_heads: int, bs: int, num_sms: int) -> int:
        return fa_split_keys(t_kv, n_kv_heads, bs, num_sms, head_dim=head_dim)

    split_keys.monotone = True  # type: ignore[attr-defined]
    split_keys.head_dim = head_dim  # type: ignore[attr-defined]
    return split_keys


__all__ = [
    "BLOCK_N",
    "CAP2_MIN_SPLIT_KEYS",
    "H200_NUM_SMS",
    "LADDER_MAX_SPLITS",
    "MIN_SPLIT_KEYS",
    "MIN_SPLIT_KEYS_DEFAULT",
    "PROGRAMS_PER_SM",
    "WIDE_MIN_SPLIT_KEYS",
    "cap2_min_split_keys_env",
    "fa_split_keys",
    "ladder_cap",
    "ladder_for",
    "least_keys",
    "min_split_keys_env",
    "ladder_steps",
    "monotone_steps",
    "num_splits_for",
    "programs_per_sm_env",
    "splits_from_keys",
    "wide_min_split_keys_env",
]
