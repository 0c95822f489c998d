"""Packed prefill of several prompts at once, everything but attention replayed from graphs.

    prefill = PiecewisePrefill(model_runner)                  # captures every region and shape
    logits = prefill.extend(chunks)                           # [n, vocab], like ModelRunner.extend

The chunks (``extend_batch.PrefillChunk``: whole prompts, or pieces of them over a cached
prefix) are packed end to end into ``T`` tokens. The decoder is cut at attention into
``num_layers + 1`` regions, each a ``PiecewisePackedConfig`` captured by its own
``PiecewiseRunner`` per ``(bs, token bucket)`` shape; every region is built from the decoder
layer's own halves (``DecoderLayer.before_attention`` / ``after_attention``), so the fused
kernels behind them run as in the eager forward:

    region 0      embed -> layer 0 before attention                    -> residual, q, k, v
    region i      layer i-1 after attention -> layer i before attention -> residual, q, k, v
    region L      layer L-1 after attention -> final norm -> last token of each prompt -> logits

RoPE of q and k happens in the region (``kernels.elementwise.rope_kv.apply_rope``): the layers' own
RoPE sits inside the backend's attention call, which this cuts out.

Between regions attention runs eagerly on the real tokens only (``prefill_attention``, shared
with the eager prefill): it writes their K/V into the requests' pages, then each chunk attends
to its request's cached prefix and to itself, causally, through the pages. Padded tokens go
through the per-token regions only: they never join a real chunk's attention and never reach
the KV cache, so they cannot change a real output.

The last region's shape-dependent input, the index of each prompt's last token, is a declared
step (``last_idx [bs + 1] int64``, the spare slot included), one persistent tensor per shape
rewritten in place. A batch no shape holds (more chunks or tokens than the largest shape) runs
eagerly through ``ModelRunner.extend``, counted in ``stats.eager_batches``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ...backends import canonical_device
from ...buckets import validate_buckets
from ...configs import PiecewiseCallInputs, PiecewisePackedConfig, PiecewiseRunner, pad_lengths
from ...errors import ConfigError
from ...graph_pool import GraphPool
from ...kernels.elementwise.kv_write import write_kv
from ...kernels.elementwise.rope_kv import apply_rope
from ...runner.stats import CaptureStats
from ..model_runner import ModelRunner
from .extend_batch import ExtendBatch, PrefillChunk, build_extend_batch, prompt_chunks
from .prefill_attention import extend_attention

DEFAULT_TOKEN_BUCKETS = (16, 64, 256, 512, 1024, 2048)
DEFAULT_BATCH_SIZES = (1, 2, 4, 8)


@dataclass(frozen=True)
class PrefillShapes:
    """Shapes of a ``PiecewisePrefill``: every ``(bs, tokens)`` pair with ``tokens >= bs``.
    ``max(batch_sizes) + 1`` must be below ``min(token_buckets)``: a shape's per-request rows
    (``bs`` plus the spare slot) and per-token rows must differ so the runner can tell its
    outputs apart."""

    token_buckets: tuple[int, ...] = DEFAULT_TOKEN_BUCKETS
    batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES
    backend: str = "auto"  # "cuda", "cpu" (stand-in) or "auto" (by device)
    show_progress: bool = False

    def __post_init__(self) -> None:
        validate_buckets(self.token_buckets, "token_buckets")
        validate_buckets(self.batch_sizes, "batch_sizes")
        if max(self.batch_sizes) + 1 >= min(self.token_buckets):
            raise ConfigError(
                f"max(batch_sizes)={max(self.batch_sizes)} must be < min(token_buckets) - 1 ="
                f"{min(self.token_buckets) - 1}; drop the large batch sizes or the small bucket."
            )


@dataclass
class PrefillStats:
    capture: CaptureStats = field(default_factory=CaptureStats)  # every region's shapes
    graph_batches: int = 0
    eager_batches: int = 0


class PiecewisePrefill:
    """Packed prefill through ``num_layers + 1`` piecewise runners (module docstring)."""

    def __init__(
        self,
        model_runner: ModelRunner,
        config: PrefillShapes | None = None,
        *,
        capture: bool = True,
    ) -> None:
        self.mr = model_runner
        self.config = config = config or PrefillShapes()
        self.model = model_runner.model
        self.device = canonical_device(model_runner.device)
        self._pool = GraphPool()  # shared by every region (they replay in capture order)
        c = model_runner.config
        self.num_layers, self.hidden = c.num_layers, c.hidden_size
        self.n_heads, self.n_kv, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_size, self.kv_size = c.q_size, c.kv_size
        self.sm_scale = self.head_dim**-0.5
        t_max = config.token_buckets[-1]
        # Static inputs, once at the largest bucket; every region and shape uses leading rows
        # (regions replay one after another, and each copies its inputs in first).
        dev, dt = self.device, model_runner.dtype
        self._static = {
            "input_ids": torch.zeros(t_max, dtype=torch.int64, device=dev),  # [T]
            "positions": torch.zeros(t_max, dtype=torch.int64, device=dev),  # [T]
            "residual": torch.zeros(t_max, self.hidden, dtype=dt, device=dev),  # [T, hidden]
            "attn": torch.zeros(t_max, self.q_size, dtype=dt, device=dev),  # [T, q_size]
        }
        self._last_idx: dict[tuple[int, int], torch.Tensor] = {}  # (bs, T) -> [bs] int64
        self.stats = PrefillStats()
        self.runners = [self._runner(i, capture) for i in range(self.num_layers + 1)]

    # -- regions -----------------------------------------------------------------------------

    def _runner(self, region: int, capture: bool) -> PiecewiseRunner:
        last = region == self.num_layers
        names = ("input_ids", "positions") if region == 0 else ("residual", "attn", "positions")
        if last:
            names = ("residual", "attn")
        cfg = PiecewisePackedConfig(
            capture_fn=lambda call: self._region(region, call),
            make_static_inputs=lambda shape: {
                n: self._static[n][: shape.total_tokens] for n in names
            },
            declare_step=self._declare_last if last else None,
            total_tokens=list(self.config.token_buckets),
            capture_batch_sizes=list(self.config.batch_sizes),
        )
        with torch.no_grad():
            runner = PiecewiseRunner(
                cfg,
                device=self.device,
                backend=self.config.backend,
                show_progress=self.config.show_progress,
                capture=capture,
                pool=self._pool,  # regions replay in capture order: one pool serves them all
            )
        self.stats.capture.buckets.extend(runner.stats.buckets)
        return runner

    def _declare_last(self, names: list[str], seq_lens: list[int]) -> dict[str, torch.Tensor]:
        """``last_idx [bs] int64``: each (padded) request's last packed row, written in place
        into the shape's persistent tensor."""
        key = (len(seq_lens), sum(seq_lens))
        buf = self._last_idx.get(key)
        if buf is None:
            buf = self._last_idx[key] = torch.zeros(key[0], dtype=torch.int64, device=self.device)
        ends = torch.tensor(seq_lens, dtype=torch.int64).cumsum(0) - 1
        buf.copy_(ends)
        return {"last_idx": buf}

    def _region(self, region: int, call: PiecewiseCallInputs) -> dict[str, torch.Tensor]:
        """Region ``r``: layer ``r - 1`` after its attention, then layer ``r`` up to its
        attention (``DecoderLayer.after_attention`` / ``before_attention``), as the eager
        forward runs them; the first region starts at the embeddings, the last ends in logits."""
        s, layers = call.static_inputs, self.model.layers
        if region == 0:
            x, residual = self.model.embed_tokens(s["input_ids"]), None  # [T, hidden]
        else:
            x, residual = layers[region - 1].after_attention(s["attn"], s["residual"])
        if region == self.num_layers:
            last = call.resources["last_idx"]  # [bs + 1] int64
            h = self.model.norm(x[last], residual[last])[0]  # [bs + 1, hidden]
            return {"logits": self.model.logits(h)}  # [bs + 1, vocab] float32
        qkv, residual = layers[region].before_attention(x, residual)
        t = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        pos = s["positions"]
        cos, sin = self.model.rope_cos[pos], self.model.rope_sin[pos]  # [T, head_dim]
        return {
            "residual": residual,  # [T, hidden]
            "q": apply_rope(q.view(t, self.n_heads, self.head_dim), cos, sin),  # [T, H, hd]
            "k": apply_rope(k.view(t, self.n_kv, self.head_dim), cos, sin),  # [T, Hkv, hd]
            "v": v.reshape(t, self.n_kv, self.head_dim),  # [T, Hkv, hd]
        }

    # -- prefill -----------------------------------------------------------------------------

    def can_run(self, lengths: Sequence[int]) -> bool:
        """``True`` if a captured shape holds chunks of these lengths (each >= 1)."""
        n, bs = sum(lengths), len(lengths)
        if not bs or min(lengths) < 1:
            return False
        return any(
            pad_lengths(n, bs, shape.bs, shape.total_tokens) is not None
            for shape in self.runners[0].shapes
        )

    def prefill(
        self, prompts: Sequence[Sequence[int]], pages: Sequence[list[int]]
    ) -> torch.Tensor:  # [n, vocab] float32, logits of each prompt's last token
        """Whole prompts from position 0: ``extend`` of one chunk each."""
        return self.extend(prompt_chunks(prompts, pages))

    @torch.no_grad()
    def extend(
        self, chunks: Sequence[PrefillChunk]
    ) -> torch.Tensor:  # [n, vocab] float32, logits of each chunk's last token
        """Prefill ``chunks`` as one packed batch; the contract of ``ModelRunner.extend``."""
        lens = [len(c.tokens) for c in chunks]
        if not self.can_run(lens):  # also: no chunks, or an empty one (extend names it)
            self.stats.eager_batches += 1
            return self.mr.extend(chunks)
        batch = build_extend_batch(chunks, self.mr.page_size, self.device)
        inputs = {"input_ids": batch.input_ids, "positions": batch.positions}
        out = self.runners[0].replay(inputs, lens)
        for layer_id in range(self.num_layers):
            attn = self._attention(layer_id, out, batch)  # [n, q_size]
            live = {"residual": out["residual"], "attn": attn}
            if layer_id + 1 < self.num_layers:
                live["positions"] = batch.positions
            out = self.runners[layer_id + 1].replay(live, lens)
        self.stats.graph_batches += 1
        return out["logits"]

    def _attention(
        self,
        layer_id: int,
        out: dict[str, torch.Tensor],  # q [n, H, hd], k/v [n, Hkv, hd]: real rows
        batch: ExtendBatch,
    ) -> torch.Tensor:  # [n, q_size]
        q, k, v = out["q"], out["k"], out["v"]
        kv = self.mr.kv_cache
        k_cache, v_cache = kv.k_caches[layer_id], kv.v_caches[layer_id]
        write_kv(k_cache, v_cache, k, v, batch.slots)
        o = extend_attention(q, k_cache, v_cache, batch, self.sm_scale)
        return o.reshape(q.shape[0], self.q_size)

    def shutdown(self) -> None:
        for r in self.runners:
            r.shutdown()


__all__ = [
    "DEFAULT_BATCH_SIZES",
    "DEFAULT_TOKEN_BUCKETS",
    "PiecewisePrefill",
    "PrefillShapes",
    "PrefillStats",
]
