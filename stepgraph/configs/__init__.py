"""Declarative capture configs (mstar's ``cuda_graph_config`` API) and the runners that serve them.

- ``forward.py``          whole-forward configs: ``CudaGraphConfig``, batched and packed
- ``piecewise.py``        piecewise configs: one sub-region of a forward, per shape
- ``padding.py``          the packed padding rule (a spare request slot per key)
- ``forward_runner.py``   ``ConfigGraphRunner``: one graph per key, smallest-fit replay
- ``piecewise_runner.py`` ``PiecewiseRunner``: sub-regions captured per shape
- ``fit.py``              live-input checks and smallest-fit selection, shared by both runners
"""

from __future__ import annotations

from ..buckets import distribute_tokens
from .forward import (
    BatchedCudaGraphConfig,
    CudaGraphConfig,
    CudaGraphConfigType,
    PackedCudaGraphConfig,
)
from .forward_runner import ConfigGraphRunner
from .padding import CU_SEQLENS, PAD_SEQ_LEN, NodeInputs, pad_lengths
from .piecewise import (
    PiecewiseBatchedConfig,
    PiecewiseCallInputs,
    PiecewiseCaptureShape,
    PiecewiseConfigType,
    PiecewiseCudaGraphConfig,
    PiecewisePackedConfig,
)
from .piecewise_runner import PiecewiseRunner

__all__ = [
    "BatchedCudaGraphConfig",
    "CU_SEQLENS",
    "ConfigGraphRunner",
    "CudaGraphConfig",
    "CudaGraphConfigType",
    "NodeInputs",
    "PAD_SEQ_LEN",
    "PackedCudaGraphConfig",
    "PiecewiseBatchedConfig",
    "PiecewiseCallInputs",
    "PiecewiseCaptureShape",
    "PiecewiseConfigType",
    "PiecewiseCudaGraphConfig",
    "PiecewisePackedConfig",
    "PiecewiseRunner",
    "distribute_tokens",
    "pad_lengths",
]
