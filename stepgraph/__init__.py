"""stepgraph: capture LLM inference steps as CUDA graphs."""

from __future__ import annotations

from .buckets import default_capture_sizes, distribute_tokens, pad_to_bucket
from .errors import CaptureError, ConfigError, GraphUpdateError, ReplayError, StepGraphError

__version__ = "0.1.0"

__all__ = [
    "CaptureError",
    "ConfigError",
    "GraphUpdateError",
    "ReplayError",
    "StepGraphError",
    "default_capture_sizes",
    "distribute_tokens",
    "pad_to_bucket",
]
