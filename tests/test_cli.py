"""The command line on the CPU: generate (JSON, modes agree), info, bench's CPU path and its
no-GPU message."""

from __future__ import annotations

import json

import pytest
import torch

from stepgraph.cli import main


def test_generate_json_eager_and_graph_agree(capsys):
    outs = {}
    for mode in ("eager", "graph"):
        assert (
            main(
                [
                    "generate",
                    "--model",
                    "tiny",
                    "--prompt-ids",
                    "5,9,3;4,7",
                    "--device",
                    "cpu",
                    "--max-new-tokens",
                    "6",
                    "--mode",
                    mode,
                    "--json",
                ]
            )
            == 0
        )
        outs[mode] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["outputs"]
    assert len(outs["eager"]) == 2 and all(len(o) == 6 for o in outs["eager"])
    assert outs["eager"] == outs["graph"]


def test_generate_prompt_text_needs_a_tokenizer(capsys):
    assert main(["generate", "--model", "tiny", "--prompt", "hello", "--device", "cpu"]) == 2
    assert "tokenizer" in capsys.readouterr().err


def test_info_reports_versions(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "triton" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU fallback")
def test_bench_without_gpu_runs_the_cpu_stand_in_and_says_so_first(capsys):
    assert main(["bench", "--batch-sizes", "1", "--contexts", "8", "--iters", "1"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert "no GPU visible" in first and "--device cpu" in first and "--device cuda" in first
    assert main(["bench", "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "argument --device: cuda" in err[0] and "no CUDA GPU" in err[0]


def test_bench_cpu_runs_the_pipeline(capsys):
    assert main(["bench", "--device", "cpu", "--batch-sizes", "2", "--contexts", "8"]) == 0
    assert "identical to eager: True" in capsys.readouterr().out
