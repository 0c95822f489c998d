"""Stats a person can read: ``str(stats)`` of every runner is a short table; ``stats.as_dict()``
holds all of it (every field, plus derived totals such as seconds and pool bytes), JSON-ready.

    CudaGraphRunner stats
      buckets    5 graphs, bs 1,2,4,8,16
      capture    1.28 s, graph pool 0.0 MiB (+0.0 MiB outside it)
      replays    1 (exact-mode node edits 0, packed by the runner 1)
      fallbacks  none
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

MIB = 2**20
MIN_RUN = 4  # an arithmetic run this long prints as first-last/step


def compact_sizes(sizes: Iterable[int]) -> str:
    """Sorted distinct sizes, long arithmetic runs shortened.

    >>> compact_sizes([1, 2, 4, 8, 16, 32, 48, 64, 80])
    '1,2,4,8,16-80/16'
    """
    xs = sorted(set(sizes))
    parts, i = [], 0
    while i < len(xs):
        j = i + 1
        if j < len(xs):
            step = xs[j] - xs[i]
            while j + 1 < len(xs) and xs[j + 1] - xs[j] == step:
                j += 1
            if j - i + 1 >= MIN_RUN:
                parts.append(f"{xs[i]}-{xs[j]}/{step}")
                i = j + 1
                continue
        parts.append(str(xs[i]))
        i += 1
    return ",".join(parts)


def by_reason(counts: Mapping[str, int]) -> str:
    """``"none"``, or ``"too_large 3, bad_input 1"`` (most frequent first)."""
    items = sorted(((r, n) for r, n in counts.items() if n), key=lambda kv: (-kv[1], kv[0]))
    return ", ".join(f"{r} {n}" for r, n in items) or "none"


def capture_rows(capture: Any, noun: str = "graphs") -> list[tuple[str, str]]:
    """The ``buckets`` and ``capture`` rows of a ``CaptureStats`` (or None: not captured)."""
    if capture is None or not capture.buckets:
        return [("buckets", "none captured yet")]
    n, sizes = len(capture.buckets), compact_sizes(b.bs for b in capture.buckets)
    outside = getattr(capture, "outside_bytes", 0)
    pool = f"graph pool {capture.pool_bytes / MIB:.1f} MiB (+{outside / MIB:.1f} MiB outside it)"
    return [("buckets", f"{n} {noun}, bs {sizes}"), ("capture", f"{capture.seconds:.2f} s, {pool}")]


def table(title: str, rows: list[tuple[str, str]]) -> str:
    width = max(len(name) for name, _ in rows)
    return "\n".join([title, *(f"  {name:<{width}}  {value}" for name, value in rows)])


def as_dict(obj: Any) -> Any:
    """Dataclasses, mappings and lists as plain dicts and lists; a dataclass's properties
    (derived totals) are included next to its fields. Counters become plain dicts (which
    ``dataclasses.asdict`` gets wrong: it rebuilds a Counter from (key, value) pairs)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = {f.name: as_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        for name, attr in vars(type(obj)).items():
            if isinstance(attr, property):
                out[name] = as_dict(getattr(obj, name))
        return out
    if isinstance(obj, Mapping):
        return {k: as_dict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [as_dict(v) for v in obj]
    return obj


__all__ = ["as_dict", "by_reason", "capture_rows", "compact_sizes", "table"]
