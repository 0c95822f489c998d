"""stepgraph: capture LLM inference steps as CUDA graphs.

    from stepgraph import CudaGraphRunner, RunnerConfig
    runner = CudaGraphRunner(model_runner, RunnerConfig(max_bs=64, mode="graph"))
    logits = runner.replay(batch) if runner.can_run(batch) else model_runner.forward(batch)

Subpackages: ``stepgraph.graph_update`` (per-token exec update of kernel nodes),
``stepgraph.kernels`` (Triton split-KV flash decode, extend attention), ``stepgraph.model``
(reference Llama/Qwen2), ``stepgraph.engine`` (the serving path), ``stepgraph.serve`` (the
OpenAI-compatible server), ``stepgraph.runner`` (the decode graph runner),
``stepgraph.configs`` (declarative capture configs).
"""

from __future__ import annotations

from .backends import CpuGraphBackend, CudaGraphBackend, GraphBackend
from .batch import AttentionBackend, ForwardBatch, ForwardMode, ModelRunnerLike
from .buckets import default_capture_sizes, distribute_tokens, pad_to_bucket
from .configs import (
    BatchedCudaGraphConfig,
    ConfigGraphRunner,
    CudaGraphConfig,
    CudaGraphConfigType,
    PackedCudaGraphConfig,
    PiecewiseBatchedConfig,
    PiecewiseCallInputs,
    PiecewiseCaptureShape,
    PiecewiseConfigType,
    PiecewiseCudaGraphConfig,
    PiecewisePackedConfig,
    PiecewiseRunner,
)
from .engine import Engine, EngineStats, Request, Sampling
from .errors import CaptureError, ConfigError, GraphUpdateError, ReplayError, StepGraphError
from .graph_pool import GraphPool
from .model import PRESETS, ModelConfig, ModelRunner, get_preset
from .runner import (
    CudaGraphRunner,
    RunnerConfig,
    freeze_gc,
    get_global_graph_memory_pool,
    is_capture_mode,
    model_capture_mode,
    set_global_graph_memory_pool,
)

__version__ = "0.1.0"

__all__ = [
    "AttentionBackend",
    "BatchedCudaGraphConfig",
    "CaptureError",
    "ConfigError",
    "ConfigGraphRunner",
    "Engine",
    "EngineStats",
    "CpuGraphBackend",
    "CudaGraphBackend",
    "CudaGraphConfig",
    "CudaGraphConfigType",
    "CudaGraphRunner",
    "ForwardBatch",
    "ForwardMode",
    "GraphBackend",
    "GraphPool",
    "GraphUpdateError",
    "ModelConfig",
    "ModelRunner",
    "ModelRunnerLike",
    "PRESETS",
    "PackedCudaGraphConfig",
    "PiecewiseBatchedConfig",
    "PiecewiseCallInputs",
    "PiecewiseCaptureShape",
    "PiecewiseConfigType",
    "PiecewiseCudaGraphConfig",
    "PiecewisePackedConfig",
    "PiecewiseRunner",
    "ReplayError",
    "Request",
    "RunnerConfig",
    "Sampling",
    "StepGraphError",
    "default_capture_sizes",
    "distribute_tokens",
    "freeze_gc",
    "get_preset",
    "get_global_graph_memory_pool",
    "is_capture_mode",
    "model_capture_mode",
    "pad_to_bucket",
    "set_global_graph_memory_pool",
]
