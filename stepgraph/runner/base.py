"""``GraphRunnerBase``: what the three runners share (decode, config-driven, piecewise).

Each runner captures into one graph memory pool: the one given, else the process-wide pool of
pymllm's ``CudaGraphRunner`` API (``set_global_graph_memory_pool``), else a new one that
becomes the global pool.

One thread drives a runner: its outputs are static buffers that the next call overwrites, and
its static inputs are filled per call, so two threads replaying one runner get each other's
values with no error. The runner
remembers the thread that created it and refuses calls from any other. Who serializes calls
and consumes each output before the next one sets ``runner.check_same_thread = False`` (as
sqlite's ``check_same_thread``).
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from ..backends import CapturedGraph, GraphBackend, make_backend
from ..batch import check_batch
from ..errors import ReplayError
from ..graph_pool import GraphPool
from .capture import STATE


class GraphRunnerBase:
    """Captured graphs, their backend and pool, their release, and the shutdown state.

    Subclasses call ``_init_graphs`` in ``__init__``, clear their own per-graph state in
    ``_forget_graphs``, and name their eager escape hatch in ``EAGER_HINT``.
    """

    EAGER_HINT = "run the step eagerly"
    check_same_thread = True  # set False on an instance whose calls you serialize yourself
    _check_batch = staticmethod(check_batch)  # ReplayError unless a ForwardBatch
    graphs: dict[Any, CapturedGraph]
    _backend: GraphBackend
    _shut_down: bool

    def _init_graphs(self, device: torch.device, backend: str, pool: GraphPool | None) -> None:
        self.graphs = {}
        self._backend = make_backend(device, backend, pool or STATE.pool_for_new_runner())
        self._shut_down = False
        self._owner = threading.current_thread()

    @property
    def pool(self) -> GraphPool:
        """The graph memory pool this runner captures into (shared with other runners)."""
        return self._backend.pool

    @property
    def capture_order(self) -> list:
        """Graph keys in the order they were captured (largest first); every rank of a
        tensor-parallel job must see the same list."""
        return list(self._backend.capture_order)

    def _release_graphs(self) -> None:
        for graph in self.graphs.values():
            graph.release()
        self.graphs.clear()
        self._forget_graphs()
        self._backend.release()

    def _forget_graphs(self) -> None:
        """Drop per-graph state (outputs, static inputs, plans) after the graphs are released."""

    def _check_alive(self, what: str) -> None:
        if self._shut_down:
            raise ReplayError(
                f"{what}() called after shutdown(); create a new {type(self).__name__}, "
                f"or {self.EAGER_HINT}."
            )
        if self.check_same_thread and threading.current_thread() is not self._owner:
            raise_other_thread(self, what, self._owner)


def raise_other_thread(obj: object, what: str, owner: threading.Thread) -> None:
    name = type(obj).__name__
    raise ReplayError(
        f"{what}() called from thread {threading.current_thread().name!r}, but this {name} "
        f"belongs to thread {owner.name!r}, which created it. Outputs are static buffers the "
        "next call overwrites, so one thread drives a runner: use one per thread, or serialize "
        "the calls, consume each output before the next call, and set "
        f"{name}.check_same_thread = False on this instance."
    )


def lend_graph_buckets(backend, buckets, returned=None) -> None:
    """Tell a backend with a ``graph_buckets`` attribute (optional: ``PagedAttentionBackend``)
    which buckets a graph runner captured, so that its eager steps are shaped as the graph a
    batch would replay in (mode exact then equals eager between buckets too). ``buckets=None``
    with ``returned``: a runner shutting down takes its buckets back, if they are still set."""
    if not hasattr(backend, "graph_buckets"):
        return
    if buckets is not None:
        backend.graph_buckets = list(buckets)
    elif backend.graph_buckets == list(returned):
        backend.graph_buckets = None
