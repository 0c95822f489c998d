"""`stepgraph generate` of a local checkpoint directory with a tokenizer prints the decoded text
(and under ``--json`` the ids with the text); without a tokenizer it prints token ids. The
checkpoint (a tiny random Llama and a word-level tokenizer) is written here; nothing downloads."""

from __future__ import annotations

import json

import pytest

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from stepgraph.cli import main  # noqa: E402
from tests.text_checkpoints import write_text_checkpoint  # noqa: E402

VOCAB = 64
SPECIAL = ["<pad>", "<s>", "</s>", "<unk>"]
WORDS = SPECIAL + [f"w{i}" for i in range(VOCAB - len(SPECIAL))]


def _write_checkpoint(path, tokenizer: bool = True) -> None:
    write_text_checkpoint(path, WORDS, num_layers=1, max_positions=128, tokenizer=tokenizer)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("ckpt-text")
    _write_checkpoint(path)
    return str(path)


def _run(capsys, argv) -> str:
    assert main(["generate", "--device", "cpu", "--max-new-tokens", "5", *argv]) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("source", [["--prompt", "w1 w2 w3"], ["--prompt-ids", "5,6,7"]])
def test_generate_with_a_tokenizer_prints_the_text_and_json_has_ids_and_text(capsys, ckpt, source):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ckpt, local_files_only=True)
    got = json.loads(_run(capsys, ["--model", ckpt, *source, "--json"]))
    ids = got["outputs"][0]
    assert len(ids) == 5 and all(isinstance(t, int) for t in ids)
    assert got["texts"] == [tok.decode(ids, skip_special_tokens=True)]
    assert got["texts"][0].split()[0].startswith("w")  # words, not numbers
    line = _run(capsys, ["--model", ckpt, *source]).strip()
    assert line == f"[0] {got['texts'][0]}"


def test_generate_without_a_tokenizer_prints_ids(capsys, tmp_path):
    _write_checkpoint(tmp_path, tokenizer=False)
    got = json.loads(_run(capsys, ["--model", str(tmp_path), "--prompt-ids", "5,6", "--json"]))
    assert set(got) == {"outputs"}
    line = _run(capsys, ["--model", str(tmp_path), "--prompt-ids", "5,6"]).strip()
    assert line == "[0] " + " ".join(map(str, got["outputs"][0]))


def test_generate_of_a_preset_prints_ids(capsys):
    got = json.loads(_run(capsys, ["--model", "tiny", "--prompt-ids", "5,6", "--json"]))
    assert set(got) == {"outputs"}
