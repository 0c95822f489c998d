"""Capture-time state: the shared graph memory pool, the capture-mode flag, GC freezing, stats.

The seed API (pymllm/sglang) exposes module-level getters and setters. We keep their names, but
they read and write one explicit ``CaptureState`` object instead of scattered globals, and
``model_capture_mode()`` refuses nesting instead of silently flattening it.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from .errors import CaptureError


@dataclass
class GraphPool:
    """One memory pool shared by every graph of a runner (largest bucket captured first, so the
    smaller ones reuse its blocks). ``handle`` is what ``torch.cuda.graph(pool=...)`` takes;
    ``None`` until the first capture creates one."""

    handle: Any = None

    def get_or_create(self, device: torch.device) -> Any:
        if self.handle is None and device.type == "cuda":
            self.handle = torch.cuda.graph_pool_handle()
        return self.handle

    def release(self) -> None:
        self.handle = None


@dataclass
class CaptureState:
    """Process-wide capture state behind the seed's helper functions."""

    pool: GraphPool = field(default_factory=GraphPool)
    capturing: bool = False


STATE = CaptureState()


def get_global_graph_memory_pool() -> Any:
    """Return the shared CUDA graph memory pool handle (``None`` before the first capture)."""
    return STATE.pool.handle


def set_global_graph_memory_pool(pool: Any) -> None:
    """Set the shared CUDA graph memory pool handle (e.g. to share one pool across runners)."""
    STATE.pool.handle = pool


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


def reserved_bytes(device: torch.device) -> int:
    """Bytes the caching allocator holds on ``device`` (0 on the CPU). Graph pools live there."""
    if device.type != "cuda":
        return 0
    return torch.cuda.memory_reserved(device)


@dataclass(frozen=True)
class BucketStats:
    """What capturing one bucket cost."""

    bs: int
    seconds: float
    pool_bytes_before: int
    pool_bytes_after: int

    @property
    def pool_bytes(self) -> int:
        return self.pool_bytes_after - self.pool_bytes_before


@dataclass
class CaptureStats:
    buckets: list[BucketStats] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        return sum(b.seconds for b in self.buckets)

    @property
    def pool_bytes(self) -> int:
        return sum(b.pool_bytes for b in self.buckets)

    def summary(self) -> str:
        return (
            f"captured {len(self.buckets)} buckets in {self.seconds:.2f} s, "
            f"pool {self.pool_bytes / 2**20:.1f} MiB"
        )


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
