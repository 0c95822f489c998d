"""``ModelRunner``: the reference model, its paged KV cache and attention backend behind the
``ModelRunnerLike`` interface the graph runner wraps (``stepgraph.batch``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from ..batch import PACKED, ForwardBatch, ForwardMode, unpacked_batch
from ..errors import ConfigError
from ..kernels.triton_setup import start_triton_key
from ..tuning import DecodeTuning, default_tuning
from .attention import PagedAttentionBackend
from .config import ModelConfig, get_preset
from .decode.decode_rows import block_table, decode_rows
from .decode.fused_decode import (
    FUSED_MAX_BS,
    check_kernels,
    check_rows,
    default_kernels,
    fused_decode_step,
    kernel_class,
    unfusable_reason,
)
from .fp8_linear import LOAD_BLOCKS, check_quantization, quantize_model
from .kv_cache import KVCache
from .llama import LlamaModel, build_model, init_random
from .prefill.extend_batch import PrefillChunk, build_extend_batch, prompt_chunks

DEFAULT_PAGE_SIZE = 16
DEFAULT_MAX_CONTEXT_LEN = 4096
GEMV_MAX_BS = 1  # batches up to this many rows use the Triton GEMV on CUDA, larger ones cuBLAS


def default_context_len(config: ModelConfig, max_context_len: int | None = None) -> int:
    """``max_context_len`` if given, else the model's positions capped at
    ``DEFAULT_MAX_CONTEXT_LEN`` (the KV cache is sized for it)."""
    return max_context_len or min(config.max_position_embeddings, DEFAULT_MAX_CONTEXT_LEN)


def _warm_triton(device: torch.device | str) -> None:
    """On CUDA, Triton's own hash computed while the weights load (``triton_setup``)."""
    if str(device).startswith("cuda"):  # never raises: a bad device is build_model's to name
        start_triton_key()


class ModelRunner:
    """Runs decode steps (``forward``) and prompt prefills (``prefill``) of one model.

    ``forward`` is what the ``CudaGraphRunner`` captures: it reads only the batch's tensors and
    the attention backend's metadata, and never syncs with the host.
    """

    def __init__(
        self,
        model: LlamaModel,
        config: ModelConfig,
        kv_cache: KVCache,
        device: torch.device | str,
        dtype: torch.dtype,
        max_bs: int,
        max_context_len: int,
        tuning: DecodeTuning | None = None,
    ) -> None:
        self.tuning = default_tuning(tuning)  # the decode step's choices (stepgraph.tuning)
        self.model, self.config = model, config
        self.kv_cache = kv_cache
        self.device = torch.device(device)
        self.dtype = dtype
        self.max_bs, self.max_context_len = max_bs, max_context_len  # forward: <= max_bs rows
        self.page_size = kv_cache.page_size
        self.max_pages_per_request = kv_cache.max_pages_per_request
        if model.max_positions < max_context_len:
            raise ConfigError(
                f"the model's RoPE table covers {model.max_positions} positions, fewer than "
                f"max_context_len={max_context_len}; build the model with max_positions >= it."
            )
        if self.device.type == "cuda":
            # The Triton GEMV beats cuBLAS at one row, not from 8 rows
            # (docs/experiments.md#one-row-the-gemv).
            model.use_gemv("all", max_bs=GEMV_MAX_BS)
        self.attn_backend = PagedAttentionBackend(
            kv_cache,
            num_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            device=self.device,
            max_context_len=max_context_len,
            tuning=self.tuning,
        )
        # "fused" | "reference": which kernels a decode step runs (``fused_decode``); the
        # greedy tokens of a fused step land in this static buffer, like the logits.
        self.kernels = default_kernels(self.device)
        self.greedy_tokens = torch.zeros(max(max_bs, 1), dtype=torch.int64, device=self.device)

    # -- kernels -----------------------------------------------------------------------------

    def set_kernels(self, kernels: str) -> None:
        """Run decode steps with the "fused" kernels or the "reference" ones; set it before a
        graph runner captures (a captured graph keeps the kernels it was captured with).
        ``torch.compile`` of a fused step is untested: compile with "reference"."""
        self.kernels = check_kernels(kernels)

    def uses_fused(self, bs: int) -> bool:
        """Whether a decode step of ``bs`` rows runs the fused kernels (a pure function of
        ``bs``'s graph bucket and the set-up: eager, graph and exact steps agree)."""
        fits = 1 <= bs and kernel_class(bs, self.attn_backend) <= FUSED_MAX_BS
        return (
            self.kernels == "fused"
            and fits
            and self.attn_backend.use_kernel
            and (unfusable_reason(self.model) is None)
        )

    def fused_tokens(self, bs: int) -> torch.Tensor | None:
        """``[bs]`` int64 greedy tokens of the last decode step of ``bs`` rows, computed inside
        the step (graph included) when it ran the fused kernels; else None (take the argmax of
        the logits). A static buffer: read it before the next step."""
        return self.greedy_tokens[:bs] if self.uses_fused(bs) else None

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def from_model(
        cls,
        model: LlamaModel,
        *,
        device: torch.device | str,
        dtype: torch.dtype,
        max_bs: int = 8,
        max_context_len: int | None = None,
        page_size: int = DEFAULT_PAGE_SIZE,
        num_pages: int | None = None,
        tuning: DecodeTuning | None = None,
    ) -> ModelRunner:
        """Wrap ``model`` with a KV cache of ``num_pages`` pages (default: ``max_bs`` requests
        of ``max_context_len`` tokens, plus scratch page 0)."""
        config = model.config
        max_context_len = max_context_len or model.max_positions
        pages_per_request = -(-max_context_len // page_size)
        kv = KVCache(
            num_layers=config.num_layers,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            num_pages=num_pages or max_bs * pages_per_request + 1,
            page_size=page_size,
            max_context_len=max_context_len,
            dtype=dtype,
            device=device,
        )
        return cls(model, config, kv, device, dtype, max_bs, max_context_len, tuning)

    @classmethod
    def from_config(
        cls,
        config: ModelConfig,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
        *,
        max_bs: int = 8,
        max_context_len: int | None = None,
        page_size: int = DEFAULT_PAGE_SIZE,
        num_pages: int | None = None,
        tuning: DecodeTuning | None = None,
        quantization: str | None = None,
    ) -> ModelRunner:
        """A model of ``config`` with random weights from ``seed`` (see ``init_random``);
        ``quantization="fp8"``: its projections then quantized per channel (``Fp8Linear``),
        ``"fp8-block"``: per 128 x 128 block."""
        check_quantization(quantization)
        _warm_triton(device)
        max_context_len = default_context_len(config, max_context_len)
        model = init_random(build_model(config, device, dtype, max_positions=max_context_len), seed)
        if quantization is not None:
            quantize_model(model, LOAD_BLOCKS[quantization])
        return cls.from_model(
            model,
            device=device,
            dtype=dtype,
            max_bs=max_bs,
            max_context_len=max_context_len,
            page_size=page_size,
            num_pages=num_pages,
            tuning=tuning,
        )

    @classmethod
    def from_preset(
        cls,
        name: str,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
        *,
        num_layers: int | None = None,
        tuning: DecodeTuning | None = None,
        quantization: str | None = None,
        **kwargs,
    ) -> ModelRunner:
        """Preset ``name`` (``config.PRESETS``), random weights; ``num_layers`` trims it.
        ``quantization="fp8"``: the projections quantized per channel on load."""
        config = get_preset(name)
        if num_layers is not None:
            config = config.with_layers(num_layers)
        return cls.from_config(
            config, device, dtype, seed, tuning=tuning, quantization=quantization, **kwargs
        )

    @classmethod
    def from_hf_dir(
        cls,
        path: str | Path,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        *,
        max_context_len: int | None = None,
        tuning: DecodeTuning | None = None,
        quantization: str | None = None,
        **kwargs,
    ) -> ModelRunner:
        """A local Hugging Face checkpoint directory (nothing is downloaded). An FP8 checkpoint
        (``model/quant.py``'s formats) loads with its projections in FP8;
        ``quantization="fp8"`` quantizes an unquantized one's per channel on load
        (``"fp8-block"``: per 128 x 128 block)."""
        from .hf_loader import load_hf_config, load_hf_model

        check_quantization(quantization)
        _warm_triton(device)
        config = load_hf_config(path)
        max_context_len = default_context_len(config, max_context_len)
        model = load_hf_model(
            path, device, dtype, max_positions=max_context_len, quantization=quantization
        )
        kwargs.update(device=device, dtype=dtype, max_context_len=max_context_len, tuning=tuning)
        return cls.from_model(model, **kwargs)

    # -- batches ----------------------------------------------------------------------------

    def decode_batch(
        self,
        tokens: Sequence[int],
        positions: Sequence[int],
        pages: Sequence[list[int]],
        *,
        contiguous_fields: bool = True,
        tokens_from: torch.Tensor | None = None,
        table: np.ndarray | None = None,
        device_copy: bool = True,
        values_checked: bool = False,
    ) -> ForwardBatch:
        """The decode batch where request ``i`` (owning ``pages[i]``) feeds ``tokens[i]`` at
        ``positions[i]``; its KV then holds ``positions[i] + 1`` tokens.

        ``tokens_from`` ``[n]`` int64 on the device (e.g. the last step's sampled ids): then
        ``tokens[i]`` is a row of it, and the id is gathered on the device, with no host round
        trip (the overlapped loop's input). The host copy ``packed_cpu`` then holds the rows.
        ``table``: ``decode_rows.block_table(pages, max_pages_per_request)``, when the caller
        kept it from a step with the same requests (it is then not rebuilt).

        One host->device copy of the packed rows ``[bs, PACKED.width(max_pages)]`` int64
        (``stepgraph.batch.PACKED``). ``contiguous_fields=False`` leaves the fields as
        zero-copy views, all a graph runner with packed inputs reads. ``device_copy=False``: no
        copy, host rows only (all a staged runner reads, ``runner.staged``). ``values_checked``:
        the caller vouches for every value (the runner then skips its value checks)."""
        bs, counts = len(tokens), [len(pg) for pg in pages]
        table = table if table is not None else block_table(pages, self.max_pages_per_request)
        shape = (bs, PACKED.width(self.max_pages_per_request))
        pin = device_copy and self.device.type == "cuda"  # a non_blocking copy reads it
        host = torch.empty(shape, dtype=torch.int64, pin_memory=pin)
        decode_rows(tokens, positions, table, counts, self.page_size, out=host.numpy())
        seq_lens = PACKED.column(host, "seq_lens").to(torch.int32)
        packed = host.to(self.device, non_blocking=True) if device_copy else host
        if tokens_from is not None:
            ids = PACKED.column(packed, "input_ids")  # [bs] rows of tokens_from, for now
            ids.copy_(tokens_from[ids])
        batch = unpacked_batch(packed, seq_lens, copy=contiguous_fields)
        batch.max_seq_len = int(seq_lens.max()) if bs else 0
        batch.packed_cpu = host  # the runner checks values here, before its copy
        batch.values_checked = values_checked
        batch.packed = batch.packed if device_copy else None  # nothing of it is on the device
        return batch

    # -- steps -------------------------------------------------------------------------------

    @torch.no_grad()
    def forward(
        self, batch: ForwardBatch, *, out: torch.Tensor | None = None
    ) -> torch.Tensor:  # [bs, vocab] float32 logits
        """One decode step: each request's token at its position, K/V written at
        ``out_cache_loc``. Called eagerly, it prepares the attention metadata itself; on the
        graph runner's static batch it uses what the capture/replay hook prepared.

        ``out`` ``[bs, vocab]`` float32: write the logits there (the graph runner passes rows of
        its shared output, so no float32 ``[bs, vocab]`` temporary lands in the graph pool)."""
        if batch.mode is not ForwardMode.DECODE:
            raise ConfigError("ModelRunner.forward runs decode batches; use prefill() for prompts.")
        bs = batch.input_ids.shape[0]
        check_rows(bs, self.max_bs)  # before anything reaches the device
        if not self.attn_backend.is_prepared_for(batch):
            self.attn_backend.init_forward_metadata(batch)
        if self.uses_fused(bs):
            return fused_decode_step(
                self.model,
                self.attn_backend,
                batch.input_ids,
                batch.positions,
                logits_out=out,
                tokens_out=self.greedy_tokens[:bs],
                tuning=self.tuning,
            )
        # the row-wise parts, the head included, at the rows of the graph bucket bs replays in
        # (``at_rows``): the model keeps its padding rows for the head, cut after it
        rows = kernel_class(bs, self.attn_backend)
        h = self.model(batch.input_ids, batch.positions, self.attn_backend, rows, keep_rows=True)
        if out is None:
            return self.model.logits(h)[:bs]
        return self.model.logits(h, out)  # the head at the bucket's rows, its live rows in out

    @torch.no_grad()
    def extend(
        self, chunks: Sequence[PrefillChunk]
    ) -> torch.Tensor:  # [n, vocab] float32, logits of each chunk's last token
        """One packed forward of ``chunks`` (``extend_batch``): each writes its K/V into its
        pages and attends to its request's earlier tokens there, then to itself, causally. The
        projections run as GEMMs over every token of every chunk at once."""
        batch = build_extend_batch(chunks, self.page_size, self.device)
        self.attn_backend.init_extend_metadata(batch)
        h = self.model(batch.input_ids, batch.positions, self.attn_backend)  # [T, hidden]
        return self.model.logits(h[batch.last_idx])

    def prefill(
        self, prompts: Sequence[Sequence[int]], pages: Sequence[list[int]]
    ) -> torch.Tensor:  # [n, vocab] float32, logits of each prompt's last token
        """Prefill whole ``prompts`` from position 0 in one packed forward (``extend``); each
        writes its K/V into its ``pages``. The engine splits larger work into chunks under its
        token budget (``Engine(max_prefill_tokens=...)``)."""
        return self.extend(prompt_chunks(prompts, pages))


__all__ = ["ModelRunner"]
