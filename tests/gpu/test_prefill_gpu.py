"""Packed and chunked prefill on the GPU: the Triton extend kernel against the SDPA path in the
model, packed against one prompt at a time, chunk sizes 1, 7, 16, 17 and the budget against the
whole prompt (float32, within 1e-4), exact's tokens identical to eager's in bf16 with chunking on,
and the piecewise prefill of chunks against the eager one. (Graph mode replays the bucket's
fixed split geometry, so in bf16 it may part from eager after a near tie; exact may not.)"""

from __future__ import annotations

import pytest
import torch

from stepgraph.engine import Engine
from stepgraph.model import ModelRunner
from stepgraph.model.prefill import prefill_attention as pa
from stepgraph.model.prefill.extend_batch import PrefillChunk
from stepgraph.model.prefill.piecewise_prefill import PiecewisePrefill
from stepgraph.runner import RunnerConfig
from tests.conftest import rel_err

PRESETS = [("llama-3.2-1b", 2), ("qwen2.5-0.5b", 2), ("llama-3.1-8b", 1)]  # hd 64, 64, 128


def _mr(preset="llama-3.2-1b", dtype=torch.float32, layers=2, **kw) -> ModelRunner:
    kw = dict(max_bs=8, max_context_len=1024) | kw
    return ModelRunner.from_preset(preset, "cuda", dtype, 0, num_layers=layers, **kw)


def _prompts(seed, lens, vocab):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lens]


@pytest.mark.parametrize("preset, layers", PRESETS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_path_equals_the_sdpa_path(preset, layers, dtype, monkeypatch):
    mr = _mr(preset, dtype, layers)
    prompts = _prompts(1, [300, 1, 77, 512], mr.config.vocab_size)
    pages = [mr.kv_cache.reserve(len(p)) for p in prompts]
    head = [PrefillChunk(p[:130], 0, pg) for p, pg in zip(prompts, pages) if len(p) > 130]
    tail = [PrefillChunk(p[130:], 130, pg) for p, pg in zip(prompts, pages) if len(p) > 130]
    kernel = mr.prefill(prompts, pages).clone()
    mr.extend(head)
    kernel_tail = mr.extend(tail).clone()
    monkeypatch.setattr(pa, "HEAD_DIMS", ())  # the SDPA path for every head size
    torch_ = mr.prefill(prompts, pages)
    mr.extend(head)
    torch_tail = mr.extend(tail)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert rel_err(kernel, torch_) < tol
    assert rel_err(kernel_tail, torch_tail) < tol


def test_packed_equals_each_prompt_alone():
    mr = _mr()
    prompts = _prompts(2, [511, 3, 64, 129, 1000], mr.config.vocab_size)
    pages = [mr.kv_cache.reserve(len(p)) for p in prompts]
    packed = mr.prefill(prompts, pages).clone()
    for i, (p, pg) in enumerate(zip(prompts, pages)):
        assert rel_err(packed[i], mr.prefill([p], [pg])[0]) < 1e-4


@pytest.mark.parametrize("chunk", [1, 7, 16, 17, 8192])
def test_chunks_equal_the_whole_prompt(chunk):
    mr = _mr()
    lens = [200, 37] if chunk == 1 else [700, 37, 300]  # one-token chunks: fewer steps
    prompts = _prompts(3, lens, mr.config.vocab_size)
    pages = [mr.kv_cache.reserve(len(p)) for p in prompts]
    whole = mr.prefill(prompts, pages).clone()
    last = {}
    for start in range(0, max(lens), chunk):
        live = [(i, p) for i, p in enumerate(prompts) if start < len(p)]
        out = mr.extend([PrefillChunk(p[start : start + chunk], start, pages[i]) for i, p in live])
        for (i, _), row in zip(live, out):
            last[i] = row.clone()
    for i in range(len(prompts)):
        assert rel_err(last[i], whole[i]) < 1e-4


@pytest.mark.parametrize("budget", [64, 8192])
def test_exact_gives_eagers_tokens_in_bf16_with_chunking(budget):
    prompts = _prompts(4, [600, 5, 129, 48, 1, 333], 128256)
    out = {}
    for mode in ("eager", "graph", "exact"):
        mr = _mr(dtype=torch.bfloat16, max_context_len=1024)
        config = None if mode == "eager" else RunnerConfig(max_bs=8, show_progress=False)
        engine = Engine(mr, mode, config, max_prefill_tokens=budget)
        out[mode] = engine.generate(prompts, max_new_tokens=12)
        engine.shutdown()
    assert out["exact"] == out["eager"]  # bit for bit (graph may differ: fixed geometry)
    assert [len(t) for t in out["graph"]] == [12] * len(prompts)


def test_piecewise_chunks_equal_eager_extend():
    ref, mr = _mr(), _mr()
    pp = PiecewisePrefill(mr)
    prompts = _prompts(5, [400, 90, 33], mr.config.vocab_size)
    pages = [ref.kv_cache.reserve(len(p)) for p in prompts]
    assert [mr.kv_cache.reserve(len(p)) for p in prompts] == pages
    head = [PrefillChunk(p[:17], 0, pg) for p, pg in zip(prompts, pages)]
    tail = [PrefillChunk(p[17:], 17, pg) for p, pg in zip(prompts, pages)]
    for chunks in (head, tail):
        graphs = pp.stats.graph_batches
        got = pp.extend(chunks).clone()
        assert pp.stats.graph_batches == graphs + 1
        assert rel_err(got, ref.extend(chunks)) < 1e-4
    pp.shutdown()
