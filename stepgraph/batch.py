"""The decode batch handed to a model runner, and the interfaces a model runner implements.

One decode step, as data (DESIGN §2). Every tensor's first dim is the batch ``bs``:

    input_ids     [bs]            int64  token fed this step
    positions     [bs]            int64  its position (= seq_len - 1)
    seq_lens      [bs]            int32  KV length *including* this token (device)
    seq_lens_cpu  [bs]            int32  host copy: geometry is decided without a device sync
    block_table   [bs, max_pages] int32  page ids of each request, in order
    out_cache_loc [bs]            int64  flat KV slot (page * page_size + offset) of the new token
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Protocol, runtime_checkable

import torch


class ForwardMode(enum.Enum):
    DECODE = "decode"
    PREFILL = "prefill"


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    block_table: torch.Tensor
    out_cache_loc: torch.Tensor
    mode: ForwardMode = ForwardMode.DECODE
    # Host int max(seq_lens) when the caller knows it (saves a reduction per step); else None.
    max_seq_len: int | None = None
    # Optional packed form [bs, PACKED.width(pages)] int64 of the same values (``PACKED``):
    # the graph runner then fills its static inputs with ONE copy and unpacks inside the graph.
    packed: torch.Tensor | None = None
    # The host rows ``packed`` was copied from, when the builder kept them: the runner checks
    # values there without a device sync (``stepgraph.runner.input_checks``).
    packed_cpu: torch.Tensor | None = None
    # True when the builder already checked every value (an engine that built the rows from
    # its own allocator and sampler): the runner then skips its value checks of the host rows.
    values_checked: bool = False

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    def device_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors that live on the model's device (everything but ``seq_lens_cpu``)."""
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.name
            not in ("seq_lens_cpu", "mode", "max_seq_len", "packed", "packed_cpu", "values_checked")
        }


# dtype each ForwardBatch field must have; the runner checks live batches against it.
BATCH_DTYPES: dict[str, torch.dtype] = {
    "input_ids": torch.int64,
    "positions": torch.int64,
    "seq_lens": torch.int32,
    "seq_lens_cpu": torch.int32,
    "block_table": torch.int32,
    "out_cache_loc": torch.int64,
}


@dataclass(frozen=True)
class PackedLayout:
    """The packed decode batch: one int64 row per request, the scalar fields, then the table.

        column   0          1          2              3         4 ... 4 + max_pages - 1
                 input_ids  positions  out_cache_loc  seq_lens  block_table[0 .. max_pages)

    Built on the host and copied once, it costs a replay one input copy instead of one per
    field. This object is the only place that knows the column order."""

    fields: tuple[str, ...] = ("input_ids", "positions", "out_cache_loc", "seq_lens")

    @property
    def table_col(self) -> int:
        """The first block-table column."""
        return len(self.fields)

    def width(self, max_pages: int) -> int:
        return self.table_col + max_pages

    def row(self, *, block_table: Sequence[int], **values: int) -> list[int]:
        """One request's row: ``values`` names every field in ``fields``."""
        return [int(values[f]) for f in self.fields] + [int(p) for p in block_table]

    def pack(self, batch: ForwardBatch) -> torch.Tensor:  # [bs, width] int64
        cols = torch.stack([getattr(batch, f).to(torch.int64) for f in self.fields], dim=1)
        return torch.cat([cols, batch.block_table.to(torch.int64)], dim=1)

    def column(self, packed: torch.Tensor, name: str) -> torch.Tensor:  # [bs] int64 view
        return packed[:, self.fields.index(name)]

    def table(self, packed: torch.Tensor) -> torch.Tensor:  # [bs, max_pages] int64 view
        return packed[:, self.table_col :]

    def low_words(self, packed: torch.Tensor, name: str | None) -> torch.Tensor:
        """Zero-copy int32 view of a column (``None``: of the block table): the low word of
        each int64 (little-endian; values in [0, 2**31))."""
        words = packed.view(torch.int32)  # [bs, 2 * width]: (low, high) word of each int64
        if name is None:
            return words[:, 2 * self.table_col :: 2]
        return words[:, 2 * self.fields.index(name)]


PACKED = PackedLayout()


def pack_batch(batch: ForwardBatch) -> torch.Tensor:
    """``[bs, PACKED.width(max_pages)]`` int64: ``batch`` in the packed layout."""
    return PACKED.pack(batch)


def unpacked_batch(
    packed: torch.Tensor, seq_lens_cpu: torch.Tensor, *, copy: bool = True
) -> ForwardBatch:
    """The ``ForwardBatch`` of a packed tensor.

    ``copy=True`` gives contiguous fields of the right dtypes (a few device kernels; for eager
    steps). ``copy=False`` gives zero-copy strided views, enough for a graph runner with packed
    inputs (it copies only ``packed``): the int32 fields view the low words of the int64
    columns.
    """
    col = lambda name: PACKED.column(packed, name)  # noqa: E731
    if copy:
        return ForwardBatch(
            input_ids=col("input_ids").contiguous(),
            positions=col("positions").contiguous(),
            out_cache_loc=col("out_cache_loc").contiguous(),
            seq_lens=col("seq_lens").to(torch.int32),
            seq_lens_cpu=seq_lens_cpu,
            block_table=PACKED.table(packed).to(torch.int32),
            packed=packed,
        )
    return ForwardBatch(
        input_ids=col("input_ids"),
        positions=col("positions"),
        out_cache_loc=col("out_cache_loc"),
        seq_lens=PACKED.low_words(packed, "seq_lens"),
        seq_lens_cpu=seq_lens_cpu,
        block_table=PACKED.low_words(packed, None),
        packed=packed,
    )


@runtime_checkable
class AttentionBackend(Protocol):
    """What the graph runner needs from a model's attention (sglang/pymllm names).

    ``init_forward_metadata`` prepares an eager step. The ``*_cuda_graph`` hooks work on the
    runner's static batch (views of its static buffers, first ``bs`` rows), so that whatever
    the backend derives on the device is recorded inside the graph and refreshed per replay.

    With ``RunnerConfig.packed_inputs`` (the default) the live values reach the per-field static
    buffers only inside the graph, after the replay hook has run: derive device metadata from
    them inside the captured forward (or at capture), not with device work launched from
    ``init_forward_metadata_replay_cuda_graph``. A backend that must do that work in the hook
    runs with ``packed_inputs=False``, where the hook sees the live batch in place.
    """

    def init_forward_metadata(self, batch: ForwardBatch) -> None: ...

    def init_cuda_graph_state(self, max_bs: int) -> None: ...

    def init_forward_metadata_capture_cuda_graph(self, bs: int, batch: ForwardBatch) -> None: ...

    def init_forward_metadata_replay_cuda_graph(self, bs: int, batch: ForwardBatch) -> None: ...

    def get_cuda_graph_seq_len_fill_value(self) -> int: ...


@runtime_checkable
class ModelRunnerLike(Protocol):
    """Anything the ``CudaGraphRunner`` can wrap.

    ``max_pages_per_request`` is the width of ``block_table``. Page 0 of the KV cache is scratch
    owned by no request: padded rows of a replayed batch read and write only there.
    """

    device: torch.device
    dtype: torch.dtype
    attn_backend: AttentionBackend
    max_pages_per_request: int

    def forward(self, batch: ForwardBatch) -> torch.Tensor: ...


_RUNNER_ATTRS = ("device", "dtype", "attn_backend", "max_pages_per_request")
_BACKEND_HOOKS = (
    "init_forward_metadata",
    "init_cuda_graph_state",
    "init_forward_metadata_capture_cuda_graph",
    "init_forward_metadata_replay_cuda_graph",
    "get_cuda_graph_seq_len_fill_value",
)


def check_model_runner(model_runner: object, who: str) -> None:
    """``ConfigError`` naming every attribute of ``ModelRunnerLike`` (and of its
    ``attn_backend``) that ``model_runner`` lacks, before ``who`` touches any of them."""
    from .errors import ConfigError

    missing = [a for a in _RUNNER_ATTRS if not hasattr(model_runner, a)]
    if not callable(getattr(model_runner, "forward", None)):
        missing.insert(0, "forward()")
    backend = getattr(model_runner, "attn_backend", None)
    if backend is not None:
        missing += [f"attn_backend.{h}()" for h in _BACKEND_HOOKS if not hasattr(backend, h)]
    if missing:
        raise ConfigError(
            f"{who} wraps a model runner, and this {type(model_runner).__name__} has no "
            f"{', '.join(missing)}; implement stepgraph.ModelRunnerLike (forward(batch) -> "
            "logits, device, dtype, max_pages_per_request, attn_backend with the "
            "AttentionBackend hooks), as stepgraph/toy_model.py does."
        )


def check_batch(batch: object, what: str) -> None:
    """``ReplayError`` unless ``batch`` is a ``ForwardBatch`` whose ``input_ids`` (which give
    the batch size) is a 1-D tensor (``what``: the call, named)."""
    if not isinstance(batch, ForwardBatch):
        from .errors import ReplayError

        raise ReplayError(
            f"{what}() takes a ForwardBatch, got {type(batch).__name__}; build one with "
            "stepgraph.ForwardBatch(...), as ModelRunner.decode_batch does."
        )
    ids = batch.input_ids
    if not isinstance(ids, torch.Tensor) or ids.dim() != 1:
        from .errors import ReplayError

        got = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise ReplayError(f"{what}(): input_ids must be a 1-D tensor [bs], got {got}.")
