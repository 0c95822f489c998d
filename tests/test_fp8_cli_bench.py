"""``--quantization fp8`` on the command line (generate, check, serve's spec; refusals in one
line, exit 2) and the bench's FP8 pieces on the CPU: the bytes a step reads, the fidelity
figures (KL, top-1) and a row's own floor in the table."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from stepgraph.bench.fidelity import Fidelity, compare, kl_top1, mean_fidelity, overall
from stepgraph.bench.floor import Bandwidth
from stepgraph.bench.main import check_quantization_args
from stepgraph.bench.report import Row, format_table
from stepgraph.bench.workload import Point, fill_kv_random, weight_bytes
from stepgraph.cli import build_parser, main
from stepgraph.cli_args import UsageError
from stepgraph.model import ModelRunner
from stepgraph.model.fp8_linear import fp8_modules
from stepgraph.model.launch import build_model_runner

from .guards import time_limit

GEN = ["generate", "--model", "tiny", "--device", "cpu", "--max-new-tokens", "4"]


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


@pytest.mark.parametrize("quant", ["fp8", "fp8-block"])
def test_generate_takes_quantization_fp8_and_refuses_others(capsys, quant):
    with time_limit(60):
        assert main([*GEN, "--prompt-ids", "1,2,3", "--quantization", quant, "--json"]) == 0
    fp8 = json.loads(capsys.readouterr().out)["outputs"]
    assert len(fp8[0]) == 4
    assert main([*GEN, "--prompt-ids", "1,2,3", "--quantization", "int4"]) == 2
    line = _one_error_line(capsys)
    assert "--quantization" in line and "'int4'" in line and "fp8" in line


def test_every_model_command_has_the_flag():
    """``info`` too: it prints the FP8 step's plan (tests/test_kernel_plan.py)."""
    parser = build_parser()
    for argv in (
        ["generate", "--prompt-ids", "1"],
        ["check", "--model", "tiny"],
        ["bench"],
        ["serve", "--model", "tiny"],
        ["info", "--model", "tiny"],
    ):
        for quant in ("fp8", "fp8-block"):
            assert parser.parse_args([*argv, "--quantization", quant]).quantization == quant
        assert parser.parse_args(argv).quantization is None
    with pytest.raises(UsageError, match="invalid choice: 'int4'"):
        parser.parse_args(["info", "--quantization", "int4"])


def test_serve_spec_carries_quantization():
    from stepgraph.serve.cli import engine_spec

    args = build_parser().parse_args(
        ["serve", "--model", "tiny", "--quantization", "fp8", "--device", "cpu"]
    )
    assert engine_spec(args, "cpu", "float32", 64).quantization == "fp8"


@pytest.mark.parametrize("quant", ["fp8", "fp8-block"])
def test_check_runs_with_fp8_weights(capsys, quant):
    with time_limit(120):
        rc = main(
            [
                "check",
                "--model",
                "tiny",
                "--device",
                "cpu",
                "--quantization",
                quant,
                "--trials",
                "2",
                "--max-bs",
                "2",
            ]
        )
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "FP8 weights" in out.splitlines()[0]


@pytest.mark.parametrize(
    "extra",
    [
        ["--device", "cpu"],
        ["--device", "cuda", "--prefill"],
        ["--device", "cuda", "--tp", "2"],
        ["--device", "cuda", "--serve", "--workload", "shared-prefix"],
    ],
)
def test_bench_refuses_fp8_where_it_cannot_run_it(extra):
    args = build_parser().parse_args(["bench", "--quantization", "fp8", *extra])
    with pytest.raises(UsageError, match="--quantization fp8") as e:
        check_quantization_args(args)
    assert "\n" not in str(e.value)
    args = build_parser().parse_args(["bench", *extra])
    assert check_quantization_args(args) is None


def test_bench_takes_fp8_with_serve_on_either_device():
    for device in ("cpu", "cuda"):
        for extra in ([], ["--workload", "random"]):
            args = build_parser().parse_args(
                ["bench", "--serve", "--device", device, "--quantization", "fp8", *extra]
            )
            assert check_quantization_args(args) == "fp8"


def test_tensor_parallel_refuses_fp8_before_any_group():
    from stepgraph.errors import ConfigError

    with pytest.raises(ConfigError, match="tensor parallelism is not supported"):
        build_model_runner("tiny", "cpu", torch.float32, tp=2, quantization="fp8")


def test_weight_bytes_count_e4m3_data_scales_and_the_head():
    plain = ModelRunner.from_preset("tiny", "cpu", torch.bfloat16, max_context_len=64)
    fp8 = ModelRunner.from_preset(
        "tiny", "cpu", torch.bfloat16, quantization="fp8", max_context_len=64
    )
    mods = fp8_modules(fp8.model)
    proj = sum(m.weight.numel() for m in mods.values())  # elements of the projections
    scales = sum(m.weight_scale.numel() for m in mods.values())
    assert weight_bytes(fp8) == weight_bytes(plain) - 2 * proj + proj + 4 * scales
    assert weight_bytes(fp8) < 0.75 * weight_bytes(plain)


def test_fidelity_figures():
    x = torch.randn(3, 50)
    kl, top = kl_top1(x, x)
    assert torch.equal(kl, torch.zeros(3, dtype=torch.float64)) and top.all()
    y = x.clone()
    y[0, x[0].argmax()] -= 100.0  # row 0's argmax moves
    kl, top = kl_top1(x, y)
    assert kl[0] > 0 and kl[1] == 0 and top.tolist() == [False, True, True]
    f = mean_fidelity([(kl, top)])
    assert f.rows == 3 and f.top1 == pytest.approx(2 / 3) and f.kl == pytest.approx(kl.mean())
    both = overall({Point(1, 8): Fidelity(1.0, 1.0, 1), Point(3, 8): Fidelity(0.0, 0.0, 3)})
    assert (both.kl, both.top1, both.rows) == (0.25, 0.25, 4)
    assert overall({}).rows == 0


def test_compare_on_the_same_weights_in_fp8():
    kw = dict(max_bs=2, max_context_len=64, page_size=16)
    ref = ModelRunner.from_preset("tiny", "cpu", torch.float32, **kw)
    fp8 = ModelRunner.from_preset("tiny", "cpu", torch.float32, quantization="fp8", **kw)
    for mr in (ref, fp8):
        fill_kv_random(mr)
    points = [Point(1, 20), Point(2, 40)]
    same = compare(ref, ref, points)
    assert all(f.kl == 0 and f.top1 == 1 for f in same.values())
    fid = compare(ref, fp8, points)
    assert [f.rows for f in fid.values()] == [1, 2]
    assert all(0 < f.kl < 0.05 for f in fid.values())  # close, not equal


def test_a_row_with_its_own_floor():
    bw = Bandwidth(1000.0, None, "GPU")
    rows = [
        Row("graph", 1, 512, 1.0, 1000.0, 0.5),
        Row("graph fp8", 1, 512, 0.6, 1666.0, 0.5, note="KL 1e-3, top-1 99%", floor_ms=0.3),
    ]
    lines = format_table(rows, {(1, 512): 0.5}, bw).splitlines()
    fp8 = next(x for x in lines if x.startswith("graph fp8"))
    plain = next(x for x in lines if x.startswith("graph "))
    assert "   0.300" in fp8 and "top-1 99%" in fp8
    assert "   0.500" in plain


def test_spec_args_namespace():
    # the spec's new field has a default: an older caller's positional spec still builds
    from stepgraph.serve.engine_proc import EngineSpec

    assert EngineSpec("tiny").quantization is None
    assert isinstance(build_parser().parse_args(["bench"]), argparse.Namespace)
