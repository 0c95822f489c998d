"""Packed prefill replayed whole from one CUDA graph per token bucket, extend attention included.

    prefill = GraphPrefill(model_runner)          # captures one graph per token bucket
    logits = prefill.extend(chunks)               # [n, vocab], like ModelRunner.extend

An eager prefill of a few hundred tokens is bound by the host: about 150 launches from Python,
several times its compute (docs/experiments.md#whole-forward-prefill-graphs). The extend
kernel takes its geometry from device tensors (``qo_indptr``, ``kv_lens``, the block table) and
a grid sized by a host bound, so the whole forward can be captured: one graph per token bucket
``T``, every chunk of a batch in it, up to ``max_chunks`` chunks.

Static inputs, one int64 buffer laid out per bucket (``extend_batch.ExtendLayout``, packed by
``pack_extend`` as the eager batch is; one host-to-device copy per replay):

    input_ids [T] | positions [T] | slots [T] | last_idx [B] | qo_indptr [B + 1] | kv_lens [B]
    | block_table [B * W]                              (B = max_chunks, W = max pages a request)

Padding. Tokens past the live ones are token 0 at position 0 writing scratch slot 0; they
belong to no chunk (``qo_indptr`` ends at the live count), so no chunk attends to them and
their rows never reach a live one. Chunks past the live ones are empty (no query, no key).
The graph computes ``B`` rows of logits; the live ``n`` are returned (a view into the graph's
output: consume it before the next call). Batches above the largest bucket or with more than
``max_chunks`` chunks run eagerly (``ModelRunner.extend``), counted in ``stats``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ...backends import canonical_device
from ...buckets import pad_to_bucket, validate_buckets
from ...errors import ConfigError
from ...graph_pool import GraphPool
from ...runner.base import GraphRunnerBase
from ...runner.capture import capture_loop, capture_step
from ...runner.stats import BucketStats, CaptureStats
from ..model_runner import ModelRunner
from .extend_batch import (
    ExtendBatch,
    ExtendLayout,
    PrefillChunk,
    check_chunks,
    pack_extend,
    prompt_chunks,
    unpack_extend,
)

DEFAULT_TOKEN_BUCKETS = (64, 128, 256, 512, 1024, 2048)
DEFAULT_MAX_CHUNKS = 16


@dataclass
class GraphPrefillStats:
    capture: CaptureStats = field(default_factory=CaptureStats)
    graph_batches: int = 0
    eager_batches: int = 0


class GraphPrefill(GraphRunnerBase):
    """Whole-forward prefill graphs, one per token bucket (module docstring)."""

    EAGER_HINT = "prefill eagerly with ModelRunner.extend"

    def __init__(
        self,
        model_runner: ModelRunner,
        token_buckets: Sequence[int] = DEFAULT_TOKEN_BUCKETS,
        max_chunks: int = DEFAULT_MAX_CHUNKS,
        *,
        backend: str = "auto",
        capture: bool = True,
        show_progress: bool = False,
        pool=None,
    ) -> None:
        validate_buckets(token_buckets, "token_buckets")
        if isinstance(max_chunks, bool) or not isinstance(max_chunks, int) or max_chunks < 1:
            raise ConfigError(f"max_chunks must be an integer >= 1, got {max_chunks!r}.")
        self.mr = model_runner
        self.device = canonical_device(model_runner.device)
        self.token_buckets = list(token_buckets)
        self.max_chunks = max_chunks
        self.width = model_runner.max_pages_per_request  # W
        # a pool of its own (as PiecewisePrefill): its graphs replay between the decode
        # runner's, so sharing that pool would leave their outputs open to each other's scratch
        self._init_graphs(self.device, backend, pool or GraphPool())
        self._static = torch.zeros(
            self._layout(self.token_buckets[-1]).numel, dtype=torch.int64, device=self.device
        )
        self._live: tuple[list[int], list[int], list[list[int]]] = ([1], [1], [[0]])
        self.stats = GraphPrefillStats()
        if capture:
            self.capture()

    @property
    def runners(self) -> list[GraphPrefill]:
        """The graph runners behind this prefill (the engine's thread rule reaches them)."""
        return [self]

    def _layout(self, t: int) -> ExtendLayout:
        b = self.max_chunks
        return ExtendLayout(t, b, self.width, b + 1, b)

    def _views(self, t: int) -> ExtendBatch:
        """The static inputs of bucket ``t`` as an extend batch (int32 fields cast in-graph)."""
        fields = unpack_extend(self._static, self._layout(t))
        q_lens, kv_host, pages = self._live  # host copies: only the CPU attention reads them
        return ExtendBatch(*fields, q_lens, kv_host, pages, max_q_len_bound=t)

    # -- capture -----------------------------------------------------------------------------

    def capture(self) -> CaptureStats:
        """One graph per token bucket, largest first; on failure nothing is kept."""
        self._check_alive("capture")
        self._release_graphs()
        try:
            stats = capture_loop(
                reversed(self.token_buckets),
                self._capture_one,
                show_progress=False,
                backend=self._backend,
            )
        except BaseException:
            self._release_graphs()
            raise
        self.stats.capture = stats
        return stats

    def _capture_one(self, t: int) -> BucketStats:
        self._fill_padding(t)

        @torch.no_grad()
        def step() -> torch.Tensor:  # [B, vocab] float32; reads only the static buffer
            batch = self._views(t)
            self.mr.attn_backend.init_extend_metadata(batch)
            h = self.mr.model(batch.input_ids, batch.positions, self.mr.attn_backend)
            return self.mr.model.logits(h[batch.last_idx])

        graph, stats = capture_step(
            self._backend, step, key=t, bs=t, what=f"the packed prefill of {t} tokens"
        )
        self.graphs[t] = graph
        return stats

    def _fill_padding(self, t: int) -> None:
        """A batch of no live chunk: every token padding, every chunk empty."""
        host = pack_extend([], self.mr.page_size, self._layout(t))
        self._static[: host.size].copy_(torch.from_numpy(host))

    # -- replay ------------------------------------------------------------------------------

    def can_run(self, lengths: Sequence[int]) -> bool:
        """True if a captured bucket holds chunks of these lengths (each >= 1)."""
        return (
            0 < len(lengths) <= self.max_chunks
            and min(lengths) >= 1
            and sum(lengths) <= self.token_buckets[-1]
        )

    def prefill(
        self, prompts: Sequence[Sequence[int]], pages: Sequence[list[int]]
    ) -> torch.Tensor:  # [n, vocab] float32
        return self.extend(prompt_chunks(prompts, pages))

    def extend(self, chunks: Sequence[PrefillChunk]) -> torch.Tensor:  # [n, vocab] float32
        """Prefill ``chunks`` from the graph of the smallest bucket holding them; the
        contract of ``ModelRunner.extend``. The result is a view of the graph's output."""
        self._check_alive("extend")
        lens = [len(c.tokens) for c in chunks]
        if not self.can_run(lens):
            self.stats.eager_batches += 1
            return self.mr.extend(chunks)
        check_chunks(chunks, self.mr.page_size)
        t = pad_to_bucket(sum(lens), self.token_buckets)
        host = torch.from_numpy(pack_extend(chunks, self.mr.page_size, self._layout(t)))
        if self.device.type == "cuda":
            host = host.pin_memory()
        self._static[: host.numel()].copy_(host, non_blocking=True)
        self._live = (lens, [c.end for c in chunks], [list(c.pages) for c in chunks])
        self.graphs[t].replay()
        self.stats.graph_batches += 1
        return self.graphs[t].output[: len(chunks)]

    def shutdown(self) -> None:
        self._release_graphs()
        self._shut_down = True


__all__ = ["DEFAULT_MAX_CHUNKS", "DEFAULT_TOKEN_BUCKETS", "GraphPrefill", "GraphPrefillStats"]
