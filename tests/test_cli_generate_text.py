"""`stepgraph generate` of a local checkpoint directory with a tokenizer prints the decoded text
(and under ``--json`` the ids with the text); without a tokenizer it prints token ids. The
checkpoint (a tiny random Llama and a word-level tokenizer) is written here; nothing downloads."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from stepgraph.cli import main  # noqa: E402

VOCAB = 64
SPECIAL = ["<pad>", "<s>", "</s>", "<unk>"]
WORDS = SPECIAL + [f"w{i}" for i in range(VOCAB - len(SPECIAL))]


def _write_checkpoint(path, tokenizer: bool = True) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    if tokenizer:
        tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tok.decoder = decoders.WordPiece(prefix="##")  # words joined by spaces
        transformers.PreTrainedTokenizerFast(
            tokenizer_object=tok,
            bos_token="<s>",
            eos_token="</s>",
            unk_token="<unk>",
            pad_token="<pad>",
        ).save_pretrained(path)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():  # larger than the default init: varied greedy tokens
            p.normal_(0, 0.3) if p.dim() > 1 else p.fill_(1.0)
    model.save_pretrained(path, safe_serialization=True)


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
