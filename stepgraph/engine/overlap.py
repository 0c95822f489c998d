"""Overlap scheduling: the host builds step N+1 while the GPU runs step N.

A launched step keeps its sampled tokens on the device (``InFlight.tokens``); the next step's
decode batch reads its input ids from there, gathered by row on the device, so no token makes
a host round trip before it is fed back. The tokens reach the host one step later, through a
pinned ``non_blocking`` copy and an event (``InFlight.wait``), and only then are stop ids
checked: a stop lags one step, and a token computed for a request that had already finished is
dropped, never returned (SGLang's overlap scheduler, vLLM's async scheduling).

Every launch goes to one stream, in order. Pages a request may still write in a launched step
go back to the allocator only once that step's event has completed (``PendingPages``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .requests import Request


class HostRing:
    """Pinned host rows and events that launched steps reuse in turn, so a launch allocates
    nothing (a pinned ``torch.empty`` and a new event cost tens of µs of host time a step).
    Slot ``k`` is written again ``SLOTS`` launches later; every step lands (``InFlight.wait``)
    in the step after its own, long before. An event recorded again only makes a late reader
    (``PendingPages``) wait longer, never less."""

    SLOTS = 3

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self._host: list[torch.Tensor] = []  # allocated at the first take (CUDA only)
        self._events: list[torch.cuda.Event] = []
        self._views: dict[tuple[int, int], torch.Tensor] = {}  # (slot, n) -> host[slot][:n]
        self._next = 0

    def take(self, n: int) -> tuple[torch.Tensor, torch.cuda.Event] | None:
        """The host rows ``[n]`` and the event of the next slot (None: more rows than it holds)."""
        if n > self.rows:
            return None
        if not self._host:
            self._host = [
                torch.empty(self.rows, dtype=torch.int64, pin_memory=True)
                for _ in range(self.SLOTS)
            ]
            self._events = [torch.cuda.Event() for _ in range(self.SLOTS)]
        k = self._next
        self._next = (k + 1) % self.SLOTS
        view = self._views.get((k, n))
        if view is None:
            view = self._views[k, n] = self._host[k][:n]
        return view, self._events[k]


@dataclass
class InFlight:
    """One launched step: which request each sampled row belongs to, and its tokens."""

    rows: list[Request]  # first tokens of prefilled requests, then the decode rows
    tokens: torch.Tensor  # [n] int64 on the device: this step's sampled ids
    host: torch.Tensor  # [n] int64 on the host (pinned on CUDA): their copy, once ``done``
    event: torch.cuda.Event | None  # recorded after the copy; None where it is synchronous
    _row_of: dict[int, int] | None = field(default=None, repr=False)

    @classmethod
    def launch(
        cls,
        rows: Sequence[Request],
        tokens: torch.Tensor,
        ring: HostRing | None = None,
        host: torch.Tensor | None = None,
    ) -> InFlight:
        """Start the copy of ``tokens`` to the host; return at once. ``ring``: pinned rows and
        events to reuse (else allocated for this step). ``host``: pinned rows the step itself
        stores ``tokens`` into (a graph's token mirror): no copy, only the event."""
        event = None
        if tokens.is_cuda:
            slot = ring.take(tokens.shape[0]) if ring is not None else None
            ring_rows, event = slot if slot is not None else (None, torch.cuda.Event())
            if host is None:  # no mirror: copy into the ring's rows, or rows of this step's own
                host = ring_rows
                if host is None:
                    host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
                host.copy_(tokens, non_blocking=True)
            event.record()
        elif host is None:
            host = tokens
        return cls(list(rows), tokens, host, event)

    @property
    def row_of(self) -> dict[int, int]:
        """Request id -> its row (built when first asked: a steady decode step never asks)."""
        if self._row_of is None:
            self._row_of = {r.rid: i for i, r in enumerate(self.rows)}
        return self._row_of

    @property
    def done(self) -> bool:
        """True once the step ran and its tokens are on the host (never blocks)."""
        return self.event is None or self.event.query()

    def synchronize(self) -> None:
        """Block until the step has run."""
        if self.event is not None:
            self.event.synchronize()

    def wait(self) -> list[int]:
        """The step's tokens on the host; blocks until the step has run."""
        self.synchronize()
        return self.host.tolist()


class PendingPages:
    """Pages that a launched step may still write: each list goes back to the allocator once
    its step is done (``None``: at once)."""

    def __init__(self, release) -> None:
        self._release = release  # the KV cache's release(pages)
        self._items: list[tuple[InFlight | None, list[int]]] = []

    def __len__(self) -> int:
        return sum(len(pages) for _, pages in self._items)

    def add(self, step: InFlight | None, pages: list[int]) -> None:
        if pages:
            self._items.append((step, pages))

    def reclaim(self, wait: bool = False) -> int:
        """Release the pages whose step is done, in the order they were added, up to the
        first whose step is not (``wait``: wait for every step first); return how many went
        back. In order: the prefix cache's eviction order follows the releases, so it is the
        same on every tensor-parallel rank however early each rank's steps finish."""
        freed = 0
        while self._items:
            step, pages = self._items[0]
            if not (step is None or wait or step.done):
                break
            if step is not None and wait:
                step.synchronize()
            del self._items[0]  # first: a release that raises is never retried
            self._release(pages)
            freed += len(pages)
        return freed


__all__ = ["HostRing", "InFlight", "PendingPages"]
