"""Static input buffers of a graph runner, allocated once at the largest bucket.

A replay copies the live batch into rows ``[:bs]`` and keeps rows ``[bs:B]`` at padding values.
Those values are defined here and nowhere else:

    input_ids     PAD_TOKEN_ID (0)
    positions     PAD_POSITION (0)
    seq_lens      seq_len_fill_value (1: a padded row attends to one real slot)
    block_table   PAD_PAGE (0: page 0 is scratch that no request owns)
    out_cache_loc PAD_SLOT (0: so a padded row writes its K/V only into scratch)

With packed inputs (``RunnerConfig.packed_inputs``) the host fills only ``packed``
``[max_bs, PACKED.width(max_pages)]`` int64, with ONE copy per replay; the captured graph starts by
unpacking it into the per-field buffers (``unpack``), a few device copies that cost far less than
the host launches they replace.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from ..batch import BATCH_DTYPES, PACKED, ForwardBatch, ForwardMode
from .input_checks import SEQ_COL

PAD_TOKEN_ID = 0
PAD_POSITION = 0
PAD_PAGE = 0
PAD_SLOT = 0


@dataclass
class _RowViews:
    int32: list[torch.Tensor]  # seq_lens, block_table
    int64: list[torch.Tensor]  # input_ids, positions, out_cache_loc
    seq_lens_cpu: torch.Tensor
    packed: torch.Tensor


@dataclass
class GraphInputBuffers:
    input_ids: torch.Tensor  # [max_bs] int64
    positions: torch.Tensor  # [max_bs] int64
    seq_lens: torch.Tensor  # [max_bs] int32
    block_table: torch.Tensor  # [max_bs, max_pages] int32
    out_cache_loc: torch.Tensor  # [max_bs] int64
    seq_lens_cpu: torch.Tensor  # [max_bs] int32, host
    packed: torch.Tensor  # [max_bs, PACKED.width(max_pages)] int64: the packed-input rows
    packed_pad: torch.Tensor  # [PACKED.width(max_pages)] int64: one padding row
    seq_len_fill_value: int
    # Rows [:dirty_rows] may hold a previous batch's live values; rows past it hold padding.
    dirty_rows: int = 0
    _rows: dict[int, _RowViews] = field(default_factory=dict, repr=False)
    _seq_np: np.ndarray = field(init=False, repr=False)  # seq_lens_cpu as numpy (zero-copy)
    _lens_views: dict[int, np.ndarray] = field(default_factory=dict, repr=False)  # bs -> [:bs]

    def __post_init__(self) -> None:
        self._seq_np = self.seq_lens_cpu.numpy()

    @classmethod
    def allocate(
        cls, max_bs: int, max_pages: int, device: torch.device, seq_len_fill_value: int
    ) -> GraphInputBuffers:
        def full(shape, value, name, dev=device):
            return torch.full(shape, value, dtype=BATCH_DTYPES[name], device=dev)

        pad = pad_row(max_pages, seq_len_fill_value, device)
        return cls(
            input_ids=full((max_bs,), PAD_TOKEN_ID, "input_ids"),
            positions=full((max_bs,), PAD_POSITION, "positions"),
            seq_lens=full((max_bs,), seq_len_fill_value, "seq_lens"),
            block_table=full((max_bs, max_pages), PAD_PAGE, "block_table"),
            out_cache_loc=full((max_bs,), PAD_SLOT, "out_cache_loc"),
            seq_lens_cpu=full((max_bs,), seq_len_fill_value, "seq_lens_cpu", "cpu"),
            packed=pad.repeat(max_bs, 1),
            packed_pad=pad,
            seq_len_fill_value=seq_len_fill_value,
        )

    @property
    def max_bs(self) -> int:
        return int(self.input_ids.shape[0])

    def view(self, bs: int) -> ForwardBatch:
        """The static batch of bucket ``bs``: views of the first ``bs`` rows. A graph captured
        with it reads exactly these addresses at every replay."""
        return ForwardBatch(
            input_ids=self.input_ids[:bs],
            positions=self.positions[:bs],
            seq_lens=self.seq_lens[:bs],
            seq_lens_cpu=self.seq_lens_cpu[:bs],
            block_table=self.block_table[:bs],
            out_cache_loc=self.out_cache_loc[:bs],
            mode=ForwardMode.DECODE,
        )

    def rows(self, bs: int) -> _RowViews:
        """Views of rows ``[:bs]``, built once per batch size (slicing costs host time)."""
        views = self._rows.get(bs)
        if views is None:
            views = self._rows[bs] = _RowViews(
                int32=[self.seq_lens[:bs], self.block_table[:bs]],
                int64=[self.input_ids[:bs], self.positions[:bs], self.out_cache_loc[:bs]],
                seq_lens_cpu=self.seq_lens_cpu[:bs],
                packed=self.packed[:bs],
            )
        return views

    def copy_from(self, batch: ForwardBatch, bucket: int) -> None:
        """Copy ``batch`` into rows ``[:bs]``; reset stale rows of ``[bs:bucket]`` to padding.

        Only rows a previous, larger batch left dirty are re-padded, so a steady batch size costs
        two grouped copies (one per dtype) and no fills.
        """
        bs = batch.batch_size
        rows = self.rows(bs)
        if batch.block_table.shape[1] == self.block_table.shape[1]:
            torch._foreach_copy_(rows.int32, [batch.seq_lens, batch.block_table])
        else:  # a narrower table: columns past it are never read (seq_len bounds the pages)
            width = batch.block_table.shape[1]
            rows.int32[0].copy_(batch.seq_lens)
            rows.int32[1][:, :width].copy_(batch.block_table)
        torch._foreach_copy_(rows.int64, [batch.input_ids, batch.positions, batch.out_cache_loc])
        rows.seq_lens_cpu.copy_(batch.seq_lens_cpu)
        self._repad_stale_rows(bs, bucket, self.pad_rows)

    def copy_packed_from(self, batch: ForwardBatch, bucket: int) -> bool:
        """Packed path of ``copy_from``: one copy of ``batch.packed`` (packed here when the
        caller did not) into ``packed[:bs]``, stale rows re-padded. Returns whether the batch
        came packed."""
        bs = batch.batch_size
        src = batch.packed
        came_packed = src is not None
        rows = self.rows(bs)
        if src is None:  # the fields packed straight into the static rows: one launch
            width = PACKED.table_col + batch.block_table.shape[1]
            pack_fields(batch, rows.packed[:, :width])  # a narrower table: see below
        elif src.shape[1] == self.packed.shape[1]:
            rows.packed.copy_(src)
        else:  # a narrower table: columns past it are never read (seq_len bounds the pages)
            rows.packed[:, : src.shape[1]].copy_(src)
        rows.seq_lens_cpu.copy_(batch.seq_lens_cpu)
        self._repad_stale_rows(bs, bucket, self.pad_packed_rows)
        return came_packed

    def copy_host_lens(self, batch: ForwardBatch, bucket: int, rows=None) -> None:
        """Pinned-staging path (``staging.py`` stages the packed rows): only the host
        ``seq_lens_cpu`` rows here, from ``rows`` (the staged numpy rows) where given, stale
        ones re-padded. numpy, no torch op: each ``.numpy()`` costs about a microsecond."""
        if rows is not None:
            self.stage_host_lens(rows, bucket)
            return
        bs = batch.batch_size
        self._seq_np[:bs] = batch.seq_lens_cpu.numpy()
        if self.dirty_rows != bs:  # else nothing is stale and nothing changes
            self._repad_stale_rows(bs, bucket, self.pad_host_lens)

    def stage_host_lens(self, rows: np.ndarray, bucket: int) -> None:
        """``copy_host_lens`` from staged numpy rows ``[bs, width]``, into a view kept per
        ``bs`` (the staged replay's path: slicing costs host time)."""
        bs = rows.shape[0]
        dst = self._lens_views.get(bs)
        if dst is None:
            dst = self._lens_views[bs] = self._seq_np[:bs]
        dst[...] = rows[:, SEQ_COL]
        if self.dirty_rows != bs:  # else nothing is stale and nothing changes
            self._repad_stale_rows(bs, bucket, self.pad_host_lens)

    def pad_host_lens(self, start: int, stop: int) -> None:
        self.seq_lens_cpu[start:stop] = self.seq_len_fill_value

    def _repad_stale_rows(self, bs: int, bucket: int, pad: Callable[[int, int], None]) -> None:
        """Pad rows ``[bs:bucket]`` that a previous, larger batch left holding live values."""
        stale_stop = min(self.dirty_rows, bucket)
        if stale_stop > bs:
            pad(bs, stale_stop)
        # Rows past ``bucket`` are not read by this graph; a larger bucket re-pads them later.
        self.dirty_rows = self.dirty_rows if self.dirty_rows > bucket else bs

    def unpack(self, bs: int) -> None:
        """Inside the captured step: packed rows ``[:bs]`` -> the per-field static buffers."""
        p = self.packed[:bs]
        for name in PACKED.fields:
            getattr(self, name)[:bs].copy_(PACKED.column(p, name))
        self.block_table[:bs].copy_(PACKED.table(p))

    def pad_packed_rows(self, start: int, stop: int) -> None:
        """Set packed rows ``[start:stop]`` to the padding row (built by ``pad_row``)."""
        self.packed[start:stop] = self.packed_pad
        self.seq_lens_cpu[start:stop] = self.seq_len_fill_value

    def pad_rows(self, start: int, stop: int) -> None:
        """Set rows ``[start:stop]`` to the padding values (the one place that writes them)."""
        self.input_ids[start:stop] = PAD_TOKEN_ID
        self.positions[start:stop] = PAD_POSITION
        self.seq_lens[start:stop] = self.seq_len_fill_value
        self.seq_lens_cpu[start:stop] = self.seq_len_fill_value
        self.block_table[start:stop] = PAD_PAGE
        self.out_cache_loc[start:stop] = PAD_SLOT


# pack_fields concatenates the columns in PACKED's order
assert PACKED.fields == ("input_ids", "positions", "out_cache_loc", "seq_lens")


def pack_fields(batch: ForwardBatch, out: torch.Tensor | None = None) -> torch.Tensor:
    """``pack_batch(batch)`` as ONE concatenation (int32 columns promoted to int64), into
    ``out`` ``[bs, width]`` where given: one device launch where ``pack_batch`` takes four
    (a cast, a stack, a cast, a cat), each 8-17 us of host time on the H200 VM."""
    cols = (
        batch.input_ids.unsqueeze(1),
        batch.positions.unsqueeze(1),
        batch.out_cache_loc.unsqueeze(1),
        batch.seq_lens.unsqueeze(1),
        batch.block_table,
    )
    return torch.cat(cols, 1) if out is None else torch.cat(cols, 1, out=out)


def pad_row(max_pages: int, seq_len_fill_value: int, device: torch.device) -> torch.Tensor:
    """One packed padding row ``[PACKED.width(max_pages)]`` int64."""
    row = PACKED.row(
        input_ids=PAD_TOKEN_ID,
        positions=PAD_POSITION,
        out_cache_loc=PAD_SLOT,
        seq_lens=seq_len_fill_value,
        block_table=[PAD_PAGE] * max_pages,
    )
    return torch.tensor(row, dtype=torch.int64, device=device)
