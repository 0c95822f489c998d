"""Workload-driven capture sizes, pure: pick at most N buckets for an observed batch-size trace.

A decode step of ``n`` live requests replays the graph of the smallest bucket ``>= n`` and pays
for ``bucket`` rows (the padded ones do the same work as real ones). Given a trace of observed
batch sizes, ``plan_buckets`` picks at most ``max_graphs`` buckets, always including the largest
size seen, that minimise the expected padded rows per step. It is exact: a dynamic programme over
the sorted distinct sizes (an optimal set never needs a bucket that is not an observed size:
lowering a bucket to the largest observed size below it pads no row more).

    plan = plan_buckets(read_trace(open("trace.txt").read()), max_graphs=8)
    RunnerConfig(capture_bs=plan.buckets)

``padding_waste`` is mean padded rows / mean real rows (1.0: no padding at all); the printed
plan says it as a percentage over (0%: none), and the JSON of `stepgraph buckets --json` gives
both (``padding_waste`` and ``padding_waste_pct``).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from .buckets import default_capture_sizes, pad_to_bucket
from .errors import ConfigError

_INF = np.int64(2**62)  # "no such plan"; far above any padded-row total, far below overflow


@dataclass(frozen=True)
class BucketPlan:
    buckets: list[int]  # ascending; the last is the largest observed batch size
    padding_waste: float  # mean padded rows / mean real rows under ``buckets``
    default_buckets: list[int]  # default_capture_sizes(max observed size)
    default_padding_waste: float
    steps: int  # trace length
    sizes: tuple[int, ...] = ()  # the distinct batch sizes of the trace, ascending

    def as_json(self) -> dict:
        """``padding_waste``: rows run per real row (1.0: none), as the library returns it;
        ``padding_waste_pct``: the percentage of extra rows the printed plan shows."""
        return {
            "buckets": self.buckets,
            "padding_waste": self.padding_waste,
            "padding_waste_pct": extra_pct(self.padding_waste),
            "default_padding_waste": self.default_padding_waste,
            "default_padding_waste_pct": extra_pct(self.default_padding_waste),
        }

    def __str__(self) -> str:
        sizes = self.sizes or tuple(self.buckets)
        seen = (
            ", ".join(map(str, sizes))
            if len(sizes) <= 8
            else f"{len(sizes)} distinct, from {sizes[0]} to {sizes[-1]}"
        )
        return "\n".join(
            [
                f"trace: {self.steps} steps; batch sizes seen: {seen}",
                f"buckets ({len(self.buckets)}): {','.join(map(str, self.buckets))}",
                f"padding waste: {over(self.padding_waste)} (rows run per real row: "
                f"{self.padding_waste:.3f}; 0% = no padding)",
                f"default power-of-two set ({len(self.default_buckets)} buckets, same max): "
                f"{over(self.default_padding_waste)}",
                f"use: RunnerConfig(capture_bs={self.buckets})",
            ]
        )


def extra_pct(waste: float) -> float:
    """``padding_waste`` as the percentage of rows run beyond the real ones: 1.125 -> 12.5."""
    return round((waste - 1) * 100, 3)


def over(waste: float) -> str:
    """``padding_waste`` as padded rows over the real ones: 1.125 -> "12.5% extra rows"."""
    return f"{extra_pct(waste):.1f}% extra rows"


def read_trace(text: str, what: str = "trace") -> Counter[int]:
    """Histogram ``{batch size: steps}`` of a trace: a JSON list of ints, or one int per line
    (blank lines and ``#`` comments skipped)."""
    body = text.strip()
    if body.startswith("["):
        try:
            values = json.loads(body)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{what} is not a valid JSON list ({e}); fix the file.") from e
        items = [(f"item {i}", v) for i, v in enumerate(values)]
    else:
        items = []
        for no, line in enumerate(text.splitlines(), 1):
            line = line.split("#", 1)[0].strip()
            if line:
                try:
                    items.append((f"line {no}", int(line)))
                except ValueError as e:
                    raise ConfigError(
                        f"{what} line {no} is {line!r}; give one batch size (an int) per line "
                        "or a JSON list."
                    ) from e
    bad = [(w, v) for w, v in items if isinstance(v, bool) or not isinstance(v, int) or v < 1]
    if bad:
        raise ConfigError(f"{what} holds non-positive or non-int batch sizes: {bad[:5]}.")
    if not items:
        raise ConfigError(f"{what} is empty; record at least one decode step's batch size.")
    return Counter(v for _, v in items)


def histogram(trace: Iterable[int] | Mapping[int, int]) -> Counter[int]:
    return Counter(trace) if not isinstance(trace, Mapping) else Counter(dict(trace))


def padding_waste(trace: Iterable[int] | Mapping[int, int], buckets: Sequence[int]) -> float:
    """Mean padded rows / mean real rows of ``trace`` replayed with ``buckets`` (sorted)."""
    hist = histogram(trace)
    real = sum(n * c for n, c in hist.items())
    padded = sum(pad_to_bucket(n, buckets) * c for n, c in hist.items())
    return padded / real


def plan_buckets(trace: Iterable[int] | Mapping[int, int], max_graphs: int) -> BucketPlan:
    """At most ``max_graphs`` buckets covering the largest size of ``trace`` (a list of batch
    sizes, or a histogram ``{size: count}``) with the fewest expected padded rows; ties go to
    fewer buckets."""
    hist = histogram(trace)
    if max_graphs < 1:
        raise ConfigError(f"max_graphs must be >= 1, got {max_graphs}; one graph is the minimum.")
    if not hist or min(hist) < 1 or min(hist.values()) < 1:
        raise ConfigError(f"trace needs positive batch sizes with positive counts, got {hist}.")
    sizes = np.array(sorted(hist), dtype=np.int64)  # [m] distinct sizes, ascending
    counts = np.array([hist[s] for s in sizes.tolist()], dtype=np.int64)  # [m]
    cum = np.concatenate([[0], np.cumsum(counts)])  # [m + 1]: cum[j] = steps of sizes[:j]
    m = len(sizes)
    k_max = min(max_graphs, m)
    # cost[k - 1][j]: fewest padded rows for sizes[:j + 1] with k buckets, the largest at sizes[j]
    # arg[k - 1][j]: index of the bucket below it in that plan (-1: none)
    cost = np.full((k_max, m), _INF, dtype=np.int64)
    arg = np.full((k_max, m), -1, dtype=np.int64)
    cost[0] = sizes * cum[1:]
    for k in range(1, k_max):
        for j in range(k, m):
            # the previous bucket sizes[i] (i < j) covers sizes[:i + 1]; sizes[j] the rest
            prev = cost[k - 1, :j] + sizes[j] * (cum[j + 1] - cum[1 : j + 1])
            i = int(np.argmin(prev))
            cost[k, j], arg[k, j] = prev[i], i
    k_best = int(np.argmin(cost[:, m - 1]))  # first minimum: fewest buckets among the best
    picks, j = [], m - 1
    for k in range(k_best, -1, -1):
        picks.append(int(sizes[j]))
        j = int(arg[k, j])
    buckets = sorted(picks)
    default = default_capture_sizes(int(sizes[-1]))
    return BucketPlan(
        buckets=buckets,
        padding_waste=padding_waste(hist, buckets),
        default_buckets=default,
        default_padding_waste=padding_waste(hist, default),
        steps=int(cum[-1]),
        sizes=tuple(sizes.tolist()),
    )


__all__ = ["BucketPlan", "padding_waste", "plan_buckets", "read_trace"]
