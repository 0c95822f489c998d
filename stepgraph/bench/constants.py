"""Names shared by the bench modules and the CLI (kept apart so that no bench module imports
another's entry point: ``main`` and ``prefill`` both read these)."""

from __future__ import annotations

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# `stepgraph bench` default --modes (engine: the Engine end to end, e2e.py)
GPU_MODES = "eager,graph,exact,engine,hf-eager,hf-static-compile"
CPU_MODES = ("eager", "graph")  # what `stepgraph bench --device cpu` can time
# the largest --batch-sizes: on the CPU the runner's default largest bucket (a point of 256 rows
# takes seconds; 100,000 rows took 25 minutes); on CUDA the memory check bounds it further
CPU_MAX_BS, GPU_MAX_BS = 256, 1024

__all__ = ["CPU_MAX_BS", "CPU_MODES", "DTYPES", "GPU_MAX_BS", "GPU_MODES"]
