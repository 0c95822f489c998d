"""The flag groups every command shares (``cli_args.add_model_args``, ``add_device_args``): one
definition of ``--model``, ``--device``, ``--dtype``, ``--seed``, ``--tp``, ``--threads`` with
one check each, so a bad value is the same one-line error, exit 2, in every command; serve's
``--threads`` is capped at the cores as bench's is, and names the right reason for its default."""

from __future__ import annotations

import argparse

import pytest
import torch

from stepgraph.cli import build_parser, main
from stepgraph.cli_args import DEVICES, DTYPE_NAMES, UsageError, resolve_device, resolve_dtype

COMMANDS = {
    "bench": [],
    "generate": ["--prompt-ids", "1"],
    "serve": ["--model", "tiny"],
    "check": ["--model", "tiny"],
}


def _sub(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def _action(parser: argparse.ArgumentParser, flag: str) -> argparse.Action:
    return next(a for a in parser._actions if flag in a.option_strings)


def _one_line(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("stepgraph: error:"), captured.err
    return lines[0]


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_takes_the_same_device_and_dtype(command):
    parser = _sub(command)
    assert tuple(_action(parser, "--device").choices) == DEVICES
    assert tuple(_action(parser, "--dtype").choices) == DTYPE_NAMES
    groups = {g.title: [a.dest for a in g._group_actions] for g in parser._action_groups}
    assert groups["device"] == ["device", "dtype"] and groups["model"][0] == "model"


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("flag,value", [("--dtype", "float8"), ("--device", "tpu")])
def test_a_bad_device_or_dtype_is_one_line_in_every_command(capsys, command, flag, value):
    line = _one_line(capsys, [command, *COMMANDS[command], flag, value])
    assert f"argument {flag}: invalid choice: '{value}'" in line


@pytest.mark.parametrize("command", ["generate", "serve", "check"])
def test_a_seed_past_64_bits_is_one_line_in_every_command(capsys, command):
    line = _one_line(capsys, [command, *COMMANDS[command], "--seed", str(2**64)])
    assert line.startswith("stepgraph: error: argument --seed: must be in [0, 2**64 - 1]")


@pytest.mark.parametrize("seed", ["-1", str(2**64)])
def test_the_serving_bench_seed_is_checked_as_every_seed(capsys, seed):
    line = _one_line(capsys, ["bench", "--device", "cpu", "--serve", "--seed", seed])
    assert "argument --seed: must be in [0, 2**64 - 1]" in line


def test_the_serving_bench_seed_at_the_limit_parses():
    args = build_parser().parse_args(["bench", "--serve", "--seed", str(2**64 - 1)])
    assert args.seed == 2**64 - 1


@pytest.mark.parametrize("command", ["bench", "serve"])
@pytest.mark.parametrize("cores", [1, 4])
def test_threads_at_the_cores_pass_and_one_past_is_refused(monkeypatch, capsys, command, cores):
    monkeypatch.setattr("os.cpu_count", lambda: cores)
    argv = [command, *COMMANDS[command], "--device", "cpu", "--threads"]
    assert build_parser().parse_args([*argv, str(cores)]).threads == cores
    line = _one_line(capsys, [*argv, str(cores + 1)])
    assert line.startswith("stepgraph: error: argument --threads:")
    assert f"more than the {cores} cores" in line and f"at most {cores}" in line


def test_serve_refuses_threads_on_cuda(monkeypatch, capsys):
    pytest.importorskip("starlette")
    pytest.importorskip("uvicorn")
    pytest.importorskip("prometheus_client")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    line = _one_line(capsys, ["serve", "--model", "tiny", "--device", "cuda", "--threads", "2"])
    assert "--threads applies only with --device cpu" in line


def test_device_and_dtype_resolve_alike_everywhere(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device(None) == "cpu" and resolve_device("cpu") == "cpu"
    with pytest.raises(
        UsageError, match="^argument --device: cuda, but no CUDA GPU.*--device cpu$"
    ):
        resolve_device("cuda")
    with pytest.raises(UsageError, match="for the CPU stand-in$"):
        resolve_device("cuda", "or pass --device cpu (or no --device) for the CPU stand-in")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device(None) == "cuda"
    assert resolve_dtype(None, "cuda") == "bfloat16" and resolve_dtype(None, "cpu") == "float32"
    assert resolve_dtype("float16", "cpu") == "float16"


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


class _Stop(Exception):
    pass


@pytest.mark.parametrize("model,tiny", [("tiny", True), ("llama-3.2-1b", False)])
def test_serve_names_the_thread_reason_of_its_model(
    monkeypatch, capsys, restore_threads, model, tiny
):
    from stepgraph.model import launch
    from stepgraph.serve.engine_proc import EngineSpec

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)

    def stop(*args, **kwargs):
        raise _Stop

    monkeypatch.setattr(launch, "build_model_runner", stop)  # the line comes before the weights
    with pytest.raises(_Stop):
        EngineSpec(model, "cpu")()
    line = next(x for x in capsys.readouterr().err.splitlines() if "torch threads" in x)
    assert line.startswith("stepgraph serve: torch threads: 1 of")
    assert ("too small to split" in line) is tiny
    assert ("may run faster on more cores" in line) is not tiny
