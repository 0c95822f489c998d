"""``GraphRunnerBase``: what the three runners share (decode, config-driven, piecewise).

Each runner captures into one graph memory pool: the one given, else the process-wide pool of
the seed API (``set_global_graph_memory_pool``), else a new one that becomes the global pool.
"""

from __future__ import annotations

from typing import Any

import torch

from ..backends import CapturedGraph, GraphBackend, GraphPool, make_backend
from ..errors import ReplayError
from .capture import STATE


class GraphRunnerBase:
    """Captured graphs, their backend and pool, their release, and the shutdown state.

    Subclasses call ``_init_graphs`` in ``__init__``, clear their own per-graph state in
    ``_forget_graphs``, and name their eager escape hatch in ``EAGER_HINT``.
    """

    EAGER_HINT = "run the step eagerly"
    graphs: dict[Any, CapturedGraph]
    _backend: GraphBackend
    _shut_down: bool

    def _init_graphs(self, device: torch.device, backend: str, pool: GraphPool | None) -> None:
        self.graphs = {}
        self._backend = make_backend(device, backend, pool or STATE.pool_for_new_runner())
        self._shut_down = False

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
