"""The README's quickstart runs as written (on the CPU stand-in, with the toy model)."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from stepgraph.toy_model import ToyModelRunner

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_quickstart_runs():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README lost its python quickstart"
    model_runner = ToyModelRunner(num_pages=160, seed=1)
    batch = model_runner.random_batch(3, torch.Generator().manual_seed(2))
    want, _ = model_runner.eager_reference(batch)
    scope = {"model_runner": model_runner, "batch": batch}
    exec(compile(blocks[0], "README.md", "exec"), scope)
    torch.testing.assert_close(scope["logits"], want, rtol=1e-5, atol=1e-5)
    assert torch.equal(scope["next_ids"], want.argmax(-1))
