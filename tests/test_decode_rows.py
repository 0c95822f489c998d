"""The numpy decode rows equal the packed layout built one request at a time from the KV
cache's own slot and block-table functions; the engine's cached block table is rebuilt when the
batch's requests change."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stepgraph.batch import PACKED
from stepgraph.errors import ConfigError
from stepgraph.model import ModelRunner
from stepgraph.model.decode.decode_rows import block_table, decode_rows


def _mr() -> ModelRunner:
    return ModelRunner.from_preset("tiny", "cpu", torch.float32, max_bs=6, max_context_len=96)


def test_rows_equal_the_per_request_layout():
    mr, g = _mr(), torch.Generator().manual_seed(0)
    kv = mr.kv_cache
    lens = torch.randint(1, 97, (6,), generator=g).tolist()
    pages = [kv.reserve(n) for n in lens]
    pos = [int(torch.randint(0, n, (1,), generator=g)) for n in lens]
    toks = torch.randint(0, 512, (6,), generator=g).tolist()
    want = [
        PACKED.row(
            input_ids=t,
            positions=p,
            out_cache_loc=kv.slot(pg, p),
            seq_lens=p + 1,
            block_table=kv.block_table_row(pg),
        )
        for t, p, pg in zip(toks, pos, pages)
    ]
    table = block_table(pages, mr.max_pages_per_request)
    got = decode_rows(toks, pos, table, [len(p) for p in pages], kv.page_size)
    assert got.tolist() == want
    batch = mr.decode_batch(toks, pos, pages)
    assert batch.packed_cpu.tolist() == want and batch.max_seq_len == max(pos) + 1


def test_limits_at_and_past_the_reserved_pages():
    mr = _mr()
    pages = [mr.kv_cache.reserve(32)]  # two pages of 16
    table = block_table(pages, mr.max_pages_per_request)
    decode_rows([1], [31], table, [2], 16)  # the last reserved slot
    with pytest.raises(ConfigError, match="position 32 is past the 2 pages"):
        decode_rows([1], [32], table, [2], 16)
    with pytest.raises(ConfigError, match="negative"):
        decode_rows([1], [-1], table, [2], 16)
    with pytest.raises(ConfigError, match="exceed max_pages_per_request"):
        block_table([list(range(1, mr.max_pages_per_request + 2))], mr.max_pages_per_request)
    assert block_table([[3, 4]], 4).tolist() == [[3, 4, 0, 0]]
    assert isinstance(table, np.ndarray)


def _kept_rows(page_size: int = 4):
    """Five requests at mixed offsets in their pages (one a page short of its last slot)."""
    from stepgraph.model.decode.decode_rows import DecodeRows

    g = torch.Generator().manual_seed(3)
    counts = [3, 5, 2, 4, 6]
    pages = [(torch.randperm(40, generator=g)[:n] + 1).tolist() for n in counts]
    pos = [1, 6, 3, 9, 0]
    rows = DecodeRows(8, 6, page_size)
    table = block_table(pages, 6)
    return rows, table, pages, counts, pos


def test_kept_rows_advance_as_rows_built_whole():
    rows, table, pages, counts, pos = _kept_rows()
    toks = [-1, -2, -3, -4, -5]
    batch = rows.fill(toks, pos, table, counts)
    for step in range(1, 3 * 4 + 1):  # past several page boundaries of every row
        if min(c * 4 - 1 - p - step + 1 for c, p in zip(counts, pos)) < 1:
            break
        batch = rows.advance(5)
        now = [p + step for p in pos]
        want = decode_rows(toks, now, table, counts, 4)
        np.testing.assert_array_equal(batch.packed_cpu.numpy(), want)
        np.testing.assert_array_equal(batch.seq_lens_cpu.numpy(), np.array(now) + 1)
        assert batch.max_seq_len == max(now) + 1 and batch.values_checked
    assert step > 4  # it crossed a page boundary


def test_kept_rows_stop_at_the_last_reserved_slot():
    rows, table, pages, counts, pos = _kept_rows()
    rows.fill([-1] * 5, pos, table, counts)
    room = min(c * 4 - 1 - p for c, p in zip(counts, pos))  # row 2: 2 pages, at 3: 4 steps
    assert room == 4
    for _ in range(room):  # up to the last slot of its pages: fine
        rows.advance(5)
    before = rows.rows[:5].copy()
    with pytest.raises(ConfigError, match="past the 2 pages reserved"):
        rows.advance(5)  # one past it
    np.testing.assert_array_equal(rows.rows[:5], before)  # nothing changed


def test_kept_rows_refuse_another_batch_size():
    rows, table, pages, counts, pos = _kept_rows()
    rows.fill([-1] * 5, pos, table, counts)
    with pytest.raises(ConfigError, match="advance of 4 rows after a step of 5"):
        rows.advance(4)
