"""Bad command lines get one line on stderr, ``stepgraph: error: <message>`` naming the flag or
the file, exit status 2 and no traceback (``--debug`` shows it); nothing is built or written."""

from __future__ import annotations

import json

import pytest
import torch

from stepgraph.cli import main

from .guards import time_limit

GEN = ["generate", "--model", "tiny", "--device", "cpu", "--max-new-tokens", "2"]


def _assert_fails(capsys, argv, *needles):
    with time_limit(30):
        assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("stepgraph: error: "), lines[0]
    assert "Traceback" not in captured.err and captured.out == ""
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


@pytest.mark.parametrize(
    "extra,needles",
    [
        (["--prompt-ids", "1,a,3"], ["--prompt-ids", "'a'"]),
        (["--prompt-ids", "1,,2"], ["--prompt-ids", "prompt 0, item 1 is empty"]),
        (["--prompt-ids", "1,2;"], ["--prompt-ids", "prompt 1, item 0 is empty"]),
        (["--prompt-ids", "5;4,7,"], ["--prompt-ids", "prompt 1, item 2 is empty"]),
        (["--prompt-ids", "1,2", "--top-k", "0"], ["--top-k", ">= 1"]),
        (["--prompt-ids", "1,2", "--top-k", "-5"], ["--top-k"]),
        (["--prompt-ids", "1,2", "--temperature", "-1"], ["--temperature"]),
        (["--prompt-ids", "1,2", "--temperature", "nan"], ["--temperature"]),
        (["--prompt-ids", "1,2", "--tp", "0"], ["--tp"]),
        (["--prompt-ids", "1,2", "--max-new-tokens", "0"], ["--max-new-tokens"]),
        (["--prompt-ids", "1,600"], ["--prompt-ids", "outside [0, 512)"]),
        (["--prompt-ids", ",".join(["7"] * 2048)], ["--prompt-ids", "max_position_embeddings"]),
        (["--prompt-ids", "1,2", "--mode", "fast"], ["--mode"]),
    ],
)
def test_generate_bad_arguments(capsys, extra, needles):
    _assert_fails(capsys, GEN + extra, *needles)


def test_no_subcommand_is_one_line(capsys):
    _assert_fails(capsys, [], "command")


def test_model_neither_preset_nor_directory_says_both(capsys, tmp_path):
    line = _assert_fails(capsys, GEN + ["--prompt-ids", "1", "--model", str(tmp_path / "nope")])
    assert "preset" in line and "directory" in line and "tiny" in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_device_cuda_without_gpu(capsys):
    _assert_fails(
        capsys, ["generate", "--model", "tiny", "--prompt-ids", "1", "--device", "cuda"], "GPU"
    )


def test_malformed_config_json_names_the_file(capsys, tmp_path):
    (tmp_path / "config.json").write_text('{"hidden_size": 64,')
    line = _assert_fails(capsys, GEN + ["--prompt-ids", "1", "--model", str(tmp_path)])
    assert "config.json" in line and "JSON" in line


def test_truncated_safetensors_names_the_file(capsys, tmp_path):
    from safetensors.torch import save_file

    from stepgraph.model.config import get_preset

    cfg = get_preset("tiny")
    hf = {
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "vocab_size": cfg.vocab_size,
        "architectures": ["LlamaForCausalLM"],
        "max_position_embeddings": 256,
        "tie_word_embeddings": True,
    }
    (tmp_path / "config.json").write_text(json.dumps(hf))
    g = torch.Generator().manual_seed(0)
    save_file({"model.norm.weight": torch.randn(64, generator=g)}, tmp_path / "model.safetensors")
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) - 40])
    line = _assert_fails(capsys, GEN + ["--prompt-ids", "1", "--model", str(tmp_path)])
    assert "model.safetensors" in line


@pytest.mark.parametrize(
    "extra,needles",
    [
        (["--batch-sizes", "a"], ["--batch-sizes"]),
        (["--batch-sizes", "0"], ["--batch-sizes", ">= 1"]),
        (["--contexts", "8,-1"], ["--contexts"]),
        (["--tp", "0"], ["--tp"]),
        (["--json", "/nonexistent-dir-13/rows.json"], ["--json", "does not exist"]),
    ],
)
def test_bench_bad_arguments(capsys, extra, needles):
    _assert_fails(capsys, ["bench", "--device", "cpu"] + extra, *needles)


def test_debug_shows_the_traceback(capsys):
    with time_limit(30):
        assert main(GEN + ["--prompt-ids", "1", "--model", "nope", "--debug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().splitlines()[-1].startswith("stepgraph: error:")
