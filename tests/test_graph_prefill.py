"""Whole-forward prefill graphs on the CPU stand-in against ``ModelRunner.extend``: random mixes
of whole prompts and chunks over a cached prefix, at a token bucket's edge and one past it, more
chunks than a graph holds (eager), poisoned caches (K/V written at the live slots and nowhere
else but scratch page 0), and the engine option."""

from __future__ import annotations

import pytest
import torch

from stepgraph.engine import Engine
from stepgraph.errors import ConfigError, ReplayError
from stepgraph.model import ModelRunner
from stepgraph.model.prefill.extend_batch import PrefillChunk
from stepgraph.model.prefill.graph_prefill import GraphPrefill
from stepgraph.runner import RunnerConfig

from .conftest import rel_err

VOCAB = 512
BUCKETS = (8, 32, 64)


def _runner() -> ModelRunner:
    return ModelRunner.from_preset(
        "tiny", "cpu", torch.float32, seed=6, max_bs=6, max_context_len=96
    )


@pytest.fixture(scope="module")
def pair():
    return _runner(), GraphPrefill(_runner(), BUCKETS, max_chunks=4)


def _check(pair, lens, starts, seed):
    ref, gp = pair
    g = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(1, VOCAB, (s + n,), generator=g).tolist() for s, n in zip(starts, lens)
    ]
    pages = [ref.kv_cache.reserve(len(p)) for p in prompts]
    assert [gp.mr.kv_cache.reserve(len(p)) for p in prompts] == pages
    try:
        heads = [PrefillChunk(p[:s], 0, pg) for p, s, pg in zip(prompts, starts, pages) if s]
        if heads:  # the cached prefixes, written the same way in both
            ref.extend(heads)
            gp.mr.extend(heads)
        for c in (*gp.mr.kv_cache.k_caches, *gp.mr.kv_cache.v_caches):  # poison the rest
            live = torch.zeros(c.shape[0] * c.shape[1], dtype=torch.bool)
            for s, pg in zip(starts, pages):
                live[torch.tensor(gp.mr.kv_cache.slots(pg, 0, s), dtype=torch.long)] = True
            c.view(-1, *c.shape[2:])[~live] = float("nan")
        chunks = [PrefillChunk(p[s:], s, pg) for p, s, pg in zip(prompts, starts, pages)]
        graphs = gp.stats.graph_batches
        got = gp.extend(chunks).clone()
        assert gp.stats.graph_batches == graphs + gp.can_run(lens)
        want = ref.extend(chunks)
        assert rel_err(got, want) < 1e-5
        slots = torch.tensor(
            [s for p, pg in zip(prompts, pages) for s in gp.mr.kv_cache.slots(pg, 0, len(p))]
        )
        for a, b in zip(
            gp.mr.kv_cache.k_caches + gp.mr.kv_cache.v_caches,
            ref.kv_cache.k_caches + ref.kv_cache.v_caches,
        ):
            fa = a.flatten(0, 1)
            assert rel_err(fa[slots], b.flatten(0, 1)[slots]) < 1e-5
            untouched = torch.ones(fa.shape[0], dtype=torch.bool)
            untouched[slots] = False
            untouched[: gp.mr.page_size] = False  # scratch page 0 takes the padded tokens
            assert fa[untouched].isnan().all()
    finally:
        for p in pages:
            ref.kv_cache.release(p)
            gp.mr.kv_cache.release(p)


@pytest.mark.parametrize(
    "lens, starts",
    [
        ([8], [0]),  # exactly the smallest bucket
        ([5, 4], [0, 0]),  # one past it
        ([20, 1, 11], [0, 0, 0]),  # exactly 32
        ([30, 3, 17, 14], [0, 5, 16, 33]),  # max chunks, 64 tokens, over cached prefixes
        ([1], [40]),  # a one-token chunk over a prefix crossing pages
        ([2, 2, 2, 2, 2], [0, 0, 0, 0, 0]),  # five chunks > max_chunks: eager
        ([65], [0]),  # past the largest bucket: eager
    ],
)
def test_graph_prefill_equals_eager_extend(pair, lens, starts):
    _check(pair, lens, starts, seed=sum(lens) + sum(starts))


def test_random_mixes(pair):
    g = torch.Generator().manual_seed(3)
    for trial in range(5):
        n = int(torch.randint(1, 5, (1,), generator=g))
        lens = torch.randint(1, 16, (n,), generator=g).tolist()
        starts = torch.randint(0, 30, (n,), generator=g).tolist()
        _check(pair, lens, starts, seed=50 + trial)


def test_bad_arguments_and_shutdown():
    with pytest.raises(ConfigError, match="max_chunks must be an integer >= 1"):
        GraphPrefill(_runner(), BUCKETS, max_chunks=0)
    with pytest.raises(ConfigError, match="max_chunks"):
        GraphPrefill(_runner(), BUCKETS, max_chunks=True)
    gp = GraphPrefill(_runner(), (8,), max_chunks=2)
    with pytest.raises(ConfigError, match="chunk 0 starts at -1"):
        gp.extend([PrefillChunk([1, 2], -1, [1])])
    gp.shutdown()
    with pytest.raises(ReplayError, match="after shutdown"):
        gp.extend([PrefillChunk([1, 2], 0, [1])])


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_engine_graph_prefill_gives_eagers_tokens(mode):
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in (3, 40, 17, 6, 29)]
    want = Engine(_runner(), "eager").generate(prompts, 6)
    config = None if mode == "eager" else RunnerConfig(max_bs=6, show_progress=False)
    engine = Engine(
        _runner(),
        mode,
        config,
        prefill="graph",
        max_prefill_tokens=24,
        prefill_config=dict(token_buckets=BUCKETS, max_chunks=4),
    )
    assert engine.generate(prompts, 6) == want
    assert engine.prefiller.stats.graph_batches >= 3
    engine.shutdown()


def test_graph_prefill_has_a_pool_of_its_own():
    """Its graphs replay between the decode runner's: a shared pool would let one's scratch
    overwrite the other's outputs."""
    config = RunnerConfig(max_bs=6, show_progress=False)
    small = dict(token_buckets=(8,), max_chunks=2)
    engine = Engine(_runner(), "graph", config, prefill="graph", prefill_config=small)
    decode, prefill = engine.runner.pool.handle, engine.prefiller.pool.handle
    assert decode is not None and prefill is not None and prefill is not decode
    engine.shutdown()
