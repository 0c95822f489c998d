"""`stepgraph bench` refuses a flag of one mode given to another, in one line naming the flag
and the mode it needs (exit 2), before any work: the ``--serve`` flags without ``--serve``, the
decode bench's flags with ``--prefill``, ``--threads`` on CUDA, ``--peer-points`` on the CPU.
"Given" means given on the command line, even at its default value."""

from __future__ import annotations

import pytest
import torch

from stepgraph.cli import main

from .guards import time_limit

BENCH = ["bench", "--device", "cpu"]

SERVE_ONLY = [
    ["--num-requests", "5"],
    ["--num-requests", "64"],  # the default value, given: still refused
    ["--input-len", "32"],
    ["--output-len", "4"],
    ["--range-ratio", "0.5"],
    ["--request-rate", "2"],
    ["--seed", "0"],
    ["--max-running", "4"],
    ["--max-prefill-tokens", "512"],
    ["--max-prefill-tokens-with-decode", "0"],
    ["--engine-prefill", "piecewise"],
    ["--peers", "none"],
    ["--latency"],
]

DECODE_ONLY = [
    ["--modes", "eager"],
    ["--plot", "x.png"],
    ["--batch-sizes", "2"],
    ["--contexts", "16"],
    ["--peer-points", "small"],
    ["--tp", "2"],
    ["--kernels", "reference"],
]


def _one_line(capsys, argv) -> str:
    with time_limit(30):
        assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and captured.out == "", captured
    return lines[0]


@pytest.mark.parametrize("flag", SERVE_ONLY, ids=lambda f: f[0])
@pytest.mark.parametrize("mode", [[], ["--prefill"]], ids=["decode", "prefill"])
def test_serve_flags_without_serve_are_refused(capsys, flag, mode):
    line = _one_line(capsys, [*BENCH, *mode, *flag])
    assert f"{flag[0]} applies only with --serve" in line, line


@pytest.mark.parametrize("flag", DECODE_ONLY, ids=lambda f: f[0])
def test_decode_flags_with_prefill_are_refused(capsys, tmp_path, flag):
    flag = [str(tmp_path / f) if f.endswith(".png") else f for f in flag]
    line = _one_line(capsys, [*BENCH, "--prefill", *flag])
    assert f"{flag[0]} does not apply to --prefill" in line, line


def test_peer_points_on_the_cpu_is_refused(capsys):
    line = _one_line(capsys, [*BENCH, "--peer-points", "all"])
    assert "--peer-points applies only on CUDA" in line


def test_peer_points_takes_only_small_or_all(capsys):
    line = _one_line(capsys, ["bench", "--peer-points", "some"])
    assert "argument --peer-points" in line and "'small', 'all'" in line


def test_threads_on_cuda_is_refused(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    line = _one_line(capsys, ["bench", "--device", "cuda", "--threads", "2"])
    assert "--threads applies only with --device cpu" in line


def test_serve_flags_with_serve_are_honoured(capsys, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    argv = [*BENCH, "--serve", "--num-requests", "3", "--input-len", "8", "--output-len", "3"]
    try:
        with time_limit(120):
            assert main([*argv, "--range-ratio", "0", "--iters", "1"]) == 0
    finally:
        torch.set_num_threads(before)
    out = capsys.readouterr().out
    assert "workload: 3 requests, prompts 8-8 tokens" in out and "3 new tokens each" in out
