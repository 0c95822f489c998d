"""All-reduce cost of a tensor-parallel decode step, measured inside the graph and eagerly.

Inside the graph (what decode actually pays): the step of each batch size is captured twice, as
it is and with every all-reduce switched off (``without_all_reduce``: each rank then computes on
its own partial sums; the logits are wrong, the kernels and their shapes are the same). Both
graphs are timed with CUDA events on replays; the difference is the time the all-reduces add to
a step, waits for the slower rank included. The LM head's all-gather stays in both graphs.

    with_ms - without_ms = all-reduce time per step     (2 per layer + 1 for the embedding)

Eagerly (``allreduce_us_per_step``): the same all-reduces called one by one, outside any graph.
Every function here is collective: every rank must call it with the same arguments.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from ..graph_pool import GraphPool
from ..model import parallel
from ..model.model_runner import ModelRunner
from .timing import cuda_time_ms


def allreduces_per_step(mr: ModelRunner) -> int:
    """Two per layer (after o_proj and down_proj) plus one for the vocab-parallel embedding."""
    return 2 * mr.config.num_layers + 1


def allreduce_us_per_step(
    mr: ModelRunner, sizes: list[int], *, time_ms: Callable[..., float] = cuda_time_ms
) -> dict[int, float]:
    """µs per decode step spent in all-reduces called eagerly, by batch size: each of
    ``[bs, hidden]`` in the model dtype. ``time_ms``: CUDA events, or ``host_call_ms`` on the
    CPU (gloo)."""
    out = {}
    n = allreduces_per_step(mr)
    for bs in sizes:
        x = torch.randn(bs, mr.config.hidden_size, device=mr.device, dtype=mr.dtype)
        ms = time_ms(lambda x=x: dist.all_reduce(x), warmup=5, iters=20, inner=n)
        out[bs] = round(ms * 1e3 * n, 1)
    return out


@contextlib.contextmanager
def without_all_reduce() -> Iterator[None]:
    """Within the block, the parallel modules skip their all-reduce (a capture taken inside it
    keeps none). Restored on exit, also after an error."""
    real = parallel._all_reduce
    parallel._all_reduce = _no_all_reduce
    try:
        yield
    finally:
        parallel._all_reduce = real


def _no_all_reduce(x: torch.Tensor, group: object, world_size: int) -> torch.Tensor:
    return x


def split_step(with_ms: float, without_ms: float, n_calls: int) -> dict[str, float]:
    """The figures of one batch size: step with and without the all-reduces, their share."""
    ar_us = max(with_ms - without_ms, 0.0) * 1e3
    return {
        "step_ms": round(with_ms, 4),
        "step_without_allreduce_ms": round(without_ms, 4),
        "allreduce_us": round(ar_us, 1),
        "allreduce_us_per_call": round(ar_us / max(n_calls, 1), 2),
        "allreduce_share": round(ar_us / (with_ms * 1e3), 3) if with_ms > 0 else 0.0,
    }


def allreduce_in_graph(
    mr: ModelRunner,
    sizes: list[int],
    context: int = 512,
    *,
    time_ms: Callable[[Callable[[], object]], float] | None = None,
) -> dict[int, dict[str, float]]:
    """By batch size: the decode step's graph replay timed with and without its all-reduces
    (``split_step``). ``context``: every request's KV length. ``time_ms`` times a replay
    (default: CUDA events, median of 30); tests pass a fake."""
    from ..runner import CudaGraphRunner, RunnerConfig

    time_ms = time_ms or (lambda fn: cuda_time_ms(fn, warmup=5, iters=30))
    context = min(context, mr.max_context_len)
    n = allreduces_per_step(mr)
    out = {}
    for bs in sizes:
        pages = [mr.kv_cache.reserve(context) for _ in range(bs)]
        batch = mr.decode_batch([1] * bs, [context - 1] * bs, pages)
        times = []
        for switch in (contextlib.nullcontext, without_all_reduce):
            cfg = RunnerConfig(capture_bs=(bs,), show_progress=False)
            with switch():
                runner = CudaGraphRunner(mr, cfg, pool=GraphPool())
            runner.replay(batch)  # inputs into the static buffers
            graph = runner.graphs[bs]
            times.append(time_ms(graph.replay))
            runner.shutdown()
        out[bs] = split_step(times[0], times[1], n)
        for p in pages:
            mr.kv_cache.release(p)
    return out
