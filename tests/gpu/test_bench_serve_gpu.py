"""`stepgraph bench --serve` on the GPU (tiny preset, seconds): the decode steps replay graphs,
timed with CUDA events beside the end-to-end step, the tokens equal a fresh engine's of the
same batch, and transformers' ``generate_batch`` peer runs on the same requests."""

from __future__ import annotations

import json

import pytest
import torch

from stepgraph.bench import serve_metrics as sm
from stepgraph.bench import workload
from stepgraph.cli import main
from stepgraph.engine import Engine

TINY = ["bench", "--serve", "--model", "tiny", "--dtype", "float32", "--num-requests", "8"]


def test_serve_on_cuda_replays_graphs_and_gives_a_fresh_engines_tokens(tmp_path):
    out = tmp_path / "serve.json"
    argv = [*TINY, "--input-len", "64", "--output-len", "16", "--peers", "none", "--latency"]
    assert main([*argv, "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    m = data["metrics"]
    assert m["completed"] == 8 and m["total_output_tokens"] == 8 * 16
    assert all(m[f"median_{k}_ms"] > 0 for k in ("ttft", "tpot", "itl", "e2el"))
    assert data["meta"]["device"] == torch.cuda.get_device_name()
    for d in data["decode"]:
        assert d["how"] == "graph replay" and d["step_ms"] > 0, d
        if d["e2e_ms"] is not None:  # end to end adds host work to the same GPU step
            assert d["e2e_over_step"] > 0.5, d
    assert data["latency"]["output_len"] == 256 and data["latency"]["tpot_ms"] > 0

    prompts = sm.random_prompts(8, 64, 7 / 9, 512, seed=0)
    context = max(max(map(len, prompts)) + 16, 512 + 256)  # the bench's KV size (--latency)
    mr = workload.build_model_runner("tiny", "cuda", torch.float32, 8, context)
    mr.set_kernels("fused")  # as the bench sets them
    engine = Engine(mr, mode="graph", max_running=8)
    try:
        want = engine.generate(prompts, 16, ignore_eos=True)  # the same batch, all at once
    finally:
        engine.shutdown()
    assert [r["tokens"] for r in data["requests"]] == want


def test_hf_continuous_batching_peer_runs_on_the_same_requests(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "serve.json"
    argv = [*TINY, "--num-requests", "4", "--input-len", "32", "--output-len", "8"]
    assert main([*argv, "--peers", "hf-cb", "--json", str(out)]) == 0
    p = json.loads(out.read_text())["peers"]["hf-cb"]
    assert "skipped" not in p, p
    assert p["seconds"] > 0 and p["speedup_wall"] > 0 and p["note"] == ""  # 8 tokens each
    assert p["metrics"]["completed"] == 4 and p["metrics"]["total_output_tokens"] == 4 * 8


def test_fp8_weights_serve_beside_the_model_dtype_with_a_fresh_engines_tokens(tmp_path):
    """``--quantization fp8`` on CUDA: the FP8 run's decode steps replay graphs (the FP8 fused
    kernels), and its tokens equal a fresh engine's over the same weights quantized on load."""
    out = tmp_path / "serve.json"
    argv = [*TINY, "--input-len", "64", "--output-len", "16", "--peers", "none"]
    assert main([*argv, "--quantization", "fp8", "--json", str(out)]) == 0
    q = json.loads(out.read_text())["quantized"]
    assert q["meta"]["weights"] == "fp8" and q["metrics"]["total_output_tokens"] == 8 * 16
    assert all(d["how"] == "graph replay" and d["step_ms"] > 0 for d in q["decode"])
    prompts = sm.random_prompts(8, 64, 7 / 9, 512, seed=0)
    context = max(map(len, prompts)) + 16
    mr = workload.build_model_runner("tiny", "cuda", torch.float32, 8, context, quantization="fp8")
    mr.set_kernels("fused")
    engine = Engine(mr, mode="graph", max_running=8)
    try:
        want = engine.generate(prompts, 16, ignore_eos=True)
    finally:
        engine.shutdown()
    assert [r["tokens"] for r in q["requests"]] == want
