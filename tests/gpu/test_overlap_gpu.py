"""The overlapped loop on the GPU, where steps really run behind the host: the same tokens as
the synchronous loop in every mode (bf16, budget-only stops; float32 with stop ids), exact
still equal to eager, every page back after generate, a fault while a step is in flight."""

from __future__ import annotations

import pytest
import torch

from stepgraph.engine import Engine
from stepgraph.model import ModelRunner
from stepgraph.runner import RunnerConfig
from tests.guards import time_limit


def _mr(dtype=torch.bfloat16) -> ModelRunner:
    return ModelRunner.from_preset(
        "llama-3.2-1b", "cuda", dtype, 0, num_layers=2, max_bs=8, max_context_len=1024
    )


def _prompts(seed: int, n: int = 11):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 700, (n,), generator=g).tolist()
    return [torch.randint(1, 128256, (k,), generator=g).tolist() for k in lens]


def _engine(mode, overlap, dtype=torch.bfloat16, **kw):
    config = None if mode == "eager" else RunnerConfig(max_bs=8, show_progress=False)
    return Engine(_mr(dtype), mode, config, overlap=overlap, **kw)


@pytest.mark.parametrize("mode", ["eager", "graph", "exact"])
def test_overlap_equals_sync_in_bf16(mode):
    prompts = _prompts(1)
    kw = dict(max_running=5, max_prefill_tokens=1024)  # joins as others finish; chunked
    want = _engine(mode, False, **kw).generate(prompts, 24, ignore_eos=True)
    engine = _engine(mode, True, **kw)
    free = engine.model_runner.kv_cache.allocator.num_free
    assert engine.generate(prompts, 24, ignore_eos=True) == want
    assert engine.prefix_cache.num_available == free  # free, or cached and unreferenced
    if mode == "exact":
        assert want == _engine("eager", True, **kw).generate(prompts, 24, ignore_eos=True)


def test_overlap_equals_sync_with_stop_ids_in_float32():
    prompts = _prompts(2, 6)
    full = _engine("graph", False, torch.float32).generate(prompts, 16, ignore_eos=True)
    stops = [full[0][0], full[3][-1], full[4][7]]  # at the first token, the last, the middle
    want = _engine("graph", False, torch.float32).generate(prompts, 16, stop_ids=stops)
    assert any(len(w) < 16 for w in want)
    got = _engine("graph", True, torch.float32).generate(prompts, 16, stop_ids=stops)
    assert got == want


def test_fault_while_a_step_is_in_flight():
    engine = _engine("graph", True)
    free = engine.model_runner.kv_cache.allocator.num_free
    calls, logits = {"n": 0}, engine.decoder.logits

    def failing(*args):
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("injected decode fault")
        return logits(*args)

    engine.decoder.logits = failing
    prompts = _prompts(3, 4)
    with time_limit(60), pytest.raises(RuntimeError, match="injected"):
        engine.generate(prompts, 12, ignore_eos=True)
    assert engine.model_runner.kv_cache.allocator.num_free == free
    del engine.decoder.logits
    fresh = _engine("graph", True).generate(prompts, 12, ignore_eos=True)
    assert engine.generate(prompts, 12, ignore_eos=True) == fresh
