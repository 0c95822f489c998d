"""``GraphPool``: the graph memory pool that runners capture into, its capture stream, and what
a failed capture leaves to clean up."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class CpuPoolHandle:
    """What the CPU stand-in uses as a pool handle: an object whose identity says who shares."""

    def __repr__(self) -> str:
        return f"CpuPoolHandle({id(self):#x})"


class GraphPool:
    """One graph memory pool, shared by every graph captured into it: graphs that replay one
    after another on one stream reuse each other's temporaries (largest captured first).

    ``handle`` is what ``torch.cuda.graph(pool=...)`` takes; ``None`` until the first capture
    creates one, which is then handed to ``on_create`` (the process-wide pool adopts it).
    Releasing graphs frees the pool's memory; the handle stays valid for later captures."""

    def __init__(
        self,
        handle: Any = None,
        on_create: Callable[[Any], None] | None = None,
        on_abandon: Callable[[Any], None] | None = None,
    ):
        self.handle = handle
        self._on_create = on_create
        self._on_abandon = on_abandon

    def abandon(self) -> None:
        """Drop the handle after a failed capture; the next capture creates a new pool.

        Torch's allocator can keep a pool marked as recording after an invalidated capture
        (seen on the H200, torch 2.11: every later capture into it failed with
        "beginAllocateToPool: already recording to mempool_id", even after
        ``_cuda_endAllocateToPool``). A fresh pool is the only reliable way on. The seed's
        global pool follows (``on_abandon``), so runners created later do not inherit it."""
        old, self.handle = self.handle, None
        if old is not None and self._on_abandon is not None:
            self._on_abandon(old)

    def get_or_create(self, device: torch.device) -> Any:
        if self.handle is None:
            cuda = device.type == "cuda"
            self.handle = torch.cuda.graph_pool_handle() if cuda else CpuPoolHandle()
            if self._on_create is not None:
                self._on_create(self.handle)
        return self.handle

    def capture_stream(self, device: torch.device) -> torch.cuda.Stream:
        """The one side stream every capture into this pool runs on (per device).

        The caching allocator reuses a freed block only for allocations on the stream it was
        allocated on: with a stream per runner, 17 prefill regions sharing one pool each kept
        their own temporaries (2380 MiB); on one stream they reuse each other's."""
        key = (self.get_or_create(device), device.index)
        stream = _CAPTURE_STREAMS.get(key)
        if stream is None:
            stream = _CAPTURE_STREAMS[key] = torch.cuda.Stream(device)
        return stream

    def __repr__(self) -> str:
        return f"GraphPool({self.handle!r})"


_CAPTURE_STREAMS: dict[tuple[Any, int | None], Any] = {}  # (pool handle, device) -> stream


def stop_recording_to_pool(device: torch.device, pool: Any) -> None:
    """After a failed capture, make the allocator stop routing allocations to ``pool``.

    ``CUDAGraph.capture_end`` ends the pool's recording only after ``cudaStreamEndCapture``
    succeeds; when the capture was invalidated (a host sync, say) it raises first, and the next
    capture into the same pool fails with "beginAllocateToPool: already recording to
    mempool_id" (seen on the H200, torch 2.11). A pool shared by several runners must survive
    one runner's failed capture, so end the recording here; it may already be ended."""
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)
    if end is None:
        return
    try:
        end(device.index, pool)
    except RuntimeError:  # "not currently recording": capture_end got that far
        pass
