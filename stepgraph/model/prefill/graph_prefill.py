"""The padded prefill: a packed batch of chunks in the static layout of its token bucket,
replayed whole from that bucket's CUDA graph, or run eagerly on the very same shapes.

    prefill = GraphPrefill(model_runner)               # one graph per token and chunk bucket
    logits = prefill.extend(chunks)                    # [n, vocab], like ModelRunner.extend
    padded = GraphPrefill(model_runner, eager=True)    # no graph: the same forward, eagerly

An eager prefill of a few hundred tokens is bound by the host: about 150 launches from Python,
several times its compute (docs/experiments.md#whole-forward-prefill-graphs). The extend
kernel takes its geometry from device tensors (``qo_indptr``, ``kv_lens``, the block table) and
a grid sized by a host bound, so the whole forward can be captured: one graph per token bucket
``T`` and chunk bucket ``B`` (1 or ``max_chunks`` by default), every chunk of a batch in it.

One padded forward for every mode. A batch runs at its bucket's shapes whether a graph replays
it or not: ``T`` tokens, ``B`` rows of logits, the extend grid sized for ``B`` chunks of ``T``.
The projections then see the same matrix shapes (cuBLAS picks its kernels by shape), so the
graph of a bucket and the eager run (``eager=True``) give the same bits, and an engine in mode
"exact" (graphs) equals one in mode "eager" (``eager=True``). A batch above the largest bucket,
or of more than ``max_chunks`` chunks, runs the unpadded ``ModelRunner.extend`` either way
(counted in ``stats.unpadded_batches``), so that too is the same in every mode.

Static inputs, one int64 buffer laid out per bucket (``extend_batch.ExtendLayout``, packed by
``pack_extend`` as the eager batch is; one host-to-device copy per call, from pinned host
buffers reused in turn, of the token segments and the live chunks' block-table rows only):

    input_ids [T] | positions [T] | slots [T] | last_idx [B] | qo_indptr [B + 1] | kv_lens [B]
    | block_table [B * W]                          (B: the chunk bucket, W: max pages a request)

Padding. Tokens past the live ones are token 0 at position 0 writing scratch slot 0; they
belong to no chunk (``qo_indptr`` ends at the live count), so no chunk attends to them and
their rows never reach a live one. Chunks past the live ones are empty (no query, no key; their
block-table rows are never read, so stale rows stay). The forward computes ``B`` rows of
logits into one buffer shared by every bucket (outside the graph pool); the live ``n`` are
returned, a view of it: consume it before the next call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
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
    pack_extend_into,
    prompt_chunks,
    unpack_extend,
)

# powers of two from 64 tokens to the engine's default prefill budget (scheduler.py's 8192)
DEFAULT_TOKEN_BUCKETS = (64, 128, 256, 512, 1024, 2048, 4096, 8192)
DEFAULT_MAX_CHUNKS = 32
SMALLEST_BUCKET = 64


def token_buckets_for(max_tokens: int, smallest: int = SMALLEST_BUCKET) -> list[int]:
    """Powers of two from ``smallest`` up to the first that holds ``max_tokens`` (the engine's
    prefill budget: every batch it plans fits a bucket)."""
    buckets = [smallest]
    while buckets[-1] < max_tokens:
        buckets.append(buckets[-1] * 2)
    return buckets


MLP_ROWS = 2048  # the padded forward's MLP runs on at most this many rows at a time


def activation_bytes(config, tokens: int, itemsize: int, mlp_rows: int = MLP_ROWS) -> int:
    """The most activation bytes the padded forward of ``tokens`` holds at once, about: around
    attention the residual, q, k and v, the rotated q and the output
    (``hidden + q + 2 kv + 2 q`` a token); in the MLP the residual, its normed input and the
    output, and for ``mlp_rows`` rows at a time the gate-up product, its SiLU-mul and their
    down projection. The largest bucket's capture sets the pool (the smaller ones reuse its
    blocks): for llama-3.2-1b in bf16, 200 MiB at 8192 tokens, 128 at 2048."""
    attention = tokens * (config.hidden_size + 3 * config.q_size + 2 * config.kv_size)
    rows = min(tokens, mlp_rows)
    mlp = 3 * tokens * config.hidden_size
    mlp += rows * (3 * config.intermediate_size + config.hidden_size)
    return itemsize * max(attention, mlp)


def padded_forward(
    model, batch: ExtendBatch, backend, mlp_rows: int = MLP_ROWS
) -> torch.Tensor:  # [B, hidden], the final norm of each chunk's last token
    """The decoder over every row of ``batch`` (a padded bucket), as ``LlamaModel.forward``
    and its layers compute it, but with only the rows that are read kept alive: each
    activation is dropped once used, the MLP runs ``mlp_rows`` rows at a time (its gate-up
    product is the largest activation), and after the last layer's attention (which writes
    every token's K/V) only the chunks' last rows go on through its projections, its MLP and
    the final norm: one layer's o_proj and MLP of ``T`` rows less."""
    rope = (model.rope_cos, model.rope_sin)
    positions, last = batch.positions, batch.last_idx
    x, residual = model.embed_tokens(batch.input_ids), None
    final = len(model.layers) - 1
    for i, layer in enumerate(model.layers):
        qkv, residual = layer.before_attention(x, residual)
        x = None
        o = backend.rope_attention(layer.self_attn.layer_id, qkv, positions, *rope)
        qkv = None
        o = o.reshape(o.shape[0], -1)
        if i == final:
            o, residual = o[last], residual[last]
        h = layer.self_attn.o_proj(o)
        o = None
        h, residual = layer.post_attention_layernorm(h, residual)
        if h.shape[0] <= mlp_rows:
            x = layer.mlp(h)
        else:
            x = torch.cat([layer.mlp(part) for part in h.split(mlp_rows)])
        h = None
    return model.norm(x, residual)[0]


@dataclass
class GraphPrefillStats:
    capture: CaptureStats = field(default_factory=CaptureStats)
    graph_batches: int = 0  # replayed from their bucket's graph
    padded_batches: int = 0  # ``eager=True``: their bucket's padded forward, run eagerly
    unpadded_batches: int = 0  # above the largest bucket or ``max_chunks``: ModelRunner.extend


class _HostStage:
    """Pinned host buffers of the largest layout that calls fill in turn (CUDA), so a call
    allocates and pins nothing; a buffer is written again only once the copy that read it, two
    calls before, has completed (its event). On the CPU the static buffer itself is filled."""

    SLOTS = 2

    def __init__(self, static: torch.Tensor) -> None:
        self.cuda = static.is_cuda
        if self.cuda:
            n, k = static.numel(), self.SLOTS
            self._bufs = [torch.zeros(n, dtype=torch.int64, pin_memory=True) for _ in range(k)]
            self._events = [torch.cuda.Event() for _ in range(self.SLOTS)]
        else:
            self._bufs = [static]
        self._arrays = [b.numpy() for b in self._bufs]
        self._next = 0

    def fill(self, static: torch.Tensor, fill: Callable[[np.ndarray], int]) -> None:
        """``fill(host) -> n`` writes the first ``n`` entries of a host buffer; they reach
        ``static[:n]`` (one non-blocking copy on CUDA)."""
        k = self._next
        self._next = (k + 1) % len(self._bufs)
        if not self.cuda:
            fill(self._arrays[k])
            return
        self._events[k].synchronize()  # the copy from it two calls ago (long done, as a rule)
        n = fill(self._arrays[k])
        static[:n].copy_(self._bufs[k][:n], non_blocking=True)
        self._events[k].record()


class GraphPrefill(GraphRunnerBase):
    """The padded prefill, one graph per token bucket, or eagerly on the same shapes with
    ``eager=True`` (module docstring).

    ``token_buckets``: the token counts a batch is padded to (sorted). ``max_chunks``: the
    most chunks a batch may have. ``chunk_buckets``: the chunk counts it is padded to (sorted,
    the last ``max_chunks``; default ``(1, max_chunks)``): a graph per token bucket and chunk
    bucket ``B``, which computes ``B`` rows of logits and sizes the extend grid for ``B``
    chunks of up to ``T`` tokens, so a lone chunk (one request's prompt, or the next chunk of
    a long one) launches no program for chunks it does not have. ``capture``: capture at
    construction (ignored with ``eager=True``); ``show_progress``: a progress bar and a summary
    line while capturing."""

    EAGER_HINT = "prefill eagerly with ModelRunner.extend"

    def __init__(
        self,
        model_runner: ModelRunner,
        token_buckets: Sequence[int] = DEFAULT_TOKEN_BUCKETS,
        max_chunks: int = DEFAULT_MAX_CHUNKS,
        *,
        chunk_buckets: Sequence[int] | None = None,
        eager: bool = False,
        backend: str = "auto",
        capture: bool = True,
        show_progress: bool = False,
        pool=None,
    ) -> None:
        validate_buckets(token_buckets, "token_buckets")
        if isinstance(max_chunks, bool) or not isinstance(max_chunks, int) or max_chunks < 1:
            raise ConfigError(f"max_chunks must be an integer >= 1, got {max_chunks!r}.")
        if chunk_buckets is None:
            chunk_buckets = sorted({1, max_chunks})
        validate_buckets(chunk_buckets, "chunk_buckets")
        if chunk_buckets[-1] != max_chunks:
            raise ConfigError(
                f"chunk_buckets must end at max_chunks={max_chunks}, got {list(chunk_buckets)}."
            )
        if not isinstance(eager, bool):
            raise ConfigError(f"eager must be True or False, got {eager!r}.")
        self.mr = model_runner
        self.device = canonical_device(model_runner.device)
        self.token_buckets = list(token_buckets)
        self.max_chunks = max_chunks
        self.chunk_buckets = list(chunk_buckets)
        self.eager = eager
        self.show_progress = show_progress
        self.width = model_runner.max_pages_per_request  # W
        self._layouts: dict[tuple[int, int], ExtendLayout] = {}
        # a pool of its own (as PiecewisePrefill): its graphs replay between the decode
        # runner's, so sharing that pool would leave their outputs open to each other's scratch
        self._init_graphs(self.device, backend, pool or GraphPool())
        self._static = torch.zeros(
            self._layout(self.token_buckets[-1], max_chunks).numel,
            dtype=torch.int64,
            device=self.device,
        )
        self._stage = _HostStage(self._static)
        # every bucket's logits: one buffer outside the pool (a graph's own output would stay
        # allocated in the pool for its life, B x vocab float32 per bucket)
        vocab = model_runner.config.vocab_size
        self._out = torch.empty(max_chunks, vocab, dtype=torch.float32, device=self.device)
        self._live: tuple[list[int], list[int], list[list[int]]] = ([1], [1], [[0]])
        self.stats = GraphPrefillStats()
        if capture and not eager:
            self.capture()

    @property
    def runners(self) -> list[GraphPrefill]:
        """The graph runners behind this prefill (the engine's thread rule reaches them)."""
        return [self]

    @property
    def keys(self) -> list[tuple[int, int]]:
        """Every (token bucket, chunk bucket), largest first: the order of capture."""
        return [(t, b) for t in reversed(self.token_buckets) for b in reversed(self.chunk_buckets)]

    def _layout(self, t: int, b: int) -> ExtendLayout:
        layout = self._layouts.get((t, b))
        if layout is None:
            layout = self._layouts[t, b] = ExtendLayout(t, b, self.width, b + 1, b)
        return layout

    def _views(self, t: int, b: int) -> ExtendBatch:
        """The static inputs of bucket ``(t, b)`` as an extend batch (int32 fields cast
        in-graph)."""
        fields = unpack_extend(self._static, self._layout(t, b))
        q_lens, kv_host, pages = self._live  # host copies: only the CPU attention reads them
        return ExtendBatch(*fields, q_lens, kv_host, pages, max_q_len_bound=t)

    @torch.no_grad()
    def _forward(self, t: int, b: int) -> torch.Tensor:  # [b, vocab] float32, shared output
        """The padded forward of bucket ``(t, b)``: what its graph captures and ``eager=True``
        runs. It reads only the static buffer and writes only the shared output."""
        batch = self._views(t, b)
        backend, model = self.mr.attn_backend, self.mr.model
        backend.init_extend_metadata(batch)
        h = padded_forward(model, batch, backend)
        return model.logits(h, self._out[:b])  # float32 straight into the shared output

    # -- capture -----------------------------------------------------------------------------

    def capture(self) -> CaptureStats:
        """One graph per token bucket and chunk bucket, largest first; on failure nothing is
        kept."""
        self._check_alive("capture")
        if self.eager:
            raise ConfigError("an eager GraphPrefill captures no graph; build it with eager=False.")
        self._release_graphs()
        try:
            stats = capture_loop(
                self.keys,
                self._capture_one,
                show_progress=self.show_progress,
                backend=self._backend,
            )
        except BaseException:
            self._release_graphs()
            raise
        self.stats.capture = stats
        return stats

    def _capture_one(self, key: tuple[int, int]) -> BucketStats:
        t, b = key
        self._fill_padding(t, b)
        graph, stats = capture_step(
            self._backend,
            lambda: self._forward(t, b),
            key=key,
            bs=t,
            what=f"the packed prefill of {t} tokens in {b} chunks",
        )
        self.graphs[key] = graph
        return stats

    def _fill_padding(self, t: int, b: int) -> None:
        """A batch of no live chunk: every token padding, every chunk empty."""
        host = pack_extend([], self.mr.page_size, self._layout(t, b))
        self._static[: host.size].copy_(torch.from_numpy(host))

    # -- replay ------------------------------------------------------------------------------

    def can_run(self, lengths: Sequence[int]) -> bool:
        """True if a bucket holds chunks of these lengths (each >= 1)."""
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
        """Prefill ``chunks`` at the smallest bucket holding them, from its graph (or eagerly
        with ``eager=True``); the contract of ``ModelRunner.extend``. The result is a view of
        the shared output: consume it before the next call."""
        self._check_alive("extend")
        lens = [len(c.tokens) for c in chunks]
        if not self.can_run(lens):
            self.stats.unpadded_batches += 1
            return self.mr.extend(chunks)
        check_chunks(chunks, self.mr.page_size)
        t = pad_to_bucket(sum(lens), self.token_buckets)
        b = pad_to_bucket(len(lens), self.chunk_buckets)
        layout, page = self._layout(t, b), self.mr.page_size
        self._stage.fill(self._static, lambda host: pack_extend_into(host, chunks, page, layout))
        self._live = (lens, [c.end for c in chunks], [c.pages for c in chunks])
        if self.eager:
            out = self._forward(t, b)
            self.stats.padded_batches += 1
        else:
            graph = self.graphs[t, b]
            graph.replay()
            out = graph.output
            self.stats.graph_batches += 1
        return out[: len(chunks)]

    def shutdown(self) -> None:
        self._release_graphs()
        self._shut_down = True


__all__ = [
    "DEFAULT_MAX_CHUNKS",
    "DEFAULT_TOKEN_BUCKETS",
    "GraphPrefill",
    "GraphPrefillStats",
    "MLP_ROWS",
    "activation_bytes",
    "padded_forward",
    "token_buckets_for",
]
