"""The split-count ladder of the split-KV decode kernel (pure Python, no torch).

Eager decode and the graph paths (``mode="graph"`` captures with ``ns(max_context)``; exact mode
retunes ``grid.z`` per token) call the same two functions, so one request length always gets the
same geometry wherever it runs.

The ladder: the main kernel runs ``bs * n_kv_heads * ns`` programs, and we want about
``PROGRAMS_PER_SM`` of them per multiprocessor. The split count is a power of two,

    ns(t_kv) = min(cap, pow2_floor(t_kv // BLOCK_N))        (1 when t_kv < 2 * BLOCK_N)
    cap      = min(LADDER_MAX_SPLITS, pow2_floor(PROGRAMS_PER_SM * num_sms // (bs * n_kv)))

and ``fa_split_keys`` returns ``ceil(t_kv / ns)`` keys per split (at least ``BLOCK_N``), which
gives back exactly ``ns = ceil(t_kv / split_keys)``. Hence:

- no split is given fewer than ``MIN_SPLIT_KEYS`` (= one ``BLOCK_N`` tile) keys;
- ``ns`` is non-decreasing in ``t_kv`` and changes at most ``log2(cap)`` <= 6 times from 1 to
  128k keys (each change is a graph-node edit in exact mode, so rare steps are the point);
- for long contexts the grid holds ``bs * n_kv * cap`` programs: between 1 and 2 per SM while
  ``bs * n_kv <= 2 * num_sms``, one split per (request, KV head) beyond that.

Example, Llama-3.2-1B (8 KV heads) on an H200 (132 SMs): bs=1 caps at 32 splits (256 programs),
bs=8 at 4 (256), bs=32 at 1 (256).
"""

from __future__ import annotations

BLOCK_N = 64  # keys per tile of the main kernel; chunk sizes are rounded up to it
MIN_SPLIT_KEYS = BLOCK_N  # the ladder never gives a split fewer keys than one tile
PROGRAMS_PER_SM = 2  # occupancy target of the main kernel's grid
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


def ladder_cap(n_kv_heads: int, bs: int, num_sms: int) -> int:
    """The largest split count the ladder uses for this grid (a power of two, <= 64)."""
    _check(0, n_kv_heads, bs, num_sms)
    base = bs * n_kv_heads
    wanted = max(1, PROGRAMS_PER_SM * num_sms // base)
    return min(LADDER_MAX_SPLITS, _pow2_floor(wanted))


def fa_split_keys(t_kv: int, n_kv_heads: int, bs: int, num_sms: int) -> int:
    """Keys per split for a live maximum length ``t_kv`` (always >= ``MIN_SPLIT_KEYS``)."""
    _check(t_kv, n_kv_heads, bs, num_sms)
    ns = min(ladder_cap(n_kv_heads, bs, num_sms), _pow2_floor(t_kv // MIN_SPLIT_KEYS))
    return max(MIN_SPLIT_KEYS, -(-t_kv // ns))


def num_splits_for(t_kv: int, n_kv_heads: int, bs: int, num_sms: int, max_splits: int) -> int:
    """``ns = ceil(t_kv / fa_split_keys(...))`` clamped to ``[1, max_splits]``."""
    if max_splits < 1:
        raise ValueError(f"max_splits must be >= 1, got {max_splits}")
    split_keys = fa_split_keys(t_kv, n_kv_heads, bs, num_sms)
    return max(1, min(max_splits, -(-t_kv // split_keys)))


def ladder_steps(
    n_kv_heads: int, bs: int, num_sms: int, max_splits: int, t_max: int = 131072
) -> list[tuple[int, int]]:
    """``[(t_kv, ns), ...]``: ``(1, ns(1))`` and then every ``t_kv <= t_max`` where ``ns`` changes.

    ``len(result) - 1`` is the number of steps (node edits in exact mode) from 1 to ``t_max``.
    """
    steps = [(1, num_splits_for(1, n_kv_heads, bs, num_sms, max_splits))]
    for t in range(2, t_max + 1):
        ns = num_splits_for(t, n_kv_heads, bs, num_sms, max_splits)
        if ns != steps[-1][1]:
            steps.append((t, ns))
    return steps


__all__ = [
    "BLOCK_N",
    "H200_NUM_SMS",
    "LADDER_MAX_SPLITS",
    "MIN_SPLIT_KEYS",
    "PROGRAMS_PER_SM",
    "fa_split_keys",
    "ladder_cap",
    "ladder_steps",
    "num_splits_for",
]
