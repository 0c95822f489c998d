"""docs/overlapped_loop.md's decode loop runs as written (tiny preset, CPU stand-in), and the ids
it lands, one step late and the last step's after the loop, are those of a synchronous eager loop
over the same requests; it prints what it landed."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from stepgraph import ModelRunner

DOC = (Path(__file__).resolve().parents[1] / "docs" / "overlapped_loop.md").read_text()


def test_overlapped_loop_snippet_lands_the_synchronous_ids(capsys):
    (snippet,) = [
        b for b in re.findall(r"```python\n(.*?)```", DOC, flags=re.S) if "in_flight" in b
    ]
    scope: dict = {}
    exec(compile(snippet, "docs/overlapped_loop.md", "exec"), scope)
    mr = ModelRunner.from_preset("tiny", "cpu", torch.float32, seed=0, max_bs=4, max_context_len=64)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    pages = [mr.kv_cache.reserve(len(p) + 6) for p in prompts]
    ids = mr.prefill(prompts, pages).argmax(-1).tolist()
    want = []
    for step in range(6):  # eager, each step's ids read back before the next
        batch = mr.decode_batch(ids, [len(p) + step for p in prompts], pages)
        ids = mr.forward(batch).argmax(-1).tolist()
        want.append(ids)
    assert scope["landed"] == want  # six steps launched, six landed: the last one collected
    assert capsys.readouterr().out == f"6 steps landed, 3 ids each; the last: {want[-1]}\n"
    assert len({tuple(w) for w in want}) > 1  # the ids change from step to step
    assert scope["runner"].stats.replays == 6
    assert min(scope["batch"].packed_cpu[:, 0].tolist()) < 0  # fed from the device
