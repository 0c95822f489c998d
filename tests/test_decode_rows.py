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
