"""Bucket arithmetic, pure: which batch sizes get a graph, and which graph a live batch uses."""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from .errors import ConfigError, ReplayError

DEFAULT_MAX_BS = 256


def default_capture_sizes(max_bs: int = DEFAULT_MAX_BS) -> list[int]:
    """``[1, 2, 4, 8] + 16..max_bs step 16``, cut at ``max_bs`` (which is always included)."""
    if max_bs < 1:
        raise ConfigError(f"max_bs must be >= 1, got {max_bs}; pass a positive batch size.")
    sizes = [s for s in (1, 2, 4, 8) if s <= max_bs] + list(range(16, max_bs + 1, 16))
    if sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


def validate_buckets(sizes: Sequence[int], what: str = "capture_bs") -> list[int]:
    """Return ``sizes`` as a list if it is non-empty, positive, strictly increasing."""
    sizes = list(sizes)
    if not sizes:
        raise ConfigError(f"{what} is empty; give at least one bucket, e.g. [1, 2, 4, 8].")
    if any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes):
        raise ConfigError(f"{what} must hold positive ints, got {sizes}.")
    if any(b <= a for a, b in zip(sizes, sizes[1:])):
        raise ConfigError(
            f"{what} must be sorted and free of duplicates, got {sizes}; pass sorted(set({what}))."
        )
    return sizes


def pad_to_bucket(n: int, buckets: Sequence[int]) -> int:
    """Smallest bucket >= ``n`` (``buckets`` sorted ascending). Raises ``ReplayError`` above the
    largest bucket, naming it: such a batch must run eagerly or the buckets must grow."""
    if n < 1:
        raise ReplayError(f"empty batch (size {n}); there is nothing to replay, skip the step.")
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ReplayError(
            f"batch of {n} is larger than the largest captured bucket ({buckets[-1]}); "
            f"run this batch eagerly (model_runner.forward) or raise max_bs to >= {n}."
        )
    return buckets[i]


def replay_bucket(bs: int, buckets: Sequence[int] | None = None) -> int:
    """The bucket a batch of ``bs`` rows would replay in, or ``bs`` itself outside
    ``[1, buckets[-1]]`` (such a batch runs eagerly). ``None``: the default buckets up to 64,
    what an eager step is shaped for with no graph runner attached (``geometry_bs``)."""
    buckets = buckets or _GEOMETRY_BUCKETS
    return pad_to_bucket(bs, buckets) if 1 <= bs <= buckets[-1] else bs


def distribute_tokens(total_tokens: int, bs: int) -> list[int]:
    """Split ``total_tokens`` across ``bs`` requests, the remainder on the first.

    >>> distribute_tokens(10, 3)
    [4, 3, 3]
    """
    if bs < 1:
        raise ConfigError(f"bs must be >= 1, got {bs}.")
    if total_tokens < bs:
        raise ConfigError(
            f"cannot give {bs} requests at least one token each from "
            f"{total_tokens} tokens; use total_tokens >= bs."
        )
    base, rem = divmod(total_tokens, bs)
    return [base + rem] + [base] * (bs - 1)


_GEOMETRY_BUCKETS = default_capture_sizes(64)
