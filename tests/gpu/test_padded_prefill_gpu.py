"""On a real GPU, the padded prefill that every mode runs: its eager form equals its graph bit for
bit in bf16 (logits and every KV slot) over chunk mixes at a bucket's edge and one past, after
cached prefixes, at ``max_chunks`` and one past (both unpadded); an engine in mode "exact"
(the default, prefill from graphs) equals one in mode "eager" (the padded eager prefill) token
for token in bf16 over random request mixes with shared prefixes and chunked prompts; the
default buckets' pool within 512 MiB and twice the documented estimate of the activations.

Random weights of the llama-3.2-1b shapes."""

from __future__ import annotations

import random

import pytest
import torch

from stepgraph.check import compare, random_mix, run_check
from stepgraph.engine import Engine
from stepgraph.model import ModelRunner
from stepgraph.model.prefill.extend_batch import PrefillChunk
from stepgraph.model.prefill.graph_prefill import (
    DEFAULT_MAX_CHUNKS,
    DEFAULT_TOKEN_BUCKETS,
    GraphPrefill,
    activation_bytes,
)

pytestmark = pytest.mark.cuda

CONTEXT = 2048
VOCAB = 128256


def _mr(dtype=torch.bfloat16, layers=2, max_bs=8, seed=0) -> ModelRunner:
    return ModelRunner.from_preset(
        "llama-3.2-1b",
        "cuda",
        dtype,
        seed,
        num_layers=layers,
        max_bs=max_bs,
        max_context_len=CONTEXT,
    )


def _twin(mr: ModelRunner) -> ModelRunner:
    """The same weights, a KV cache and attention backend of its own."""
    return ModelRunner.from_model(
        mr.model, device="cuda", dtype=mr.dtype, max_bs=mr.max_bs, max_context_len=CONTEXT
    )


@pytest.fixture(scope="module")
def pair():
    mr = _mr()
    buckets, chunks = (64, 128, 256, 512, 1024), 4
    pair = (GraphPrefill(mr, buckets, chunks), GraphPrefill(_twin(mr), buckets, chunks, eager=True))
    yield pair
    for p in pair:
        p.shutdown()


CASES = [
    ([512], [0]),  # exactly a bucket
    ([300, 213], [0, 0]),  # one past it
    ([1, 64, 900, 35], [700, 17, 0, 3]),  # max_chunks, after cached prefixes
    ([1024], [0]),  # the largest bucket
    ([1025], [0]),  # one past it: unpadded in both
    ([5, 5, 5, 5, 5], [0, 0, 0, 0, 0]),  # max_chunks + 1: unpadded in both
]


@pytest.mark.parametrize("lens, starts", CASES)
def test_eager_padded_equals_the_graph_bit_for_bit_in_bf16(pair, lens, starts):
    g = torch.Generator().manual_seed(sum(lens))
    prompts = [
        torch.randint(1, VOCAB, (s + n,), generator=g).tolist() for s, n in zip(starts, lens)
    ]
    kvs = [p.mr.kv_cache for p in pair]
    pages = [kvs[0].reserve(len(p)) for p in prompts]
    assert [kvs[1].reserve(len(p)) for p in prompts] == pages
    try:
        heads = [PrefillChunk(p[:s], 0, pg) for p, s, pg in zip(prompts, starts, pages) if s]
        chunks = [PrefillChunk(p[s:], s, pg) for p, s, pg in zip(prompts, starts, pages)]
        out = []
        for p in pair:
            if heads:
                p.extend(heads)
            out.append(p.extend(chunks).clone())
        assert torch.equal(out[0], out[1]), (out[0] - out[1]).abs().max().item()
        for a, b in zip(kvs[0].k_caches + kvs[0].v_caches, kvs[1].k_caches + kvs[1].v_caches):
            assert torch.equal(a[1:], b[1:])  # every page but scratch page 0
    finally:
        for kv in kvs:
            for pg in pages:
                kv.release(pg)


def test_exact_equals_eager_with_the_default_prefill_over_random_mixes():
    mr = _mr(max_bs=8, seed=3)
    rng = random.Random(7)
    mixes = [random_mix(rng, VOCAB, 8, CONTEXT - 24) for _ in range(6)]
    res = run_check(mr, mixes, ["eager", "exact"], 8, log=print)
    assert not res["exact"].errors and not res["eager"].errors
    differ, dmax = compare(res["eager"], res["exact"])
    print(f"exact against eager: {differ} mixes differ, first-step max |dlogit| {dmax}")
    assert differ == 0


@pytest.mark.parametrize("budget", [256, 8192])
def test_exact_engine_equals_eager_engine_chunked_and_cached(budget):
    """Prompts chunked across steps under the budget, many sharing a prefix (prefix caching on,
    the default), some packed past ``max_chunks``."""
    mr = _mr(max_bs=16, seed=5)
    rng = random.Random(budget)
    head = [rng.randrange(1, VOCAB) for _ in range(70)]
    lengths = [1, 63, 64, 65, 511, 512, 513, 900, 1500, 3, 17, 129, 256, 257, 40, 8]
    prompts = [
        (head if i % 3 == 0 else []) + [rng.randrange(1, VOCAB) for _ in range(n)]
        for i, n in enumerate(lengths)
    ]
    out = {}
    for mode in ("eager", "exact"):
        small = {"max_chunks": 3}  # steps of more chunks run unpadded, in both modes
        engine = Engine(_twin(mr), mode, max_prefill_tokens=budget, prefill_config=small)
        assert engine.prefill == ("eager" if mode == "eager" else "graph")
        out[mode] = engine.generate(prompts, 12, ignore_eos=True)
        stats = engine.prefiller.stats
        print(mode, budget, stats)
        padded = stats.graph_batches if mode == "exact" else stats.padded_batches
        assert padded >= 1 and padded + stats.unpadded_batches >= 2
        assert engine.stats.cached_tokens > 0
        engine.shutdown()
    assert out["exact"] == out["eager"]


def test_the_default_buckets_pool_and_its_estimate():
    mr = _mr(layers=16, max_bs=64)
    gp = GraphPrefill(mr, show_progress=True)
    assert gp.token_buckets == list(DEFAULT_TOKEN_BUCKETS) and gp.max_chunks == DEFAULT_MAX_CHUNKS
    cap = gp.stats.capture
    estimate = activation_bytes(mr.config, DEFAULT_TOKEN_BUCKETS[-1], 2)
    print(cap.ledger_table())
    print(
        f"pool {cap.pool_bytes / 2**20:.1f} MiB, estimated activations at "
        f"{DEFAULT_TOKEN_BUCKETS[-1]} tokens {estimate / 2**20:.1f} MiB, "
        f"capture {cap.seconds:.2f} s"
    )
    assert cap.pool_bytes < 512 * 2**20
    assert cap.pool_bytes < 2 * estimate  # the documented estimate bounds it, allocator slack
    gp.shutdown()
