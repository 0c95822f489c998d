"""Whole-forward prefill graphs on the GPU: equal to eager extend in float32 (whole prompts and
chunks over a cached prefix, at a bucket edge and one past), exact equal to eager in bf16 with
the graph prefill in the engine (the default buckets' pool: test_padded_prefill_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from stepgraph.engine import Engine
from stepgraph.model import ModelRunner
from stepgraph.model.prefill.extend_batch import PrefillChunk
from stepgraph.model.prefill.graph_prefill import GraphPrefill
from stepgraph.runner import RunnerConfig
from tests.conftest import rel_err


def _mr(dtype=torch.float32, layers=2) -> ModelRunner:
    return ModelRunner.from_preset(
        "llama-3.2-1b", "cuda", dtype, 0, num_layers=layers, max_bs=8, max_context_len=2048
    )


@pytest.mark.parametrize(
    "lens, starts",
    [([512], [0]), ([300, 212], [0, 0]), ([300, 213], [0, 0]), ([1, 64, 900], [700, 17, 0])],
)
def test_graph_prefill_equals_eager_extend_in_float32(lens, starts):
    ref, mr = _mr(), _mr()
    gp = GraphPrefill(mr)
    g = torch.Generator().manual_seed(sum(lens))
    prompts = [
        torch.randint(1, 128256, (s + n,), generator=g).tolist() for s, n in zip(starts, lens)
    ]
    pages = [ref.kv_cache.reserve(len(p)) for p in prompts]
    assert [mr.kv_cache.reserve(len(p)) for p in prompts] == pages
    heads = [PrefillChunk(p[:s], 0, pg) for p, s, pg in zip(prompts, starts, pages) if s]
    if heads:
        ref.extend(heads)
        mr.extend(heads)
    chunks = [PrefillChunk(p[s:], s, pg) for p, s, pg in zip(prompts, starts, pages)]
    got = gp.extend(chunks).clone()
    assert gp.stats.graph_batches == 1
    assert rel_err(got, ref.extend(chunks)) < 1e-4
    gp.shutdown()


def test_engine_with_graph_prefill_exact_equals_eager_in_bf16():
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, 128256, (n,), generator=g).tolist() for n in (600, 5, 129, 48, 1)]
    out = {}
    for mode in ("eager", "exact"):
        config = None if mode == "eager" else RunnerConfig(max_bs=8, show_progress=False)
        engine = Engine(_mr(torch.bfloat16), mode, config, prefill="graph", max_prefill_tokens=512)
        out[mode] = engine.generate(prompts, 10, ignore_eos=True)
        assert engine.prefiller.stats.graph_batches >= 2
        engine.shutdown()
    assert out["exact"] == out["eager"]
