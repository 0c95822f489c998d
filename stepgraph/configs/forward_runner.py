"""``ConfigGraphRunner``: whole-forward graphs driven by ``CudaGraphConfig`` objects.

    runner = ConfigGraphRunner(model, [BatchedCudaGraphConfig("decode", one_request)],
                               device="cuda")
    out = runner.run("decode", requests)     # [bs, ...] (batched) or [tokens, ...] (packed)

Calling convention. For every key ``(walk, bs, total_tokens, additional_key_info)`` the runner
captures ``getattr(model, config.capture_forward_method)(walk=walk, inputs=inputs)`` where
``walk`` is ``config.capture_graph_walk`` and ``inputs`` is a dict of static tensors laid out by
the config: batched ``name -> [bs, *single_request_inputs[name].shape]``; packed
``name -> [total_tokens, ...]`` plus ``"cu_seqlens" -> [bs + 2] int32`` (``bs`` request slots
and the spare, see ``padding.py``; padded requests may be empty). The method returns one
tensor whose first dim is ``bs`` (batched) or ``total_tokens`` (packed), rows in request order;
it must read only ``inputs`` and model state and must not sync with the host. Eager runs use the
same call with the live walk and live inputs.

Capture goes through the shared ``capture_loop`` / ``capture_step`` of ``runner/capture.py``,
as the decode runner's and the piecewise runner's do.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from ..backends import CapturedGraph, CpuGraphBackend, canonical_device
from ..errors import CaptureError, ConfigError, ReplayError
from ..graph_pool import GraphPool
from ..runner.base import GraphRunnerBase
from ..runner.capture import capture_loop, capture_step, logger, storage_ptrs
from ..runner.stats import BucketStats, CaptureStats
from ..runner.stats_table import as_dict, by_reason, capture_rows, table
from .fit import check_inputs, smallest_fit
from .forward import CudaGraphConfig
from .padding import CU_SEQLENS, SPARE_SLOTS, NodeInputs

__all__ = ["ConfigGraphRunner", "ConfigRunnerStats", "GraphKey", "logger"]


class GraphKey(NamedTuple):
    walk: str
    bs: int
    total_tokens: int
    additional_key_info: Any


@dataclass
class ConfigRunnerStats:
    capture: CaptureStats | None = None
    replays: int = 0
    eager_calls: int = 0  # eager forward calls (a chunk counts once)
    eager_reasons: Counter = field(default_factory=Counter)  # reason -> batches run eagerly

    def as_dict(self) -> dict:
        """Every field and capture total, JSON-ready (``repr`` shows the same data)."""
        return as_dict(self)

    def __str__(self) -> str:
        eager = f"{self.eager_calls} calls; batches by reason: {by_reason(self.eager_reasons)}"
        rows = [*capture_rows(self.capture), ("replays", str(self.replays)), ("eager", eager)]
        return table("ConfigGraphRunner stats", rows)


class ConfigGraphRunner(GraphRunnerBase):
    """Captures one graph per key of every config; ``run`` replays the smallest key that fits.

    ``compile=True`` wraps the forward method in ``torch.compile`` before capture on CUDA; the
    CPU stand-in skips it (it tests graph logic, and compiling each key costs seconds there).
    """

    EAGER_HINT = "call the model eagerly"

    def __init__(
        self,
        model: Any,
        configs: Sequence[CudaGraphConfig],
        *,
        device: str | torch.device,
        backend: str = "auto",
        show_progress: bool = True,
        capture: bool = True,
        pool: GraphPool | None = None,
    ) -> None:
        """``pool``: the graph memory pool to capture into; default: the process-wide pool
        (``set_global_graph_memory_pool``), shared by every runner."""
        self.model = model
        self.configs = list(configs)
        self.device = canonical_device(device)
        self.show_progress = show_progress
        self._init_graphs(self.device, backend, pool)
        self.compile_enabled = not isinstance(self._backend, CpuGraphBackend)
        self._route: dict[tuple[str, Any], int] = {}  # (walk, key info) -> config index
        for i, c in enumerate(self.configs):
            if not callable(getattr(model, c.capture_forward_method, None)):
                raise ConfigError(
                    f"model has no method {c.capture_forward_method!r} (capture_forward_method "
                    f"of the config for walk {c.capture_graph_walk!r}); add it or fix the name."
                )
            for walk in c.walks:
                if (walk, c.additional_key_info) in self._route:
                    raise ConfigError(
                        f"walk {walk!r} (additional_key_info={c.additional_key_info!r}) is "
                        "served by two configs; give each walk one config."
                    )
                self._route[walk, c.additional_key_info] = i
        self.keys = {i: self._keys_of(c) for i, c in enumerate(self.configs)}
        self._templates = [_to(c.template(), self.device) for c in self.configs]
        self._static = [self._allocate(i) for i in range(len(self.configs))]
        self.graphs: dict[GraphKey, CapturedGraph]
        self.stats = ConfigRunnerStats()
        if capture:
            self.capture()

    def _keys_of(self, c: CudaGraphConfig) -> list[GraphKey]:
        # Ascending (total_tokens, bs): the first that fits is the smallest.
        keys = [
            GraphKey(c.capture_graph_walk, bs, t, c.additional_key_info)
            for bs in c.batch_sizes()
            for t in c.get_total_tokens(bs)
        ]
        if not keys:
            raise ConfigError(
                f"the config for walk {c.capture_graph_walk!r} yields no graph: every token "
                "bucket is smaller than every batch size; add a token bucket >= the smallest bs."
            )
        return sorted(keys, key=lambda k: (k.total_tokens, k.bs))

    def _allocate(self, i: int) -> dict[str, torch.Tensor]:
        """Static inputs, once, at the largest key (every key uses a leading slice of them)."""
        c, keys = self.configs[i], self.keys[i]
        max_bs, max_t = max(k.bs for k in keys), max(k.total_tokens for k in keys)
        reqs = [_to(r, self.device) for r in c.capture_requests(max_bs, max_t)]
        return c.model_inputs(reqs)

    def _view(self, i: int, key: GraphKey) -> dict[str, torch.Tensor]:
        rows = key.total_tokens if self.configs[i].packed else key.bs
        slots = key.bs + SPARE_SLOTS
        return {
            n: t[: slots + 1] if n == CU_SEQLENS else t[:rows] for n, t in self._static[i].items()
        }

    # ---------------------------------------------------------------------------------------
    # capture

    def capture(self) -> CaptureStats:
        """Capture every key of every config, largest first within a config."""
        self._check_alive("capture")
        self._release_graphs()
        items = [(i, k) for i in range(len(self.configs)) for k in reversed(self.keys[i])]
        self.stats.capture = capture_loop(
            items, self._capture_one, show_progress=self.show_progress
        )
        return self.stats.capture

    def _capture_one(self, item: tuple[int, GraphKey]) -> BucketStats:
        i, key = item
        c, static = self.configs[i], self._view(i, item[1])
        reqs = [_to(r, self.device) for r in c.capture_requests(key.bs, key.total_tokens)]
        c.model_inputs(reqs, out=static)  # the capture-time batch, in the static buffers
        forward = getattr(self.model, c.capture_forward_method)
        if c.compile and self.compile_enabled:
            forward = torch.compile(forward, dynamic=False)
        step = lambda: forward(walk=key.walk, inputs=static)  # reads only static buffers
        try:
            graph, stats = capture_step(
                self._backend,
                step,
                key=key,
                bs=key.bs,
                what=f"{key}",
                until_settled=not (c.compile and self.compile_enabled),  # torch.compile's kernels
            )
            self._check_output(graph.output, static, key, rows=next(iter(static.values())))
        except BaseException:
            self._release_graphs()
            raise
        self.graphs[key] = graph
        return stats

    def _check_output(self, out: Any, static: dict, key: GraphKey, rows: torch.Tensor) -> None:
        if not isinstance(out, torch.Tensor):
            raise CaptureError(
                f"the forward for {key} returned a {type(out).__name__}; it must return one "
                "tensor (first dim: requests for batched, tokens for packed)."
            )
        if storage_ptrs([out]) & storage_ptrs(static.values()):
            raise CaptureError(
                f"the forward for {key} returned one of its static inputs; a graph output must "
                "be allocated by the captured call (return a new tensor, e.g. x.clone())."
            )
        if out.shape[0] != rows.shape[0]:
            raise CaptureError(
                f"the forward for {key} returned shape {tuple(out.shape)}; its first dim must be "
                f"{rows.shape[0]} (one row per request for batched, per token for packed)."
            )

    # ---------------------------------------------------------------------------------------
    # run

    def run(
        self, walk: str, requests: list[NodeInputs], *, additional_key_info: Any = None
    ) -> torch.Tensor:
        """Run ``requests`` through ``walk``: replay the smallest key that fits, padded, and
        return its first rows (a view of a static output: the next replay overwrites it), or run
        eagerly when no key holds the batch (more requests or tokens than the largest key)."""
        self._check_alive("run")
        i = self._route.get((walk, additional_key_info))
        if i is None:
            known = sorted(w for w, info in self._route if info == additional_key_info)
            raise ConfigError(
                f"no config captures or replays walk {walk!r} (additional_key_info="
                f"{additional_key_info!r}); known walks: {known}. Add it to a config's "
                "capture_graph_walk or replay_graph_walks, or call the model eagerly."
            )
        c = self.configs[i]
        if not requests:
            raise ReplayError("empty batch; there is nothing to run, skip the step.")
        for j, r in enumerate(requests):  # checked before anything is copied
            check_inputs(r, self._templates[i], label=f"request {j}", full_shape=not c.packed)
        lens = [c.num_tokens(r) for r in requests]
        key = smallest_fit(self.keys[i], _shape, len(requests), sum(lens), c.packed)
        if key is None:
            return self._run_eager(i, walk, requests, lens)
        static = self._view(i, key)
        pads = [_to(p, self.device) for p in c.padding_requests(lens, key.bs, key.total_tokens)]
        c.model_inputs([*requests, *pads], out=static)
        graph = self.graphs[key]
        graph.replay()
        self.stats.replays += 1
        rows = sum(lens) if c.packed else len(requests)
        return graph.output[:rows]

    def _run_eager(self, i: int, walk: str, requests: list[NodeInputs], lens: list[int]):
        c, keys = self.configs[i], self.keys[i]
        max_bs, max_t = max(k.bs for k in keys), max(k.total_tokens for k in keys)
        self.stats.eager_reasons["too_large"] += 1
        chunks = [requests]
        if c.caps_eager_batch_size:
            chunks = _chunk(requests, lens, max_bs, max_t)
        forward = getattr(self.model, c.capture_forward_method)
        outs = [forward(walk=walk, inputs=c.model_inputs(chunk)) for chunk in chunks]
        self.stats.eager_calls += len(chunks)
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    # ---------------------------------------------------------------------------------------
    # lifetime

    def shutdown(self) -> None:
        """Release graphs, static buffers and the pool. Any later call raises ``ReplayError``."""
        self._release_graphs()
        self._static = []
        self._shut_down = True


def _shape(key: GraphKey) -> tuple[int, int]:
    return key.bs, key.total_tokens


def _chunk(requests: list, lens: list[int], max_bs: int, max_t: int) -> list[list]:
    """Consecutive chunks of at most ``max_bs`` requests and ``max_t`` tokens (a request longer
    than ``max_t`` forms a chunk of its own)."""
    chunks: list[list] = [[]]
    tokens = 0
    for r, n in zip(requests, lens):
        if chunks[-1] and (len(chunks[-1]) == max_bs or tokens + n > max_t):
            chunks.append([])
            tokens = 0
        chunks[-1].append(r)
        tokens += n
    return chunks


def _to(inputs: NodeInputs, device: torch.device) -> NodeInputs:
    return {n: t.to(device) for n, t in inputs.items()}
