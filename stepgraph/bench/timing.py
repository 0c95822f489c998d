"""Timing on the device: CUDA events after warm-up, medians, the read-stream bandwidth that
bounds a decode step, and the copy bandwidth."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def cuda_time_ms(
    fn: Callable[[], object], *, warmup: int = 10, iters: int = 50, inner: int = 1
) -> float:
    """Median milliseconds of one ``fn()`` call, timed with CUDA events.

    ``inner`` calls run between each pair of events (use it when one call is a few µs, so that
    event resolution does not dominate); the result is divided back to one call.
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for s, e in zip(starts, ends):
        s.record()
        for _ in range(inner):
            fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) / inner


def graph_call_us(
    fns: list[Callable[[], object]], *, repeats: int = 1, warmup: int = 3, iters: int = 20
) -> float:
    """Median µs per call of ``fns``, called in turn ``repeats`` times inside one CUDA graph
    (warmed up once on a side stream, then captured): launch gaps as inside a decode step, no
    host in the loop. Used by the kernel sweeps (``benchmarks/proj_sweep.py`` and others)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            for f in fns:
                f()
    ms = cuda_time_ms(graph.replay, warmup=warmup, iters=iters)
    del graph
    return ms * 1e3 / (repeats * len(fns))


def host_call_ms(
    fn: Callable[[], object], *, warmup: int = 5, iters: int = 20, inner: int = 1
) -> float:
    """``cuda_time_ms`` on the host clock, for work that ends when the call returns (the CPU,
    gloo collectives): median ms of one call, ``inner`` calls per sample."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        samples.append((time.perf_counter() - t0) * 1e3 / inner)
    return statistics.median(samples)


def host_time_us(
    fn: Callable[[], object], *, warmup: int = 100, iters: int = 2000, repeats: int = 7
) -> float:
    """Median over ``repeats`` of the mean host-side microseconds per ``fn()`` call.

    Measures what the CPU spends issuing the call (no device synchronisation inside the loop).
    """
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        samples.append((time.perf_counter() - t0) / iters * 1e6)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    return statistics.median(samples)


def copy_bandwidth_gbps(nbytes: int = 1 << 30, *, device: str = "cuda") -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written.

    Reported beside the read stream (``read_bandwidth``); not a floor for a decode step, which
    reads far more than it writes and can go faster than a copy.
    """
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    ms = cuda_time_ms(lambda: dst.copy_(src), warmup=3, iters=20)
    return 2 * src.numel() / (ms * 1e-3) / 1e9


READ_BYTES = 4 << 30  # the read stream: far beyond any L2, so no read is a cache hit
GEMV_COLS = 8192  # the read stream's GEMV: a matrix of this many columns times a vector


def read_bandwidth(
    nbytes: int = READ_BYTES, *, device: str = "cuda", warmup: int = 3, iters: int = 20
) -> dict[str, float]:
    """GB/s of bytes read by two read-only streams over ``nbytes``, each the median of ``iters``
    calls after ``warmup`` (CUDA events on a GPU, the host clock on the CPU): ``"sum"``, a
    ``torch.sum`` of a float32 tensor, and ``"gemv"``, a bf16 matrix times a vector as a decode
    step's projections read their weights. The floor divides by the faster of the two."""
    time_ms = cuda_time_ms if device == "cuda" else host_call_ms

    def gbps(tensor: torch.Tensor, fn: Callable[[torch.Tensor], object]) -> float:
        ms = time_ms(lambda: fn(tensor), warmup=warmup, iters=iters)
        return tensor.numel() * tensor.element_size() / (ms * 1e-3) / 1e9

    def stream(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=device).uniform_()

    vector = torch.ones(GEMV_COLS, dtype=torch.bfloat16, device=device)
    rows = max(1, nbytes // (2 * GEMV_COLS))
    out = {
        "sum": gbps(stream(torch.float32, (max(1, nbytes // 4),)), torch.sum),
        "gemv": gbps(stream(torch.bfloat16, (rows, GEMV_COLS)), lambda w: torch.mv(w, vector)),
    }
    if device == "cuda":
        torch.cuda.empty_cache()  # hand the streams' memory back before the model is built
    return out


def read_bandwidth_gbps(nbytes: int = READ_BYTES, *, device: str = "cuda") -> float:
    """The read bandwidth a decode step's floor divides by: the best of ``read_bandwidth``."""
    return max(read_bandwidth(nbytes, device=device).values())
