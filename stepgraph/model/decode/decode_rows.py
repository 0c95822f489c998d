"""The host rows of a decode batch in the packed layout (``stepgraph.batch.PACKED``), built
with numpy: a Python loop over every block-table entry costs as much host time as the GPU step
it feeds (docs/experiments.md#packed-inputs).

    block_table(pages, max_pages)          [bs, max_pages] int64: pages, then scratch page 0
    decode_rows(tokens, positions, table)  [bs, PACKED.width(max_pages)] int64

A caller whose requests keep their pages (the engine reserves them all at admission) builds
the table once and passes it again while the batch holds the same requests.

    rows = DecodeRows(max_bs, max_pages, page_size)   # the engine's, kept across steps
    rows.fill(tokens, positions, table, page_counts)  # new requests: every row written
    rows.advance(bs)                                  # the same rows one token on: no Python
                                                      # per request, a few numpy ops
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ...batch import PACKED, ForwardBatch, unpacked_batch
from ...errors import ConfigError
from ..kv_cache import SCRATCH_PAGE


def block_table(pages: Sequence[Sequence[int]], max_pages: int) -> np.ndarray:
    """``[bs, max_pages]`` int64: each request's pages, then scratch page 0; the page count of
    each is in ``lens`` of ``decode_rows``' checks (a row of zeros past it)."""
    table = np.full((len(pages), max_pages), SCRATCH_PAGE, dtype=np.int64)
    for i, pg in enumerate(pages):
        if len(pg) > max_pages:
            raise ConfigError(f"{len(pg)} pages exceed max_pages_per_request={max_pages}.")
        table[i, : len(pg)] = pg
    return table


def decode_rows(
    tokens: Sequence[int],
    positions: Sequence[int],
    table: np.ndarray,  # [bs, max_pages] int64 from block_table
    page_counts: Sequence[int],  # pages each request owns
    page_size: int,
    out: np.ndarray | None = None,  # [bs, PACKED.width(max_pages)] int64, written in place
) -> np.ndarray:
    """The packed rows: ``tokens[i]`` fed at ``positions[i]``, its K/V at the slot of that
    position in its pages, ``seq_len = position + 1``, then the block table."""
    bs, max_pages = table.shape
    pos = np.asarray(positions, dtype=np.int64).reshape(bs)
    if bs and pos.min() < 0:
        raise ConfigError(f"token position {int(pos.min())} is negative; positions start at 0.")
    page = pos // page_size
    past = np.flatnonzero(page >= np.asarray(page_counts, dtype=np.int64))
    if past.size:
        i = int(past[0])
        raise ConfigError(
            f"token position {int(pos[i])} is past the {page_counts[i]} pages reserved for the "
            "request."
        )
    rows = np.empty((bs, PACKED.width(max_pages)), dtype=np.int64) if out is None else out
    col = {name: i for i, name in enumerate(PACKED.fields)}
    rows[:, col["input_ids"]] = tokens
    rows[:, col["positions"]] = pos
    rows[:, col["out_cache_loc"]] = table[np.arange(bs), page] * page_size + pos % page_size
    rows[:, col["seq_lens"]] = pos + 1
    rows[:, PACKED.table_col :] = table
    return rows


_POS, _SLOT, _SEQ = (PACKED.fields.index(f) for f in ("positions", "out_cache_loc", "seq_lens"))
assert (_SLOT, _SEQ) == (_POS + 1, _POS + 2), "DecodeRows.advance adds 1 to three adjacent columns"


class DecodeRows:
    """The host rows of a decode batch, kept from one step to the next: ``[max_bs, width]``
    int64 rows and their ``seq_lens`` (int32), with one ``ForwardBatch`` of views per batch
    size, built once. A step of the same requests as the last, each one token further
    (``advance``), moves positions, KV lengths and slots in place; nothing else changes (its
    input ids read the feed's rows, the block table is the same).

    The batches are host rows only (``packed_cpu``; ``packed`` too with ``packed_too``, for a
    runner on the CPU that copies them from there): the caller must not rewrite them while a
    copy of the last ones may still be in flight (a staged runner copies them into its own
    pinned slot at replay; a CPU runner copies them at once)."""

    def __init__(
        self, max_bs: int, max_pages: int, page_size: int, *, packed_too: bool = False
    ) -> None:
        self.page_size = page_size
        self.packed_too = packed_too
        self.host = torch.zeros(max_bs, PACKED.width(max_pages), dtype=torch.int64)
        self.seq_lens = torch.ones(max_bs, dtype=torch.int32)
        self.rows, self._seq = self.host.numpy(), self.seq_lens.numpy()
        self._batches: dict[int, ForwardBatch] = {}
        self._counts = np.zeros(max_bs, dtype=np.int64)  # pages each row's request owns
        self._arange = np.arange(max_bs)
        self.bs = 0  # rows written by the last fill or advance
        self.max_seq_len = 0
        self._headroom = 0  # advances before a row would pass the pages its request owns
        self._in_page = 0  # advances before a row enters a new page (its slot from the table)

    @property
    def max_bs(self) -> int:
        return self.host.shape[0]

    def fill(
        self,
        tokens: Sequence[int],
        positions: Sequence[int],
        table: np.ndarray,
        page_counts: Sequence[int],
    ) -> ForwardBatch:
        """Rows ``[:bs]`` written whole (``decode_rows``, its checks); their batch."""
        bs = len(tokens)
        width = PACKED.table_col + table.shape[1]
        rows = self.rows[:bs, :width]
        decode_rows(tokens, positions, table, page_counts, self.page_size, out=rows)
        self._counts[:bs] = page_counts
        ps, pos = self.page_size, rows[:, _POS]
        # steps until a row passes its pages, and until a row enters a new page
        self._headroom = int((self._counts[:bs] * ps - 1 - pos).min()) if bs else 0
        self._in_page = int((ps - 1 - pos % ps).min()) if bs else 0
        return self._done(bs)

    def advance(self, bs: int) -> ForwardBatch:
        """Rows ``[:bs]`` as the last step left them, each one position further: positions, KV
        lengths and slots plus one in one numpy op (the three columns are adjacent), the slots
        of a row entering a new page from its block table. ``ConfigError`` if a row would pass
        the pages its request owns (nothing is changed then)."""
        if bs != self.bs:
            raise ConfigError(f"advance of {bs} rows after a step of {self.bs}; fill them first.")
        rows = self.rows[:bs]
        if self._headroom < 1:
            pos = rows[:, _POS] + 1
            i = int(np.flatnonzero(pos // self.page_size >= self._counts[:bs])[0])
            raise ConfigError(
                f"token position {int(pos[i])} is past the {self._counts[i]} pages reserved for "
                "the request."
            )
        rows[:, _POS : _SEQ + 1] += 1
        self._headroom -= 1
        if self._in_page > 0:  # every row stays in its page: the slot is the next one
            self._in_page -= 1
        else:
            self._slots(bs)
        self._seq[:bs] = rows[:, _SEQ]
        self.max_seq_len += 1
        batch = self._batches[bs]  # built by the fill before
        batch.max_seq_len = self.max_seq_len
        return batch

    def _slots(self, bs: int) -> None:
        """Each row's slot from its position and block table; how many steps every row stays
        in its page."""
        rows, ps = self.rows[:bs], self.page_size
        pos = rows[:, _POS]
        offset = pos % ps
        rows[:, _SLOT] = rows[self._arange[:bs], PACKED.table_col + pos // ps] * ps + offset
        self._in_page = int((ps - 1 - offset).min())

    def _done(self, bs: int) -> ForwardBatch:
        seq = self.rows[:bs, _SEQ]
        self._seq[:bs] = seq
        self.bs = bs
        self.max_seq_len = int(seq.max()) if bs else 0
        batch = self._batches.get(bs)
        if batch is None:
            host = self.host[:bs]
            batch = self._batches[bs] = unpacked_batch(host, self.seq_lens[:bs], copy=False)
            batch.packed_cpu = host
            batch.packed = host if self.packed_too else None
            batch.values_checked = True  # the engine's own ids, lengths and pages
        batch.max_seq_len = self.max_seq_len
        return batch


__all__ = ["DecodeRows", "block_table", "decode_rows"]
