"""Our modes, timed: eager PyTorch, fixed-geometry graphs, exact graphs, graphs + compile."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model.model_runner import ModelRunner
from ..runner import CudaGraphRunner, RunnerConfig
from .timing import cuda_time_ms
from .workload import Point, decode_batch

OUR_MODES = ("eager", "graph", "exact", "compile")


@dataclass
class ModeResult:
    mode: str
    ms_per_token: dict[Point, float]
    capture_seconds: float | None = None
    pool_mib: float | None = None
    error: str | None = None


def time_step(step, iters: int) -> float:
    """Median ms of one decode step, CUDA events over ``iters`` groups of 5 steps. No host sync
    inside, so host-side launch overhead shows up as GPU idle time, as it does when serving."""
    return cuda_time_ms(step, warmup=3, iters=iters, inner=5)


def run_mode(mode: str, mr: ModelRunner, points: list[Point], iters: int = 10) -> ModeResult:
    runner = None
    try:
        if mode != "eager":
            cfg = RunnerConfig(
                max_bs=max(p.bs for p in points),
                mode="exact" if mode == "exact" else "graph",
                enable_torch_compile=mode == "compile",
                torch_compile_max_bs=max(p.bs for p in points),
                show_progress=False,
            )
            runner = CudaGraphRunner(mr, cfg)
        result = ModeResult(mode, {})
        if runner is not None:
            result.capture_seconds = runner.stats.capture.seconds
            result.pool_mib = runner.stats.capture.pool_bytes / 2**20
        for point in points:
            batch, pages = decode_batch(mr, point)
            if runner is None:
                step = lambda b=batch: mr.forward(b).argmax(-1)
            else:
                step = lambda b=batch: runner.replay(b).argmax(-1)
            result.ms_per_token[point] = time_step(step, iters)
            for req_pages in pages:
                mr.kv_cache.release(req_pages)
        return result
    except Exception as e:  # reported as a failed row, never dropped
        return ModeResult(mode, {}, error=f"{type(e).__name__}: {e}"[:300])
    finally:
        if runner is not None:
            runner.shutdown()
        torch.cuda.empty_cache()
