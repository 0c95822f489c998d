"""Capture: the process-wide pool and capture-mode state of pymllm's API, GC freezing, and the
one capture loop every runner uses (decode, config-driven and piecewise).

pymllm (after sglang) exposes module-level getters and setters. We keep their names, but they
read and write one explicit ``CaptureState`` instead of scattered globals, and
``model_capture_mode()`` refuses nesting instead of silently flattening it.

    with freeze_gc(), model_capture_mode():          # capture_loop, in short
        for key in keys_largest_first:
            backend.warmup(step, 1)                  # compiles every kernel variant
            ...                                      # again while a run used a new one
            graph = backend.capture(step, key=key)   # one side stream, one shared pool
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from ..backends import CapturedGraph, GraphBackend
from ..errors import CaptureError
from ..graph_pool import GraphPool
from .compiles import CompileCounter
from .config import RunnerConfig
from .stats import BucketStats, CaptureStats, Stopwatch

logger = logging.getLogger("stepgraph")

SYNC_HINT = (
    "A captured step must not sync with the host (.item(), .tolist(), .cpu(), printing a "
    "tensor, data-dependent shapes such as nonzero) nor branch on device values"
)


@dataclass
class CaptureState:
    """Process-wide capture state behind pymllm's helper functions.

    ``pool`` is the graph memory pool handle every runner created while it is set captures into
    (set by the first runner that captures, or by ``set_global_graph_memory_pool``)."""

    pool: Any = None
    capturing: bool = False
    # Inside ``capture_loop``: its count of Triton kernel variants first used, which tells a
    # bucket's warm-ups when they have settled (``capture_step``)
    compiles: CompileCounter | None = None

    def pool_for_new_runner(self) -> GraphPool:
        """The pool a runner created now captures into: the global one, or a fresh one that
        becomes global when its first capture creates the handle."""

        def adopt(handle: Any) -> None:
            if self.pool is None:
                self.pool = handle

        def forget(handle: Any) -> None:  # a failed capture poisoned it (GraphPool.abandon)
            if self.pool is handle:
                self.pool = None

        return GraphPool(self.pool, on_create=adopt, on_abandon=forget)


STATE = CaptureState()


def get_global_graph_memory_pool() -> Any:
    """The graph memory pool handle shared by every runner (``None`` before the first capture):
    the pool the first runner created, or the one set with ``set_global_graph_memory_pool``."""
    return STATE.pool


def set_global_graph_memory_pool(pool: Any) -> None:
    """Make every runner created afterwards capture into ``pool`` (a handle from
    ``torch.cuda.graph_pool_handle()``, or another runner's ``get_global_graph_memory_pool()``).
    Runners created before keep their pool. ``None`` lets the next runner create a new one."""
    STATE.pool = pool


def is_capture_mode() -> bool:
    """``True`` while a graph capture is in progress (models use it to skip host-side work)."""
    return STATE.capturing


@contextlib.contextmanager
def model_capture_mode() -> Iterator[None]:
    """Set the capture-mode flag for the duration of the block. Nesting is a bug (two runners
    capturing at once would share one flag), so it raises ``CaptureError``."""
    if STATE.capturing:
        raise CaptureError(
            "model_capture_mode() entered while a capture is already in progress; "
            "capture runners one after another, not from inside another capture."
        )
    STATE.capturing = True
    try:
        yield
    finally:
        STATE.capturing = False


@contextlib.contextmanager
def freeze_gc(enabled: bool = True) -> Iterator[None]:
    """Collect, then freeze the GC for the block; unfreeze and collect again after it.

    A GC pass during capture walks every Python object and can free tensors whose deleters
    touch the allocator mid-capture; frozen objects are skipped, which also makes capture
    much faster (sglang measured 35 s -> 2 s)."""
    if not enabled:
        yield
        return
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.collect()


def capture_loop(
    items: Iterable[Any],
    capture_one: Callable[[Any], BucketStats],
    *,
    show_progress: bool,
    freeze: bool = True,
    backend: GraphBackend | None = None,
) -> CaptureStats:
    """Capture every item in order inside one frozen-GC capture-mode block, with a progress bar
    (pool MiB, and the kernel variants used first as each one compiles or loads) and a one-line
    summary (graphs, seconds, pool MiB, kernel variants) at the end. ``backend``: whose pool the
    allocator is asked about afterwards (``CaptureStats.pool_held_bytes``)."""
    stats = CaptureStats()
    bar = tqdm(
        list(items), desc="stepgraph capture", unit="graph", disable=not show_progress, leave=False
    )

    def progress(kernels: int) -> None:  # a cold first bucket compiles for tens of seconds
        bar.set_postfix(pool_mib=f"{stats.pool_bytes / 2**20:.1f}", kernels=kernels)

    counter = CompileCounter(on_compile=progress if show_progress else None)
    with freeze_gc(freeze), model_capture_mode(), counter:
        STATE.compiles = counter
        try:
            for item in bar:
                stats.buckets.append(capture_one(item))
                progress(counter.count)
        finally:
            STATE.compiles = None
    stats.kernel_variants = counter.count
    if backend is not None:
        stats.pool_held_bytes = backend.pool_held_bytes()
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
    warmup_iters: int = RunnerConfig.warmup_iters,
    until_settled: bool = True,
) -> tuple[CapturedGraph, BucketStats]:
    """Warm ``step`` up eagerly, then capture it. Failures become ``CaptureError`` naming
    ``what`` and chaining the cause; the caller releases what it captured before.

    At most ``warmup_iters`` eager runs. Inside ``capture_loop`` with ``until_settled``, a run
    after the first follows only a run that used a Triton kernel variant for the first time
    (compiled or loaded from the disk cache): a run that used none has nothing left to settle,
    and the recording would find every kernel loaded. A step whose kernels come from
    ``torch.compile`` (which the count does not see) passes ``until_settled=False``."""
    counter = STATE.compiles if until_settled else None
    with Stopwatch(backend.device) as sw:
        try:
            start = backend.pool_mark()
            t0 = time.perf_counter()
            seen = counter.count if counter is not None else 0
            backend.warmup(step, 1)
            first = time.perf_counter() - t0  # host time: its launches are queued
            runs = 1
            # another run while the last one used a new variant (always, with no count)
            while runs < warmup_iters and (counter is None or counter.count > seen):
                seen = counter.count if counter is not None else 0
                backend.warmup(step, 1)
                runs += 1
            before = backend.pool_mark()  # what the warm-up left live is outside the pool
            t1 = time.perf_counter()
            warm = t1 - t0  # pool_mark synchronized: the warm-up has run
            graph = backend.capture(step, key=key)
            record = time.perf_counter() - t1
        except CaptureError:
            raise
        except Exception as e:
            raise CaptureError(
                f"capturing {what} failed: {e}. {SYNC_HINT}; move that work out of the captured "
                "call, or run it eagerly."
            ) from e
    held = backend.held_bytes()
    stats = BucketStats(
        bs, sw.seconds, before, held, before - start, warm, first, record, warmups=runs
    )
    return graph, stats


def storage_ptrs(tensors: Iterable[Any]) -> set[int]:
    """Base addresses of the storages behind ``tensors`` (non-tensors and empty ones skipped).
    An output sharing one was not allocated by the captured call: it is an input, a weight, or a
    tensor from before capture, which a graph would not rewrite as its own output."""
    return {
        t.untyped_storage().data_ptr()
        for t in tensors
        if isinstance(t, torch.Tensor) and t.numel() > 0
    }
