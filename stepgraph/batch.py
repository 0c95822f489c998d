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
    # Optional packed form [bs, PACKED_COLS + pages] int64 of the same values (see pack_batch):
    # the graph runner then fills its static inputs with ONE copy and unpacks inside the graph.
    packed: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    def device_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors that live on the model's device (everything but ``seq_lens_cpu``)."""
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.name not in ("seq_lens_cpu", "mode", "max_seq_len", "packed")
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


# Columns of a packed decode batch; the block table follows from column PACKED_COLS on.
PACKED_FIELDS = ("input_ids", "positions", "out_cache_loc", "seq_lens")
PACKED_COLS = len(PACKED_FIELDS)


def pack_batch(batch: ForwardBatch) -> torch.Tensor:
    """``[bs, PACKED_COLS + max_pages]`` int64: one row per request, ``input_ids, positions,
    out_cache_loc, seq_lens, block_table...``. Build it on the host and copy it once, and a
    replay costs one input copy instead of one per field."""
    cols = torch.stack([getattr(batch, f).to(torch.int64) for f in PACKED_FIELDS], dim=1)
    return torch.cat([cols, batch.block_table.to(torch.int64)], dim=1)


def unpacked_batch(
    packed: torch.Tensor, seq_lens_cpu: torch.Tensor, *, copy: bool = True
) -> ForwardBatch:
    """The ``ForwardBatch`` of a packed tensor.

    ``copy=True`` gives contiguous fields of the right dtypes (a few device kernels; for eager
    steps). ``copy=False`` gives zero-copy strided views, enough for a graph runner with packed
    inputs (it copies only ``packed``): the int32 fields view the low words of the int64
    columns (little-endian, values in [0, 2**31)).
    """
    if copy:
        return ForwardBatch(
            input_ids=packed[:, 0].contiguous(),
            positions=packed[:, 1].contiguous(),
            out_cache_loc=packed[:, 2].contiguous(),
            seq_lens=packed[:, 3].to(torch.int32),
            seq_lens_cpu=seq_lens_cpu,
            block_table=packed[:, PACKED_COLS:].to(torch.int32),
            packed=packed,
        )
    words = packed.view(torch.int32)  # [bs, 2 * width]: (low, high) word of each int64
    return ForwardBatch(
        input_ids=packed[:, 0],
        positions=packed[:, 1],
        out_cache_loc=packed[:, 2],
        seq_lens=words[:, 2 * 3],
        seq_lens_cpu=seq_lens_cpu,
        block_table=words[:, 2 * PACKED_COLS :: 2],
        packed=packed,
    )


@runtime_checkable
class AttentionBackend(Protocol):
    """What the graph runner needs from a model's attention (sglang/pymllm names).

    ``init_forward_metadata`` prepares an eager step. The ``*_cuda_graph`` hooks work on the
    runner's static batch (views of its static buffers, first ``bs`` rows), so that whatever
    the backend derives on the device is recorded inside the graph and refreshed per replay.
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
