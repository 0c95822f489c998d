"""`stepgraph bench` picks its device and dtype: without ``--device`` the main job runs on any
machine (the CPU stand-in where no GPU is visible, said in its first line); ``--device cuda``
without a GPU is one line, exit 2; ``--dtype`` is honoured on the CPU too."""

from __future__ import annotations

import json

import pytest
import torch

from stepgraph.cli import main

SMALL = ["--batch-sizes", "1", "--contexts", "8", "--iters", "1"]


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    yield
    torch.set_num_threads(before)


def test_no_device_flag_runs_the_cpu_stand_in_and_says_so_in_the_first_line(no_gpu, capsys):
    assert main(["bench", *SMALL]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("stepgraph bench: no GPU visible: running the CPU stand-in")
    assert "pass --device cuda to require a GPU" in out[0]
    assert out[1].startswith("stepgraph bench --device cpu: tiny, float32")


def test_an_explicit_cpu_run_has_no_fallback_note(no_gpu, capsys):
    assert main(["bench", "--device", "cpu", *SMALL]) == 0
    assert "no GPU visible" not in capsys.readouterr().out


@pytest.mark.parametrize("extra", [[], ["--serve"], ["--prefill"]])
def test_device_cuda_without_a_gpu_is_one_line(no_gpu, capsys, extra):
    assert main(["bench", "--device", "cuda", *extra]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and captured.out == "", captured
    assert lines[0].startswith("stepgraph: error: argument --device: cuda, but no CUDA GPU")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_cpu_bench_honours_dtype(no_gpu, capsys, tmp_path, dtype):
    out = tmp_path / "bench.json"
    argv = ["bench", "--device", "cpu", "--dtype", dtype, "--modes", "eager", *SMALL]
    assert main([*argv, "--json", str(out)]) == 0
    assert f"tiny, {dtype}," in capsys.readouterr().out.splitlines()[0]
    assert json.loads(out.read_text())["meta"]["dtype"] == dtype


def test_cpu_bench_default_dtype_is_float32(no_gpu, capsys, tmp_path):
    out = tmp_path / "bench.json"
    assert main(["bench", "--device", "cpu", "--modes", "eager", *SMALL, "--json", str(out)]) == 0
    assert json.loads(out.read_text())["meta"]["dtype"] == "float32"
