"""The reference model's decode step as a graph walk: ``forward_batched(walk, inputs)`` for a
``BatchedCudaGraphConfig`` driven by ``ConfigGraphRunner``.

    walks, runner = build_decode_graph_runner(model_runner)       # captures every bucket
    logits = runner.run(DECODE_WALK, walks.requests(batch))       # [bs, vocab] float32

Layout. One decode request is five tensors; the config stacks them to ``[bs, ...]``:

    input_ids      []            int64  the token fed this step
    positions      []            int64  its position (= seq_len - 1)
    seq_len        []            int32  KV length including this token
    out_cache_loc  []            int64  flat slot of the new token's K/V
    block_table    [max_pages]   int32  the request's pages, then scratch page 0

The dtypes are those of ``ForwardBatch``, so ``requests(batch)`` hands out row views of a
``ModelRunner.decode_batch`` with no copy. A padded request is token 0 at position 0 with
``seq_len`` 1, writing slot 0 and reading page 0: the scratch page no request owns, so padding
never touches live KV. The values are the decode runner's (``input_buffers``, and the backend's
``get_cuda_graph_seq_len_fill_value``).

Attention metadata. ``forward_batched`` builds a ``ForwardBatch`` over its inputs and calls
``ModelRunner.forward``. While a capture is in progress (``is_capture_mode()``: warm-up and
capture alike) it first calls the backend's ``init_forward_metadata_capture_cuda_graph(bs,
batch)``, as ``CudaGraphRunner`` does, so ``forward`` finds the backend ``is_prepared_for`` the
batch and records the bucket's geometry (valid for any length up to ``max_context_len``). Outside
a capture (eager chunks, and the CPU stand-in's replays) ``forward`` prepares eager metadata
itself from a host copy of ``seq_len``. Only the backend's public hooks are used.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...backends import canonical_device
from ...batch import ForwardBatch, ForwardMode
from ...buckets import default_capture_sizes
from ...configs import BatchedCudaGraphConfig, ConfigGraphRunner, NodeInputs
from ...errors import ConfigError
from ...runner.capture import is_capture_mode
from ...runner.input_buffers import PAD_PAGE, PAD_POSITION, PAD_SLOT, PAD_TOKEN_ID
from ..model_runner import ModelRunner

DECODE_WALK = "decode"
# request input name -> ForwardBatch field
_FIELDS = {
    "input_ids": "input_ids",
    "positions": "positions",
    "seq_len": "seq_lens",
    "out_cache_loc": "out_cache_loc",
    "block_table": "block_table",
}


class DecodeGraphWalks:
    """Adapts a ``ModelRunner`` to the ``forward_batched(walk=, inputs=)`` calling convention."""

    def __init__(self, model_runner: ModelRunner) -> None:
        self.model_runner = model_runner
        self.device = canonical_device(model_runner.device)
        self.max_pages = model_runner.max_pages_per_request
        self.max_context_len = model_runner.max_context_len
        self.seq_len_fill_value = model_runner.attn_backend.get_cuda_graph_seq_len_fill_value()

    def single_request_inputs(self) -> NodeInputs:
        """One padded request (see the module docstring): scratch page 0, slot 0, seq_len 1."""
        dev, i64, i32 = self.device, torch.int64, torch.int32
        return {
            "input_ids": torch.tensor(PAD_TOKEN_ID, dtype=i64, device=dev),
            "positions": torch.tensor(PAD_POSITION, dtype=i64, device=dev),
            "seq_len": torch.tensor(self.seq_len_fill_value, dtype=i32, device=dev),
            "out_cache_loc": torch.tensor(PAD_SLOT, dtype=i64, device=dev),
            "block_table": torch.full((self.max_pages,), PAD_PAGE, dtype=i32, device=dev),
        }

    def decode_config(
        self, capture_batch_sizes: Sequence[int] | None = None, *, compile: bool = False
    ) -> BatchedCudaGraphConfig:
        """The decode walk's config: one token per request, buckets ``capture_batch_sizes``
        (default ``[1, 2, 4, 8] + 16..max_bs step 16`` of the model runner's ``max_bs``)."""
        sizes = list(capture_batch_sizes or default_capture_sizes(self.model_runner.max_bs))
        return BatchedCudaGraphConfig(
            DECODE_WALK,
            self.single_request_inputs(),
            capture_batch_sizes=sizes,
            compile=compile,
        )

    def requests(self, batch: ForwardBatch) -> list[NodeInputs]:
        """The per-request inputs of a decode ``batch``: row views, nothing is copied."""
        if batch.mode is not ForwardMode.DECODE:
            raise ConfigError(
                f"the decode walk serves decode batches, got {batch.mode.value}; "
                "prefill prompts with ModelRunner.prefill."
            )
        rows = {name: getattr(batch, f).unbind(0) for name, f in _FIELDS.items()}
        return [{name: r[i] for name, r in rows.items()} for i in range(batch.batch_size)]

    @torch.no_grad()
    def forward_batched(
        self, *, walk: str, inputs: dict[str, torch.Tensor]
    ) -> torch.Tensor:  # inputs: name -> [bs, ...] (module docstring); -> [bs, vocab] float32
        if walk != DECODE_WALK:
            raise ConfigError(
                f"the reference model has walk {DECODE_WALK!r} only, got {walk!r}; prefill "
                "runs through ModelRunner.prefill or PiecewisePrefill."
            )
        missing = set(_FIELDS) - set(inputs)
        if missing:
            raise ConfigError(
                f"decode inputs lack {sorted(missing)}; build them with decode_config()."
            )
        bs = inputs["input_ids"].shape[0]
        capturing = is_capture_mode()
        if capturing:  # no host copy of device values: the bucket's geometry bounds them
            seq_lens_cpu = torch.full((bs,), self.max_context_len, dtype=torch.int32)
            max_seq_len = self.max_context_len
        else:  # eager: a host copy, as decode_batch keeps one
            seq_lens_cpu = inputs["seq_len"].to("cpu", torch.int32)
            max_seq_len = int(seq_lens_cpu.max()) if bs else 0
        batch = ForwardBatch(
            **{f: inputs[name] for name, f in _FIELDS.items()},
            seq_lens_cpu=seq_lens_cpu,
            mode=ForwardMode.DECODE,
            max_seq_len=max_seq_len,
        )
        if capturing:
            self.model_runner.attn_backend.init_forward_metadata_capture_cuda_graph(bs, batch)
        return self.model_runner.forward(batch)


def build_decode_graph_runner(
    model_runner: ModelRunner,
    *,
    capture_batch_sizes: Sequence[int] | None = None,
    backend: str = "auto",
    show_progress: bool = False,
    capture: bool = True,
) -> tuple[DecodeGraphWalks, ConfigGraphRunner]:
    """The adapter and a ``ConfigGraphRunner`` capturing its decode walk.

    Prepares the attention backend's graph state for the largest bucket first (its split-KV
    workspace). One graph runner per model runner: another one's ``init_cuda_graph_state``
    would replace the workspace these graphs captured.
    """
    walks = DecodeGraphWalks(model_runner)
    config = walks.decode_config(capture_batch_sizes)
    model_runner.attn_backend.init_cuda_graph_state(max(config.batch_sizes()))
    model_runner.attn_backend.graph_buckets = sorted(config.batch_sizes())  # ``geometry_bs``
    runner = ConfigGraphRunner(
        walks,
        [config],
        device=walks.device,
        backend=backend,
        show_progress=show_progress,
        capture=capture,
    )
    return walks, runner


__all__ = ["DECODE_WALK", "DecodeGraphWalks", "build_decode_graph_runner"]
