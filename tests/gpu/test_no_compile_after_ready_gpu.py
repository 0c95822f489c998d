"""On a real GPU, nothing compiles once an engine is warm: after ``warm_up`` (and the capture
of its decode graphs), a workload of prompt lengths it never saw, packed and alone, greedy and
sampled, compiles no Triton kernel variant, by both counts (``runner/compiles.py``: the compile
hook and the kernels' caches), and captures no graph. A failure names the kernels that
compiled. Also on the GPU: the engine's host time by phase against the stand-in step (the
benchmark runs, each phase is reported).

Random weights, two layers of the llama-3.2-1b shapes, bf16, exact mode (the default)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from stepgraph.engine import Engine
from stepgraph.engine.warm import warm_lengths, warm_up
from stepgraph.model import ModelRunner
from stepgraph.runner.compiles import CompileCounter, kernel_variants, new_variants

pytestmark = pytest.mark.cuda

ROOT = Path(__file__).resolve().parents[2]


def _engine(mode: str) -> Engine:
    mr = ModelRunner.from_preset(
        "llama-3.2-1b", "cuda", torch.bfloat16, 3, num_layers=2, max_bs=16, max_context_len=1024
    )
    return Engine(mr, mode, max_prefill_tokens=256)


@pytest.mark.parametrize("mode", ["exact", "graph"])
def test_no_compile_and_no_capture_after_warm_up(mode):
    engine = _engine(mode)
    warm_up(engine)
    captured = engine.runner.stats.capture.buckets[:]
    prefill_captured = engine.prefiller.stats.capture.buckets[:]  # at build: the default
    assert prefill_captured and engine.prefill == "graph"
    seen = set(warm_lengths(1024, 256))
    lengths = [n for n in (5, 12, 23, 40, 77, 100, 150, 200, 300, 333, 500, 700) if n not in seen]
    prompts = [[1 + (i + k) % 300 for k in range(n)] for i, n in enumerate(lengths)]
    before = kernel_variants()
    with CompileCounter() as compiled:
        for p in prompts:  # alone: the first request of a new length
            engine.generate([p], 4, ignore_eos=True)
        engine.generate(prompts[:6], 5, ignore_eos=True)  # packed, decoded together
        engine.generate(prompts[6:], 3, temperature=0.8, top_k=40, seed=1, ignore_eos=True)
    grown = new_variants(before, kernel_variants())
    assert not compiled.names, f"compiled after warm_up: {dict(compiled.names)}"
    assert not grown, f"new kernel variants after warm_up: {grown}"
    assert engine.runner.stats.capture.buckets == captured  # no capture either
    assert engine.prefiller.stats.capture.buckets == prefill_captured
    engine.shutdown()


def test_engine_host_benchmark_runs_on_the_gpu(tmp_path):
    spec = importlib.util.spec_from_file_location(
        "engine_host", ROOT / "benchmarks" / "engine_host.py"
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    res = bench.main(["--batch-sizes", "1,64", "--steps", "50"])
    assert res["device"].startswith("cuda")
    for bs, row in res["bs"].items():
        assert row["decode_rows_seen"] == int(bs) and row["total"] > 0
