"""The capture loop and the capture of one step, shared by every runner.

``capture_loop`` wraps a sequence of captures in GC freezing and capture mode with a progress
bar and per-item stats; ``capture_step`` warms a step up eagerly, captures it, and turns any
failure into a ``CaptureError`` naming what was being captured and chaining the cause.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
from tqdm.auto import tqdm

from .backends import CapturedGraph, GraphBackend
from .capture import (
    BucketStats,
    CaptureStats,
    Stopwatch,
    freeze_gc,
    model_capture_mode,
    reserved_bytes,
)
from .errors import CaptureError, ReplayError

logger = logging.getLogger("stepgraph")

WARMUP_ITERS = 2
SYNC_HINT = (
    "A captured step must not sync with the host (.item(), .tolist(), .cpu(), printing a "
    "tensor, data-dependent shapes such as nonzero) nor branch on device values"
)


def capture_loop(
    items: Iterable[Any],
    capture_one: Callable[[Any], BucketStats],
    *,
    show_progress: bool,
    freeze: bool = True,
) -> CaptureStats:
    """Capture every item in order inside one frozen-GC capture-mode block, with a progress bar
    and a one-line summary (graphs, seconds, pool MiB) at the end."""
    stats = CaptureStats()
    bar = tqdm(
        list(items), desc="stepgraph capture", unit="graph", disable=not show_progress, leave=False
    )
    with freeze_gc(freeze), model_capture_mode():
        for item in bar:
            stats.buckets.append(capture_one(item))
            bar.set_postfix(pool_mib=f"{stats.pool_bytes / 2**20:.1f}")
    logger.info("stepgraph: %s", stats.summary())
    if show_progress:
        tqdm.write(f"stepgraph: {stats.summary()}")
    return stats


def capture_step(
    backend: GraphBackend,
    step: Callable[[], torch.Tensor],
    *,
    key: object,
    bs: int,
    what: str,
    warmup_iters: int = WARMUP_ITERS,
) -> tuple[CapturedGraph, BucketStats]:
    """Warm ``step`` up eagerly, then capture it. Failures become ``CaptureError`` naming
    ``what`` and chaining the cause; the caller releases what it captured before."""
    with Stopwatch(backend.device) as sw:
        try:
            backend.warmup(step, warmup_iters)
            before = backend.pool_mark()
            graph = backend.capture(step, key=key)
        except CaptureError:
            raise
        except Exception as e:
            raise CaptureError(
                f"capturing {what} failed: {e}. {SYNC_HINT}; move that work out of the captured "
                "call, or run it eagerly."
            ) from e
    return graph, BucketStats(bs, sw.seconds, before, reserved_bytes(backend.device))


def storage_ptrs(tensors: Iterable[Any]) -> set[int]:
    """Base addresses of the storages behind ``tensors`` (non-tensors and empty ones skipped).
    An output sharing one was not allocated by the captured call: it is an input, a weight, or a
    tensor from before capture, which a graph would not rewrite as its own output."""
    return {
        t.untyped_storage().data_ptr()
        for t in tensors
        if isinstance(t, torch.Tensor) and t.numel() > 0
    }


# --------------------------------------------------------------------------------------------
# The config-driven runner


class GraphRunnerBase:
    """What every runner shares: its captured graphs, their release, and the shutdown state.

    Subclasses set ``graphs``, ``_backend`` and ``_shut_down`` in ``__init__``, clear their own
    per-graph state in ``_forget_graphs``, and name their eager escape hatch in ``EAGER_HINT``.
    """

    EAGER_HINT = "run the step eagerly"
    graphs: dict[Any, CapturedGraph]
    _backend: GraphBackend
    _shut_down: bool

    @property
    def capture_order(self) -> list:
        """Graph keys in the order they were captured (largest first); every rank of a
        tensor-parallel job must see the same list."""
        return list(self._backend.capture_order)

    def _release_graphs(self) -> None:
        for graph in self.graphs.values():
            graph.release()
        self.graphs.clear()
        self._forget_graphs()
        self._backend.release()

    def _forget_graphs(self) -> None:
        """Drop per-graph state (outputs, static inputs, plans) after the graphs are released."""

    def _check_alive(self, what: str) -> None:
        if self._shut_down:
            raise ReplayError(
                f"{what}() called after shutdown(); create a new {type(self).__name__}, "
                f"or {self.EAGER_HINT}."
            )
