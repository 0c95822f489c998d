"""Prefix caching on the GPU (llama-3.2-1b's shapes, two layers): in bf16 exact still equals
eager bit for bit with caching on over shared-prefix mixes (chunks inside and after the cached
prefix); in float32 greedy tokens with caching on equal caching off; no page leaks."""

from __future__ import annotations

import pytest
import torch

from stepgraph.engine import Engine
from stepgraph.model import ModelRunner
from stepgraph.runner import RunnerConfig
from tests.guards import time_limit

pytestmark = pytest.mark.cuda
VOCAB = 128256


def _mr(dtype) -> ModelRunner:
    return ModelRunner.from_preset(
        "llama-3.2-1b", "cuda", dtype, 0, num_layers=2, max_bs=8, max_context_len=1024
    )


def _mix(seed: int, n: int = 14) -> list[list[int]]:
    """Prompts on three shared prefixes (200, 256 and 515 tokens) plus a few alone."""
    g = torch.Generator().manual_seed(seed)
    heads = [torch.randint(1, VOCAB, (k,), generator=g).tolist() for k in (200, 256, 515)]
    out = []
    for i in range(n):
        tail = torch.randint(
            1, VOCAB, (int(torch.randint(1, 300, (1,), generator=g)),), generator=g
        )
        out.append((heads[i % 3] if i % 4 else []) + tail.tolist())
    return out


def _engine(mr, mode, caching=True) -> Engine:
    config = None if mode == "eager" else RunnerConfig(max_bs=8, show_progress=False)
    return Engine(mr, mode, config, max_running=4, max_prefill_tokens=384, prefix_caching=caching)


def _no_leak(engine: Engine) -> None:
    cache, kv = engine.prefix_cache, engine.model_runner.kv_cache
    cache.check()
    assert not cache._tree.refs
    cache.clear()
    assert kv.allocator.num_free == kv.num_pages - 1


def test_exact_equals_eager_bit_for_bit_with_caching_on_in_bf16():
    prompts = _mix(1)
    outs = {}
    with time_limit(90):
        for mode in ("eager", "exact"):
            engine = _engine(_mr(torch.bfloat16), mode)
            first = engine.generate(prompts[:3], 16, ignore_eos=True)  # caches the prefixes
            rest = engine.generate(prompts[3:], 16, ignore_eos=True)
            assert engine.stats.cached_tokens > 0
            outs[mode] = first + rest
            _no_leak(engine)
    assert outs["exact"] == outs["eager"]


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_caching_on_equals_off_in_float32(mode):
    prompts = _mix(2, 10)
    with time_limit(90):
        off = _engine(_mr(torch.float32), mode, caching=False)
        want = off.generate(prompts[:2], 12, ignore_eos=True)
        want += off.generate(prompts[2:], 12, ignore_eos=True)
        on = _engine(_mr(torch.float32), mode)
        got = on.generate(prompts[:2], 12, ignore_eos=True)
        got += on.generate(prompts[2:], 12, ignore_eos=True)
    assert got == want and on.stats.cached_tokens > 0
    _no_leak(on)
