"""A small soak on the GPU (benchmarks/soak.py's pieces on the tiny preset): thousands of
tokens through an exact-mode engine with requests joining and leaving; no page leaks, no
growth of allocated GPU memory, and the last requests equal an eager rerun of their segment.
The full soak (llama-3.2-1b, 100k tokens) is `python benchmarks/soak.py`; scripts/gpu-check
runs its --short version."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from stepgraph.engine import Engine
from stepgraph.model import ModelRunner
from stepgraph.runner import RunnerConfig

pytestmark = pytest.mark.cuda

_SPEC = importlib.util.spec_from_file_location(
    "soak", Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"
)
soak = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(soak)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_soak_tiny_exact_leaks_nothing_and_matches_eager(dtype):
    max_bs, context = 8, 512
    mr = ModelRunner.from_preset("tiny", "cuda", dtype, 0, max_bs=max_bs, max_context_len=context)
    config = RunnerConfig(max_bs=max_bs, show_progress=False)
    engine = Engine(mr, "exact", config, max_running=max_bs)
    work = soak.Workload(1, mr.config.vocab_size, context // 2, 64, max_bs)
    soak.run_tokens(engine, work, 1500)  # warm-up
    before = soak.memory(engine)
    soak.run_tokens(engine, work, 3000)
    while engine.has_unfinished:
        engine.step()
        engine.finished.clear()
    schedule = soak.segment_schedule(work, 24)
    exact_out = soak.run_segment(engine, schedule)
    after = soak.memory(engine)
    assert engine.prefix_cache.num_available == mr.kv_cache.num_pages - 1  # free or cached
    assert after["gpu_allocated"] - before["gpu_allocated"] < soak.GPU_GROWTH_LIMIT
    assert engine.stats.eager_steps == 0 and len(engine.stats.batch_sizes) > 4
    eager_mr = ModelRunner.from_model(
        mr.model, device="cuda", dtype=dtype, max_bs=max_bs, max_context_len=context
    )
    eager_out = soak.run_segment(Engine(eager_mr, "eager", max_running=max_bs), schedule)
    assert exact_out == eager_out
