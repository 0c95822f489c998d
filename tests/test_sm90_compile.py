"""Every Triton kernel the fused decode step launches compiles for sm_90 (PTX and a cubin), on
the CPU: ``tests/sm90_compile.py`` in a process without ``TRITON_INTERPRET`` runs the step's
Python at Llama-3.2-1B's shapes at bs 1, 8, 32 and 64 with each launch turned into Triton's
compile-only warm-up, PDL and TMA on as on a Hopper GPU. The interpreter, which every other
CPU test runs the kernels under, takes what the GPU compiler refuses: the harness shows it
compiles for real by seeing a kernel with a plain-int global refused."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def result():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "sm90_compile.py")],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_harness_compiles_for_real(result):
    assert result["refused"] is True  # a plain-int global: refused, as on the GPU


def test_every_kernel_of_the_step_compiles_for_sm90(result):
    assert result["errors"] == {}
    steps = result["steps"]
    assert set(steps) == {
        "1",
        "8",
        "32",
        "64",
        "attention fold=False",
        "attention fold=True",
        "attention detached",
        "greedy tokens",
        "prefill attention",
        "inputs",
        "reference kernels",
        "fp8 gemv",
        "fp8 1",
        "fp8 8",
        "fp8 64",
    }
    for bs in ("fp8 1", "fp8 8", "fp8 64"):  # the fused projections stream e4m3 weights
        kernels = {v["kernel"] for v in steps[bs]}
        assert {"_qkv_rope_kernel", "_gate_up_silu_kernel", "_norm_gemv_kernel"} <= kernels, bs
    variants = [v for vs in steps.values() for v in vs]
    assert variants and all(v["cubin"] for v in variants)
    names = {v["kernel"] for v in variants}
    assert names >= {
        "_norm_gemv_kernel",
        "_qkv_rope_kernel",
        "_gate_up_silu_kernel",
        "_split_kv_kernel",
        "_combine_kernel",
        "_split_kv_fold_kernel",
        "_argmax_reduce_kernel",
        "_rope_kv_kernel",
        "_add_rmsnorm_kernel",
        "_fill_inputs_kernel",
        "_extend_kernel",
        "_argmax_part_kernel",
        "_argmax_keys_kernel",
        "_gemv_kernel",
        "_silu_mul_kernel",
        "_head_scale_kernel",
        "_fp8_gemv_kernel",
    }
    # the GPU's paths were the ones compiled: PDL at one row, TMA tiles from two rows
    assert any(v["pdl"] for v in steps["1"] if v["kernel"] == "_norm_gemv_kernel")
    assert any(v["tma"] for v in steps["32"] + steps["64"])
    assert any(v["kernel"] == "_add_rmsnorm_kernel" for v in steps["8"])  # embedding + norm
    # qkv: fused at 32 rows; on cuBLAS at 64, its RoPE kernel after the norm's at layer 0 and
    # on the norm handoff (the 1 / RMS from the sums of squares) at layer 1
    rope = [[v["kernel"] for v in steps[b]].count("_rope_kv_kernel") for b in ("32", "64")]
    assert rope == [0, 2]
    # the LM head: fused at 32 rows; at 64 cuBLAS on the handoff, then head_scale (no argmax_rows)
    heads = [[v["kernel"] for v in steps[b]] for b in ("32", "64")]
    assert [h.count("_head_scale_kernel") for h in heads] == [0, 1]
    assert "_argmax_part_kernel" not in heads[1]

    # PDL's trigger: at one row right after the wait (before every loop); from two rows after
    # the tensor-core K loop (mode "late"); the attention's key loop likewise, its combine and
    # the short kernels at the wait
    def places(step, kernel):
        return {v["trigger"] for v in steps[step] if v["kernel"] == kernel and v["pdl"]}

    proj = ("_norm_gemv_kernel", "_qkv_rope_kernel", "_gate_up_silu_kernel")
    assert all(places("1", k) == {"before loops"} for k in proj)
    assert all(places(b, k) == {"after mma loops"} for b in ("8", "32") for k in proj)
    assert places("64", "_gate_up_silu_kernel") == {"after mma loops"}
    assert places("64", "_head_scale_kernel") == {"before loops"}
    assert places("attention fold=False", "_split_kv_kernel") == {"after mma loops"}
    assert places("attention fold=False", "_combine_kernel") == {"before loops"}
    assert places("attention fold=True", "_split_kv_fold_kernel") == {"after mma loops"}
    assert all(
        v["first"] == "wait"
        for vs in steps.values()
        for v in vs
        if v["pdl"] and v not in steps["attention detached"]
    )
    # the detached split kernel: its trigger at its start and no wait; the early combine's
    # trigger before its wait
    split, combine = steps["attention detached"]
    assert (split["kernel"], split["pdl"], split["first"]) == ("_split_kv_kernel", False, "trigger")
    assert split["trigger"] == "before loops"
    assert (combine["kernel"], combine["pdl"], combine["first"]) == (
        "_combine_kernel",
        True,
        "trigger",
    )


def test_every_kernel_of_the_package_is_compiled(result):
    """Each ``@triton.jit`` kernel the package launches (``def _..._kernel``) is among those the
    harness compiled: a new kernel needs a launch in ``tests/sm90_compile.py``."""
    src = "\n".join(p.read_text() for p in (ROOT / "stepgraph").rglob("*.py"))
    kernels = set(re.findall(r"^@triton\.jit(?:\(.*\))?\s*\ndef (_\w+_kernel)\(", src, re.M))
    compiled = {v["kernel"] for vs in result["steps"].values() for v in vs}
    assert len(kernels) >= 16 and kernels <= compiled, sorted(kernels - compiled)
