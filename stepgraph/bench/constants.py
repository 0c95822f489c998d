"""Names shared by the bench modules and the CLI (kept apart so that no bench module imports
another's entry point: ``main`` and ``prefill`` both read these)."""

from __future__ import annotations

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# `stepgraph bench` default --modes (engine: the Engine end to end, e2e.py)
GPU_MODES = "eager,graph,exact,engine,hf-eager,hf-static-compile"
CPU_MODES = ("eager", "graph")  # what `stepgraph bench --device cpu` can time

__all__ = ["CPU_MODES", "DTYPES", "GPU_MODES"]
