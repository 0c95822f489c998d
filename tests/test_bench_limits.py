"""`stepgraph bench` limits, tested at the limit and one past it: ``--batch-sizes`` up to what
the bench takes on the device, ``--threads`` up to the machine's cores; and the line that says
why the CPU runs one thread by default names the right reason for the model."""

from __future__ import annotations

import pytest
import torch

from stepgraph.bench.args import check_bench_args, choose_device
from stepgraph.bench.constants import CPU_MAX_BS, GPU_MAX_BS
from stepgraph.bench.cpu import set_cpu_threads
from stepgraph.cli import build_parser, main
from stepgraph.cli_args import UsageError
from stepgraph.model import kv_cache
from stepgraph.model.config import PRESETS


def _checked(argv: list[str]) -> None:
    args = build_parser().parse_args(["bench", *argv])
    choose_device(args)
    check_bench_args(args)


@pytest.mark.parametrize("device,limit", [("cpu", CPU_MAX_BS), ("cuda", GPU_MAX_BS)])
def test_batch_sizes_at_the_limit_pass_and_one_past_is_refused(monkeypatch, device, limit):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kv_cache, "free_bytes", lambda device: None)  # no memory check here
    base = ["--device", device, "--contexts", "16", "--model", "tiny"]
    _checked([*base, "--batch-sizes", f"1,{limit}"])
    with pytest.raises(UsageError) as e:
        _checked([*base, "--batch-sizes", f"1,{limit + 1}"])
    text = str(e.value)
    assert text.startswith("argument --batch-sizes:") and f"at most {limit}" in text


def test_batch_sizes_far_past_the_limit_is_one_line(capsys):
    assert main(["bench", "--device", "cpu", "--batch-sizes", "100000"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.strip().splitlines()) == 1
    assert "argument --batch-sizes: 100000 rows" in captured.err


@pytest.mark.parametrize("cores", [1, 4])
def test_threads_at_the_cores_pass_and_one_past_is_refused(monkeypatch, capsys, cores):
    monkeypatch.setattr("os.cpu_count", lambda: cores)
    args = build_parser().parse_args(["bench", "--device", "cpu", "--threads", str(cores)])
    assert args.threads == cores
    assert main(["bench", "--device", "cpu", "--threads", str(cores + 1)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("stepgraph: error: argument --threads:")
    assert f"more than the {cores} cores" in err[0] and f"at most {cores}" in err[0]


@pytest.fixture
def restore_threads(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_the_one_thread_default_says_the_tiny_reason_only_for_a_tiny_model(restore_threads):
    tiny = set_cpu_threads(None, PRESETS["tiny"])
    assert "torch threads: 1 of" in tiny and "too small to split" in tiny
    for name in ("llama-3.2-1b", "qwen2.5-0.5b", "llama-3.1-8b"):
        line = set_cpu_threads(None, PRESETS[name])
        assert "too small to split" not in line and "faster on more cores" in line, name
    assert "too small to split" not in set_cpu_threads(None)  # model unknown: no tiny claim
