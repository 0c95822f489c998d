"""What capture and replay cost: per-bucket capture stats, the runner's counters, a stopwatch."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from .stats_table import as_dict, by_reason, capture_rows, table


def reserved_bytes(device: torch.device) -> int:
    """Bytes the caching allocator holds on ``device`` (0 on the CPU). Graph pools live there."""
    if device.type != "cuda":
        return 0
    return torch.cuda.memory_reserved(device)


@dataclass(frozen=True)
class BucketStats:
    """What capturing one bucket cost: one row of the capture ledger.

    ``pool_bytes``: what the graph pool grew by during the capture (the graph's own blocks that
    no earlier, larger bucket left free). ``outside_bytes``: what the eager warm-up left
    allocated outside the pool when the capture began (shared outputs and workspaces sized by
    the first bucket; for a piecewise runner also the warm-up results it holds until the
    capture ends, so their sum over shapes overstates what stays)."""

    bs: int
    seconds: float
    pool_bytes_before: int
    pool_bytes_after: int
    outside_bytes: int = 0
    # of ``seconds``, the eager warm-up before the capture: where every kernel variant the step
    # launches is compiled or loaded on its first use in the process (the first runner to
    # capture pays it; a second runner over the same model, or another mode, does not)
    warmup_seconds: float = 0.0
    # of ``warmup_seconds``, the host time of the first eager run (its launches queued): with a
    # warm process, the step's Python (docs/experiments.md#launch-arithmetic-in-plain-python)
    first_warmup_seconds: float = 0.0
    # of ``seconds``: the capture itself (recording the step, instantiating the graph), and the
    # exact mode's plan of the graph's attention nodes (``ExecUpdater.plan``) after it
    record_seconds: float = 0.0
    plan_seconds: float = 0.0
    # eager runs before the capture: one, and another while the last used a kernel variant
    # for the first time, up to ``RunnerConfig.warmup_iters`` (``capture_step``)
    warmups: int = 1

    @property
    def pool_bytes(self) -> int:
        return self.pool_bytes_after - self.pool_bytes_before


@dataclass
class CaptureStats:
    buckets: list[BucketStats] = field(default_factory=list)
    # The allocator's own count of the pool's segments after capture (None: not measured, e.g.
    # on the CPU); the ledger's pool column sums to it when the pool was empty before.
    pool_held_bytes: int | None = None
    # Triton kernel variants compiled, or loaded from its disk cache, during the capture: the
    # first uses in this process (0 for a second runner over the same model, or on the CPU)
    kernel_variants: int = 0

    @property
    def seconds(self) -> float:
        return sum(b.seconds for b in self.buckets)

    @property
    def pool_bytes(self) -> int:
        return sum(b.pool_bytes for b in self.buckets)

    @property
    def outside_bytes(self) -> int:
        return sum(b.outside_bytes for b in self.buckets)

    @property
    def warmup_seconds(self) -> float:
        """Of ``seconds``, the eager warm-ups (first-use compiles land here)."""
        return sum(b.warmup_seconds for b in self.buckets)

    def phases(self) -> dict[str, float]:
        """Seconds of every bucket's capture by phase, summed: the first eager run (host),
        the later ones and the device's finishing of both, the recording and instantiation,
        the exact mode's plan, and the rest (the allocator's marks before the warm-ups)."""
        first = sum(b.first_warmup_seconds for b in self.buckets)
        record = sum(b.record_seconds for b in self.buckets)
        plan = sum(b.plan_seconds for b in self.buckets)
        return {
            "first_warmup": first,
            "later_warmups": self.warmup_seconds - first,
            "record": record,
            "plan": plan,
            "other": self.seconds - self.warmup_seconds - record - plan,
        }

    def summary(self) -> str:
        n = self.kernel_variants
        first_uses = f", {n} kernel variant{'s' * (n != 1)} first used" if n else ""
        return (
            f"captured {len(self.buckets)} buckets in {self.seconds:.2f} s, "
            f"pool {self.pool_bytes / 2**20:.1f} MiB{first_uses}"
        )

    def as_dict(self) -> dict:
        """Every field and total (seconds, pool bytes), JSON-ready; ``repr`` shows the same."""
        return as_dict(self)

    def __str__(self) -> str:  # the piecewise runner's stats are its capture ledger
        return table("capture stats", capture_rows(self))

    def ledger(self) -> list[dict[str, float]]:
        """One row per bucket, in capture order: seconds, pool MiB and outside-pool MiB."""
        return [
            {
                "bs": b.bs,
                "seconds": round(b.seconds, 4),
                "warmup_seconds": round(b.warmup_seconds, 4),
                "first_warmup_seconds": round(b.first_warmup_seconds, 4),
                "record_seconds": round(b.record_seconds, 4),
                "plan_seconds": round(b.plan_seconds, 4),
                "warmups": b.warmups,
                "pool_mib": round(b.pool_bytes / 2**20, 2),
                "outside_mib": round(b.outside_bytes / 2**20, 2),
            }
            for b in self.buckets
        ]

    def ledger_table(self) -> str:
        """The ledger as text: one line per bucket, then the totals."""
        head = (("bs", 6), ("seconds", 8), ("warm-up", 8), ("runs", 4), ("pool MiB", 9))
        head += (("outside MiB", 11),)
        lines = [" ".join(f"{name:>{w}}" for name, w in head)]
        for r in self.ledger():
            lines.append(
                f"{r['bs']:>6} {r['seconds']:>8.3f} {r['warmup_seconds']:>8.3f} {r['warmups']:>4} "
                f"{r['pool_mib']:>9.1f} {r['outside_mib']:>11.1f}"
            )
        runs = sum(b.warmups for b in self.buckets)
        lines.append(
            f"{'total':>6} {self.seconds:>8.3f} {self.warmup_seconds:>8.3f} {runs:>4} "
            f"{self.pool_bytes / 2**20:>9.1f} {self.outside_bytes / 2**20:>11.1f}"
        )
        return "\n".join(lines)


@dataclass
class RunnerStats:
    """``CudaGraphRunner.stats``: the capture ledger and what replay did since."""

    capture: CaptureStats | None = None
    replays: int = 0
    node_edits: int = 0  # attention nodes pushed by exact mode
    packed_here: int = 0  # replays whose batch came without ``packed`` (packed by the runner)
    fallbacks: Counter = field(default_factory=Counter)  # reason -> batches refused by can_run

    def as_dict(self) -> dict:
        """Every field and capture total, JSON-ready (``repr`` shows the same data)."""
        return as_dict(self)

    def __str__(self) -> str:
        replays = (
            f"{self.replays} (exact-mode node edits {self.node_edits}, "
            f"packed by the runner {self.packed_here})"
        )
        rows = [*capture_rows(self.capture), ("replays", replays)]
        return table("CudaGraphRunner stats", [*rows, ("fallbacks", by_reason(self.fallbacks))])


class Stopwatch:
    """``with Stopwatch() as sw: ...; sw.seconds`` (synchronises CUDA so GPU work is counted)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seconds = 0.0

    def __enter__(self) -> Stopwatch:
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.seconds = time.perf_counter() - self._t0
