"""`stepgraph generate --prompt-file`: a JSON list, JSON Lines and stdin give the same tokens as
`--prompt-ids` for the same prompts; malformed files are refused with the line named."""

from __future__ import annotations

import io
import json

import pytest
import torch

from stepgraph.cli import main
from stepgraph.errors import ConfigError
from stepgraph.prompts import parse_prompt_text

BASE = ["generate", "--model", "tiny", "--device", "cpu", "--max-new-tokens", "5", "--json"]
BASE += ["--mode", "eager"]  # the prompt source is under test, not the runner


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(1, 512, (n,), generator=g).tolist() for n in (3, 17, 1, 9)]


def _outputs(capsys, *args: str) -> list[list[int]]:
    assert main([*BASE, *args]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])["outputs"]


def test_prompt_file_equals_prompt_ids(tmp_path, capsys, monkeypatch):
    prompts = _prompts()
    want = _outputs(capsys, "--prompt-ids", ";".join(",".join(map(str, p)) for p in prompts))
    assert len(want) == 4 and all(len(o) == 5 for o in want)
    assert len({tuple(o) for o in want}) > 1  # different prompts, different continuations

    as_list = tmp_path / "prompts.json"
    as_list.write_text(json.dumps(prompts))
    assert _outputs(capsys, "--prompt-file", str(as_list)) == want

    as_lines = tmp_path / "prompts.jsonl"
    as_lines.write_text("\n".join(json.dumps(p) for p in prompts) + "\n\n")
    assert _outputs(capsys, "--prompt-file", str(as_lines)) == want

    monkeypatch.setattr("sys.stdin", io.StringIO(as_lines.read_text()))
    assert _outputs(capsys, "--prompt-file", "-") == want


def test_prompt_file_formats_and_errors(tmp_path, capsys):
    assert parse_prompt_text("[[1, 2], [3]]") == [[1, 2], [3]]
    assert parse_prompt_text("[1, 2]\n[3]\n") == [[1, 2], [3]]
    assert parse_prompt_text("[4, 5, 6]") == [[4, 5, 6]]  # one JSON Lines line: one prompt
    with pytest.raises(ConfigError, match="line 2 is not JSON"):
        parse_prompt_text("[1, 2]\n[3,\n")
    with pytest.raises(ConfigError, match="line 2 is .*not a list of token ids"):
        parse_prompt_text('[1, 2]\n{"ids": [3]}\n')
    with pytest.raises(ConfigError, match="prompt 1 is"):
        parse_prompt_text('[[1, 2], ["a"]]')
    with pytest.raises(ConfigError, match="no prompts"):
        parse_prompt_text("\n\n")

    assert main([*BASE, "--prompt-file", str(tmp_path / "missing.json")]) == 2
    assert "check the path" in capsys.readouterr().err
