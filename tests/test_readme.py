"""The README runs as written, top to bottom: the CPU-torch step comes before the set-up, the
test command is CI's, and the "Wrap your own model" snippet runs alone (toy model, CPU stand-in)
and prints a stats table a person can read."""

from __future__ import annotations

import re
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def test_setup_commands_in_order_and_ci_runs_the_readme_tests():
    commands = [line.split("#")[0].strip() for b in _blocks("bash") for line in b.splitlines()]
    cpu = commands.index("pip install torch==2.13.0")
    setup = commands.index("pip install -e '.[dev]' && stepgraph bench")
    assert cpu < setup, "the CPU-torch step must come before the install command"
    test = commands[setup + 1]
    assert test == "python -m pytest -q tests"
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert ci[-1].strip() == test, "keep .ci/run's test command identical to the README's"


def _block(word: str) -> str:
    (block,) = [b for b in _blocks("python") if word in b]
    return block


def test_wrap_your_own_model_snippet_runs_as_written(capsys):
    snippet = _block("ToyModelRunner")
    scope: dict = {}
    exec(compile(snippet, "README.md", "exec"), scope)
    model_runner, batch = scope["model_runner"], scope["batch"]
    assert batch.input_ids.shape[0] == 3
    want, _ = model_runner.eager_reference(batch)  # same inputs, cache restored afterwards
    torch.testing.assert_close(scope["logits"], want, rtol=1e-5, atol=1e-5)
    assert torch.equal(scope["next_ids"], want.argmax(-1))
    assert scope["runner"].stats.replays == 1

    printed = capsys.readouterr().out.strip().splitlines()
    assert 3 <= len(printed) <= 20, printed  # a short table, not one 900-character line
    assert all(len(line) <= 100 for line in printed), printed
    text = "\n".join(printed)
    for word in ("buckets", "capture", "MiB", "replays", "fallbacks"):
        assert word in text, f"{word!r} missing from the stats table:\n{text}"


def test_engine_snippet_runs_as_written_and_equals_a_synchronous_eager_engine(capsys):
    from stepgraph import Engine, ModelRunner

    scope: dict = {}
    exec(compile(_block("Engine(mr)"), "README.md", "exec"), scope)
    outputs, engine = scope["outputs"], scope["engine"]
    assert [len(o) for o in outputs] == [8, 8]
    assert max(engine.stats.batch_sizes) <= scope["mr"].max_bs
    mr = ModelRunner.from_preset(
        "tiny", "cpu", torch.float32, seed=0, max_bs=8, max_context_len=256
    )
    want = Engine(mr, "eager", overlap=False).generate([[1, 2, 3], [4, 5, 6, 7]], 8)
    assert outputs == want
    assert str(outputs) in capsys.readouterr().out


def test_readme_is_a_front_door():
    assert len(README.splitlines()) < 160
    assert "```python notest" in README  # the openai client needs a server: shown, not run
