"""All-reduce cost of a tensor-parallel decode step, measured in the same run as the bench."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..model.model_runner import ModelRunner
from .timing import cuda_time_ms


def allreduce_us_per_step(mr: ModelRunner, sizes: list[int]) -> dict[int, float]:
    """µs per decode step spent in all-reduces, by batch size: a step does two per layer
    (after o_proj and down_proj) plus one for the vocab-parallel embedding, each of
    ``[bs, hidden]`` in the model dtype. Every rank must call this (it is collective)."""
    out = {}
    n = 2 * mr.config.num_layers + 1
    for bs in sizes:
        x = torch.randn(bs, mr.config.hidden_size, device=mr.device, dtype=mr.dtype)
        ms = cuda_time_ms(lambda x=x: dist.all_reduce(x), warmup=5, iters=20, inner=n)
        out[bs] = round(ms * 1e3 * n, 1)
    return out
