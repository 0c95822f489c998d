"""Our modes, timed: eager PyTorch, fixed-geometry graphs, exact graphs, graphs + compile."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..model.model_runner import ModelRunner
from ..runner import CudaGraphRunner, RunnerConfig
from .timing import cuda_time_ms
from .workload import Point, decode_batch

OUR_MODES = ("eager", "graph", "exact", "compile", "engine")  # engine: e2e.py


@dataclass
class ModeResult:
    mode: str
    ms_per_token: dict[Point, float]
    capture_seconds: float | None = None
    pool_mib: float | None = None
    error: str | None = None
    kernels_per_step: dict[Point, float] = field(default_factory=dict)


def kernels_per_step(step, replays: int = 3) -> float:
    """Device kernels one ``step()`` launches (torch.profiler over a few steps; kernels inside a
    replayed CUDA graph count one each)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            step()
        torch.cuda.synchronize()
    return sum(e.device_type == DeviceType.CUDA for e in prof.events()) / replays


def time_step(step, iters: int) -> float:
    """Median ms of one decode step, CUDA events over ``iters`` groups of 5 steps. No host sync
    inside, so host-side launch overhead shows up as GPU idle time, as it does when serving."""
    return cuda_time_ms(step, warmup=3, iters=iters, inner=5)


def run_mode(mode: str, mr: ModelRunner, points: list[Point], iters: int = 10) -> ModeResult:
    runner = None
    kernels = mr.kernels
    if mode == "compile":  # torch.compile of the fused step (PDL launches) is not supported
        mr.set_kernels("reference")
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
            run = mr.forward if runner is None else runner.replay
            if mr.fused_tokens(point.bs) is not None:  # greedy tokens come out of the step
                step = lambda b=batch, run=run: run(b)
            else:
                step = lambda b=batch, run=run: run(b).argmax(-1)
            result.ms_per_token[point] = time_step(step, iters)
            if not any(p.bs == point.bs for p in result.kernels_per_step):  # once per bs
                result.kernels_per_step[point] = kernels_per_step(step)
            for req_pages in pages:
                mr.kv_cache.release(req_pages)
        return result
    except Exception as e:  # reported as a failed row, never dropped
        return ModeResult(mode, {}, error=f"{type(e).__name__}: {e}"[:300])
    finally:
        if runner is not None:
            runner.shutdown()
        mr.set_kernels(kernels)
        torch.cuda.empty_cache()
