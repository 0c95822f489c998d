"""Graph backends: the only code that touches ``torch.cuda.CUDAGraph``.

``CudaGraphBackend`` captures real CUDA graphs on one side stream into one shared pool.
``CpuGraphBackend`` is the CPU stand-in used by CI (DESIGN §4): it records the callable at
capture and re-runs it at replay on the same static buffers, writing the same static outputs, so
the runner's buffer logic is tested for real. It refuses host syncs during capture, as CUDA does.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .errors import ConfigError
from .graph_pool import GraphPool, stop_recording_to_pool

Output = torch.Tensor


class CapturedGraph(ABC):
    """One captured step. ``output`` is a static tensor: every replay overwrites it in place."""

    output: Output

    @abstractmethod
    def replay(self) -> None: ...

    @abstractmethod
    def release(self) -> None: ...

    def launcher(self) -> Callable[[], None]:
        """The cheapest callable that replays this graph (the hot path takes it once)."""
        return self.replay

    def reinstantiate(self) -> None:
        """Rebuild the executable graph from its template (a no-op where there is none)."""
        return None


class GraphBackend(ABC):
    """Captures callables into graphs that share one pool, in the order they are captured."""

    def __init__(self, device: torch.device, pool: GraphPool | None = None) -> None:
        self.device = device
        self.pool = pool if pool is not None else GraphPool()
        self.capture_order: list[object] = []

    def warmup(self, fn: Callable[[], Output], iters: int) -> None:
        """Run ``fn`` eagerly ``iters`` times: compiles every kernel variant before capture
        (a module load inside a capture is error 900) and lets lazy buffers settle."""
        for _ in range(iters):
            fn()

    def pool_mark(self) -> int:
        """Bytes held by the allocator right before a capture; the capture's growth over this
        mark is what the pool took (0 on the CPU)."""
        return 0

    def held_bytes(self) -> int:
        """Bytes the allocator holds now, without emptying its cache (0 on the CPU)."""
        return 0

    def pool_held_bytes(self) -> int | None:
        """Bytes of the segments the allocator keeps for this backend's pool, by its own count
        (``None`` where there is no such count: the CPU, or no pool yet)."""
        return None

    @abstractmethod
    def capture(self, fn: Callable[[], Output], *, key: object) -> CapturedGraph:
        """Capture one call of ``fn``. On failure nothing half-captured is kept."""

    def release(self) -> None:
        """Forget the capture order (the caller releases the graphs, which frees the pool)."""
        self.capture_order.clear()


# --------------------------------------------------------------------------------------------
# CUDA


class CudaCapturedGraph(CapturedGraph):
    def __init__(self, graph: torch.cuda.CUDAGraph, output: Output) -> None:
        self.graph = graph
        self.output = output

    def replay(self) -> None:
        self.graph.replay()

    def launcher(self) -> Callable[[], None]:
        return self.graph.replay  # torch's replay itself: no wrapper call per token

    def raw_cuda_graph(self) -> int:
        """The template ``CUgraph`` handle (kept alive by ``keep_graph=True``)."""
        return self.graph.raw_cuda_graph()

    def raw_cuda_graph_exec(self) -> int:
        """The instantiated ``CUgraphExec`` handle: node edits go here."""
        return self.graph.raw_cuda_graph_exec()

    def reinstantiate(self) -> None:
        """Build a fresh exec from the template. Every exec edit is lost and must be re-applied."""
        self.graph.instantiate()

    def release(self) -> None:
        self.graph.reset()


class CudaGraphBackend(GraphBackend):
    def __init__(self, device: torch.device, pool: GraphPool | None = None) -> None:
        super().__init__(device, pool)

    @property
    def stream(self) -> torch.cuda.Stream:
        # Capture must not be on the default stream; one stream per pool (shared by every
        # runner capturing into it) keeps the pool's reuse safe and possible: graphs replay in
        # stream order, and freed blocks are reused only on the stream that allocated them.
        return self.pool.capture_stream(self.device)

    def warmup(self, fn: Callable[[], Output], iters: int) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            super().warmup(fn, iters)
        torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def pool_mark(self) -> int:
        # torch.cuda.graph() empties the cache on entry; do it first so the mark is stable.
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        return torch.cuda.memory_reserved(self.device)

    def held_bytes(self) -> int:
        return torch.cuda.memory_reserved(self.device)

    def pool_held_bytes(self) -> int | None:
        handle = self.pool.handle
        if handle is None:
            return None
        return sum(
            seg["total_size"]
            for seg in torch.cuda.memory_snapshot()
            if seg.get("device") == self.device.index
            and tuple(seg.get("segment_pool_id", ())) == tuple(handle)
        )

    def capture(self, fn: Callable[[], Output], *, key: object) -> CudaCapturedGraph:
        # keep_graph=True keeps the template graph (and its kernel nodes) alive after capture,
        # which graph_update needs; it also makes instantiate() explicit.
        graph = torch.cuda.CUDAGraph(keep_graph=True)
        pool = self.pool.get_or_create(self.device)
        try:
            with torch.cuda.graph(graph, pool=pool, stream=self.stream):
                output = fn()
            graph.instantiate()
        except BaseException:
            graph.reset()
            stop_recording_to_pool(self.device, pool)
            self.pool.abandon()
            raise
        self.capture_order.append(key)
        return CudaCapturedGraph(graph, output)


# --------------------------------------------------------------------------------------------
# CPU stand-in

# Ops that need the host to see a device value; a CUDA capture fails on them.
_HOST_SYNC_OPS = {
    "aten::_local_scalar_dense",  # .item(), int(t), bool(t), if t: ...
    "aten::nonzero",
    "aten::masked_select",
    "aten::unique",
    "aten::_unique2",
}


class _RefuseHostSync(TorchDispatchMode):
    """Fails like CUDA stream capture does when the captured code syncs with the host."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name in _HOST_SYNC_OPS:
            raise RuntimeError(
                f"operation not permitted when stream is capturing: {name} needs a host sync"
            )
        return func(*args, **(kwargs or {}))


class CpuCapturedGraph(CapturedGraph):
    def __init__(self, fn: Callable[[], Output], output: Output) -> None:
        self._fn = fn
        self.output = output
        self.replays = 0

    def replay(self) -> None:
        # Re-run on the static inputs, then write the result into the static output tensor,
        # as a graph would: callers holding a view of ``output`` see it overwritten.
        self.output.copy_(self._fn())
        self.replays += 1

    def release(self) -> None:
        self._fn = None  # type: ignore[assignment]


class CpuGraphBackend(GraphBackend):
    def capture(self, fn: Callable[[], Output], *, key: object) -> CpuCapturedGraph:
        self.pool.get_or_create(self.device)  # pool sharing is observable on the CPU too
        with _RefuseHostSync():
            output = fn()
        if not isinstance(output, torch.Tensor):
            raise TypeError(f"captured callable must return a tensor, got {type(output).__name__}")
        self.capture_order.append(key)
        return CpuCapturedGraph(fn, output)


def canonical_device(device: torch.device | str) -> torch.device:
    """``cuda`` -> ``cuda:<current>``, so device checks compare equal to tensors' devices."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def make_backend(
    device: torch.device, kind: str = "auto", pool: GraphPool | None = None
) -> GraphBackend:
    """``kind``: "cuda", "cpu" (the stand-in), or "auto" (by the device type)."""
    if kind == "auto":
        kind = "cuda" if device.type == "cuda" else "cpu"
    if kind == "cuda":
        return CudaGraphBackend(device, pool)
    if kind == "cpu":
        return CpuGraphBackend(device, pool)
    raise ConfigError(f"unknown graph backend {kind!r}; use 'auto', 'cuda' or 'cpu'.")
