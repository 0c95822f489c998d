"""Host time of the engine's step by phase: an optional recorder the engine calls only when set.

    timer = PhaseTimer()
    engine.timer = timer          # None (the default): the step makes no timer call at all
    for _ in range(100):
        engine.step()
    timer.per_step_us()           # {"admission": 3.1, "batch_rows": 9.8, "replay": 14.2, ...}

The step marks the end of each phase in order (``PHASES``); a phase's time runs from the mark
before it, so the phases of a step add up to the step's whole host time. Marks the step skips
(no decode batch this step) fold into the next phase. ``perf_counter_ns`` only: no device call,
no allocation per mark. ``benchmarks/engine_host.py`` drives it against a stand-in step of
(near) zero GPU time.
"""

from __future__ import annotations

from statistics import median
from time import perf_counter_ns

PHASES = (
    "admission",  # budget-spent requests moved out, freed pages reclaimed, waiting ones admitted
    "prefill",  # this step's prefill chunks planned and launched
    "batch_rows",  # the decode batch's host rows (tokens, positions, slots, block table)
    "replay",  # the decode step launched (the graph runner's replay, or eager)
    "sampling",  # tokens sampled on the device and their copy to the host started
    "landing",  # the step before's tokens waited for and read on the host
    "stop_checks",  # each landed token appended, stop ids and budgets checked, pages reclaimed
)


class PhaseTimer:
    """Nanoseconds of host time per phase of each ``Engine.step`` (``steps`` of them)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.samples: list[list[int]] = []  # per step: ns per phase, in ``PHASES`` order
        self._cur = dict.fromkeys(PHASES, 0)
        self._t = 0

    @property
    def steps(self) -> int:
        return len(self.samples)

    def start(self) -> None:
        """At the start of a step."""
        self._t = perf_counter_ns()

    def mark(self, phase: str) -> None:
        """At the end of ``phase`` (one of ``PHASES``)."""
        now = perf_counter_ns()
        self._cur[phase] += now - self._t
        self._t = now

    def end_step(self) -> None:
        """At the end of a step: its phases become one sample."""
        cur = self._cur
        self.samples.append([cur[p] for p in PHASES])
        self._cur = dict.fromkeys(PHASES, 0)

    def per_step_us(self) -> dict[str, float]:
        """The median microseconds a step of each phase and of the step's ``total`` (medians:
        a host shared with other work has outliers; the phases' medians need not add up to
        the total's), and ``mean_total``."""
        if not self.samples:
            return {**dict.fromkeys(PHASES, 0.0), "total": 0.0, "mean_total": 0.0}
        out = {p: median(s[i] for s in self.samples) / 1e3 for i, p in enumerate(PHASES)}
        totals = [sum(s) for s in self.samples]
        out["total"] = median(totals) / 1e3
        out["mean_total"] = sum(totals) / len(totals) / 1e3
        return out


__all__ = ["PHASES", "PhaseTimer"]
