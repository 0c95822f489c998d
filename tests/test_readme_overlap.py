"""The README's overlapped decode loop runs as written (toy model, CPU stand-in), and the ids it
lands, one step late, are those of a synchronous eager loop over the same requests."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from stepgraph import ForwardBatch
from stepgraph.toy_model import ToyModelRunner

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def test_overlapped_loop_snippet_lands_the_synchronous_ids():
    (snippet,) = [
        b for b in re.findall(r"```python\n(.*?)```", README, flags=re.S) if "in_flight" in b
    ]
    scope: dict = {}
    exec(compile(snippet, "README.md", "exec"), scope)
    mr = ToyModelRunner(num_pages=160, device="cpu", seed=1)
    batch = mr.random_batch(4, torch.Generator().manual_seed(3), max_len=24)
    want = []
    for _ in range(6):
        ids = mr.forward(batch).argmax(-1)
        want.append(ids.tolist())
        pos = batch.positions + 1
        page = batch.block_table.gather(1, (pos // mr.page_size)[:, None])[:, 0].long()
        slot = page * mr.page_size + pos % mr.page_size
        batch = ForwardBatch(
            ids, pos, batch.seq_lens + 1, batch.seq_lens_cpu + 1, batch.block_table, slot
        )
    assert scope["landed"] == want[:5]  # six steps launched, five landed
    assert len({tuple(w) for w in want}) > 1  # the ids change from step to step
    assert scope["runner"].stats.replays == 6
