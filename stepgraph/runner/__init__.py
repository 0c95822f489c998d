"""The decode graph runner (pymllm's ``CudaGraphRunner`` API). One graph per batch-size bucket,
static input buffers, one shared memory pool; replay pads a live batch to its bucket and slices the
output.

- ``graph_runner.py``  ``CudaGraphRunner``: capture, can_run, replay, shutdown
- ``config.py``        ``RunnerConfig``
- ``input_buffers.py`` static input buffers and the padding values (one place)
- ``capture.py``       the capture loop, the global pool, capture mode, ``freeze_gc``
- ``base.py``          what the three runners share (pool, release, shutdown)
- ``stats.py``         capture ledger and replay counters
- ``feed.py``          the device token feed: ids ``-1 - j`` read ``feed[j]`` inside the graph
"""

from __future__ import annotations

from .capture import (
    freeze_gc,
    get_global_graph_memory_pool,
    is_capture_mode,
    model_capture_mode,
    set_global_graph_memory_pool,
)
from .config import RunnerConfig
from .feed import feed_id
from .graph_runner import CudaGraphRunner, logger
from .stats import BucketStats, CaptureStats, RunnerStats

__all__ = [
    "BucketStats",
    "CaptureStats",
    "CudaGraphRunner",
    "RunnerConfig",
    "RunnerStats",
    "feed_id",
    "freeze_gc",
    "get_global_graph_memory_pool",
    "is_capture_mode",
    "logger",
    "model_capture_mode",
    "set_global_graph_memory_pool",
]
