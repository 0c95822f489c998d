"""The captured step's one-launch inputs kernel (``runner/graph_inputs.py``) under the Triton
interpreter, against the torch ops it replaces: the staged slot chosen by the copy count, the
fields and the block table (more pages than one inner block, so its loop runs three times),
ids read from the feed, the count bumped once per replay and the ticket left at 0; poisoned
outputs, fresh random rows."""

from __future__ import annotations

import pytest
import torch

from stepgraph.batch import PACKED
from stepgraph.runner.feed import feed_id
from stepgraph.runner.graph_inputs import BLOCK_P, captured_inputs
from stepgraph.runner.input_buffers import GraphInputBuffers, pad_row
from stepgraph.runner.staging import PinnedStaging

MAX_BS, PAGES, FEED = 24, 2 * BLOCK_P + 5, 9
CPU = torch.device("cpu")


def _rows(g: torch.Generator, n: int, fed: bool) -> torch.Tensor:
    rows = torch.randint(1, 2**20, (n, PACKED.width(PAGES)), generator=g)
    if fed:  # every third row reads the feed, its last row included
        ids = PACKED.column(rows, "input_ids")
        ids[::3] = torch.tensor([feed_id(j % FEED) for j in range(0, n, 3)])
        ids[1] = feed_id(FEED - 1)
    return rows


def _setup(staged):
    bufs = GraphInputBuffers.allocate(MAX_BS, PAGES, CPU, 1)
    copy = staged == "copy"  # DecodeTuning.staging_copy, as the graph runner hands it on
    staging = PinnedStaging(pad_row(PAGES, 1, CPU), MAX_BS, CPU, copy) if staged else None
    return bufs, staging


def _poison(bufs: GraphInputBuffers) -> None:
    for t in (bufs.input_ids, bufs.positions, bufs.out_cache_loc, bufs.seq_lens, bufs.block_table):
        t.fill_(-7)


def _fields(bufs: GraphInputBuffers, n: int) -> list[torch.Tensor]:
    return [
        t[:n].clone()
        for t in (
            bufs.input_ids,
            bufs.positions,
            bufs.out_cache_loc,
            bufs.seq_lens,
            bufs.block_table,
        )
    ]


@pytest.mark.parametrize("staged", [False, "host", "copy"])
@pytest.mark.parametrize("fed", [False, True])
@pytest.mark.parametrize("bucket", [1, 17])
def test_one_launch_equals_the_torch_ops(staged, fed, bucket, monkeypatch):
    """``staged="host"``: the kernel reads the slot from the host rows (the default), and the
    device copy is poisoned, so reading it would fail; ``"copy"``: ``device_copy`` (the
    tuning's ``staging_copy``),
    the slots copied to the device first (the host rows then poisoned after the copy would
    not matter, so the torch ops' result is the check)."""
    g = torch.Generator().manual_seed(bucket * 4 + 2 * bool(staged) + fed + 8 * (staged == "copy"))
    feed = torch.randint(0, 2**20, (FEED,), generator=g) if fed else None
    (kb, ks), (tb, ts) = _setup(staged), _setup(staged)
    for replay in range(3):  # slots 0, 1, 0 when staged
        rows = [_rows(g, MAX_BS, fed) for _ in range(2)]
        for bufs, st in ((kb, ks), (tb, ts)):
            if st is not None:
                st.host[:, :, :] = torch.stack(rows, 1)  # [max_bs, slot, width]
            else:
                bufs.packed[:] = rows[0]
            _poison(bufs)
        if ks is not None:
            ks.device_rows.fill_(-9)  # "host": never read; "copy": overwritten by the copy
        captured_inputs(kb, bucket, ks, feed, unpack=True, kernel=True)
        captured_inputs(tb, bucket, ts, feed, unpack=True, kernel=False)
        for got, want in zip(_fields(kb, bucket), _fields(tb, bucket)):
            assert torch.equal(got, want), f"replay {replay}"
        src = rows[replay % 2] if staged else rows[0]
        ids = PACKED.column(src[:bucket], "input_ids").clone()
        if fed:
            ids[ids < 0] = feed[-1 - ids[ids < 0]]
        assert torch.equal(kb.input_ids[:bucket], ids)  # the slot of this replay, fed
        assert torch.equal(kb.block_table[:bucket], PACKED.table(src[:bucket]).to(torch.int32))
        assert (kb.input_ids[bucket:] == -7).all()  # rows past the bucket untouched
        if staged:
            assert int(ks.copies) == int(ts.copies) == replay + 1
            assert int(ks.parity) == int(ts.parity) == (replay + 1) % 2
            assert int(ks.copied) == replay + 1 and int(ks.ticket) == 0
