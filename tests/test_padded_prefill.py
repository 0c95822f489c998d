"""The padded prefill that every mode runs: its eager form (``GraphPrefill(eager=True)``) equals
the graph stand-in bit for bit in float32 and bf16 over random chunk mixes (chunks after a
cached prefix, exactly at a token bucket and one past, at ``max_chunks`` and one past, where
both fall back to the unpadded forward); the engine's default prefill per mode, its buckets
from the prefill budget, its tokens equal to the unpadded prefill's in float32, with no page
left held; the refusals."""

from __future__ import annotations

import warnings

import pytest
import torch

from stepgraph.engine import Engine
from stepgraph.engine.prefill import default_prefill, padded_prefill_config, pads_to
from stepgraph.errors import ConfigError
from stepgraph.model import ModelRunner
from stepgraph.model.prefill.extend_batch import ExtendLayout, PrefillChunk, pack_extend
from stepgraph.model.prefill.graph_prefill import GraphPrefill, token_buckets_for
from stepgraph.runner import RunnerConfig

VOCAB = 512
BUCKETS = (8, 32, 64)
MAX_CHUNKS = 4


def _runner(dtype=torch.float32, **kw) -> ModelRunner:
    args = dict(seed=6, max_bs=6, max_context_len=96) | kw
    return ModelRunner.from_preset("tiny", "cpu", dtype, **args)


def _pair(dtype):
    graph = GraphPrefill(_runner(dtype), BUCKETS, max_chunks=MAX_CHUNKS)
    eager = GraphPrefill(_runner(dtype), BUCKETS, max_chunks=MAX_CHUNKS, eager=True)
    return graph, eager


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def pair(request):
    return _pair(request.param)


def _run(pair, lens, starts, seed):
    """The same chunks (each after a cached prefix of ``starts[i]`` tokens) through both;
    their logits and every KV slot compared bit for bit; every page released after."""
    g = torch.Generator().manual_seed(seed)
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
            if heads:  # the cached prefixes, written by the same padded forward
                p.extend(heads)
            out.append(p.extend(chunks).clone())
        assert out[0].shape == (len(chunks), VOCAB)
        assert torch.equal(out[0], out[1])
        for a, b in zip(kvs[0].k_caches + kvs[0].v_caches, kvs[1].k_caches + kvs[1].v_caches):
            assert torch.equal(a[1:], b[1:])  # every page but scratch page 0
        return out[0]
    finally:
        for kv in kvs:
            for pg in pages:
                kv.release(pg)


@pytest.mark.parametrize(
    "lens, starts, padded",
    [
        ([8], [0], True),  # exactly the smallest bucket
        ([5, 4], [0, 0], True),  # one past it
        ([20, 1, 11], [0, 0, 0], True),  # exactly 32
        ([30, 3, 17, 14], [0, 5, 16, 33], True),  # max_chunks, 64 tokens, after cached prefixes
        ([1], [40], True),  # one token after a prefix crossing pages
        ([2, 2, 2, 2, 2], [0, 0, 0, 0, 0], False),  # max_chunks + 1: unpadded in both
        ([65], [0], False),  # one past the largest bucket: unpadded in both
    ],
)
def test_eager_padded_equals_the_graph_bit_for_bit(pair, lens, starts, padded):
    graph, eager = pair
    before = (graph.stats.graph_batches, eager.stats.padded_batches)
    unpadded = (graph.stats.unpadded_batches, eager.stats.unpadded_batches)
    _run(pair, lens, starts, seed=sum(lens) + sum(starts))
    heads = any(starts)  # the prefixes' own forward: a bucket of up to 64 tokens, <= 4 chunks
    assert graph.stats.graph_batches - before[0] == padded + heads
    assert eager.stats.padded_batches - before[1] == padded + heads
    assert graph.stats.unpadded_batches - unpadded[0] == (not padded)
    assert eager.stats.unpadded_batches - unpadded[1] == (not padded)
    assert not eager.graphs  # the eager form captures nothing


def test_random_chunk_mixes(pair):
    """``_run`` asserts the bits and the KV of each mix; here also that the mixes reached the
    padded forward in both (not only the unpadded fallback, which is the same code in both)."""
    graph, eager = pair
    before = (graph.stats.graph_batches, eager.stats.padded_batches)
    g = torch.Generator().manual_seed(11)
    for trial in range(6):
        n = int(torch.randint(1, MAX_CHUNKS + 2, (1,), generator=g))
        lens = torch.randint(1, 20, (n,), generator=g).tolist()
        starts = torch.randint(0, 40, (n,), generator=g).tolist()
        logits = _run(pair, lens, starts, seed=100 + trial)
        assert logits.shape == (n, VOCAB) and torch.isfinite(logits).all()
    padded = graph.stats.graph_batches - before[0]
    assert padded > 0 and eager.stats.padded_batches - before[1] == padded


def test_padded_equals_unpadded_in_float32():
    """Padding changes shapes, not the arithmetic of a live row, beyond rounding."""
    graph, _ = _pair(torch.float32)
    ref = _runner()
    chunks_of = lambda pages: [  # noqa: E731
        PrefillChunk(list(range(3, 23)), 0, pages[0]),
        PrefillChunk(list(range(7, 10)), 0, pages[1]),
    ]
    pages = [graph.mr.kv_cache.reserve(20), graph.mr.kv_cache.reserve(3)]
    assert [ref.kv_cache.reserve(20), ref.kv_cache.reserve(3)] == pages
    got = graph.extend(chunks_of(pages)).clone()
    want = ref.extend(chunks_of(pages))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_host_copy_leaves_stale_rows_only_where_no_chunk_reads():
    """A batch of fewer chunks than the last leaves that batch's block-table rows of the empty
    chunks in place; every other field is rewritten (padding tokens write scratch slot 0)."""
    graph, _ = _pair(torch.float32)
    mr = graph.mr
    pages = [mr.kv_cache.reserve(10) for _ in range(3)]
    graph.extend([PrefillChunk([5] * 2, 0, pg) for pg in pages])  # 6 tokens: bucket (8, 4)
    now = [PrefillChunk([6] * 3, 0, pages[0]), PrefillChunk([7], 0, pages[1])]
    graph.extend(now)  # the same bucket
    layout = graph._layout(8, MAX_CHUNKS)
    want = pack_extend(now, mr.page_size, layout)
    n = layout.numel - (MAX_CHUNKS - 2) * layout.width  # up to chunk 2's row
    got = graph._static[: layout.numel].numpy()
    assert (got[:n] == want[:n]).all()
    assert got[n] == pages[2][0]  # chunk 2's row from the batch before


def test_pack_extend_pads_every_segment():
    layout = ExtendLayout(8, 2, 4, 4, 4)
    host = pack_extend([PrefillChunk([7, 8, 9], 17, [3, 5])], 16, layout)
    ids, pos, slots = host[:8], host[8:16], host[16:24]
    assert ids.tolist() == [7, 8, 9, 0, 0, 0, 0, 0]
    assert pos.tolist() == [17, 18, 19, 0, 0, 0, 0, 0]
    assert slots.tolist() == [81, 82, 83, 0, 0, 0, 0, 0]  # page 5, slots 1-3; then scratch 0
    last, indptr, kv = host[24:26], host[26:30], host[30:34]
    assert (
        last.tolist() == [2, 0] and indptr.tolist() == [0, 3, 3, 3] and kv.tolist()[:2] == [20, 0]
    )
    assert host[34:].tolist() == [3, 5, 0, 0, 0, 0, 0, 0]


def test_token_buckets_reach_the_budget():
    assert token_buckets_for(1) == [64]
    assert token_buckets_for(64) == [64]
    assert token_buckets_for(65) == [64, 128]
    assert token_buckets_for(8192) == [64, 128, 256, 512, 1024, 2048, 4096, 8192]
    assert token_buckets_for(8193)[-1] == 16384


def test_the_engines_padded_prefill_config():
    mr = _runner(max_bs=6, max_context_len=96)  # 6 x 96 tokens of KV: 576
    assert padded_prefill_config(mr, 8192) == {
        "token_buckets": [64, 128, 256, 512, 1024],
        "max_chunks": 6,
    }
    assert padded_prefill_config(mr, 100)["token_buckets"] == [64, 128]
    big = _runner(max_bs=64, max_context_len=2048)
    cfg = padded_prefill_config(big, 8192)
    assert cfg["token_buckets"][-1] == 8192 and cfg["max_chunks"] == 32
    assert padded_prefill_config(big, 10**6)["token_buckets"][-1] == 8192  # at most the default


@pytest.mark.parametrize("mode, want", [("eager", "eager"), ("graph", "graph"), ("exact", "graph")])
def test_the_default_prefill_of_each_mode(mode, want):
    assert default_prefill(mode) == want


def test_engine_defaults_to_the_padded_prefill():
    eager = Engine(_runner())  # the CPU's default mode: eager
    assert eager.prefill == "eager" and isinstance(eager.prefiller, GraphPrefill)
    assert eager.prefiller.eager and not eager.prefiller.graphs
    config = RunnerConfig(max_bs=6, show_progress=False)
    graph = Engine(_runner(), "graph", config)
    assert graph.prefill == "graph" and not graph.prefiller.eager
    prefiller = graph.prefiller  # captured at build: every token bucket, 1 chunk and max_chunks
    assert prefiller.chunk_buckets == [1, 6]
    assert sorted(prefiller.graphs) == [(t, b) for t in prefiller.token_buckets for b in (1, 6)]
    unpadded = Engine(_runner(), prefill="unpadded")
    assert unpadded.prefiller is unpadded.model_runner
    for e in (eager, graph):
        e.shutdown()


def test_pads_to_names_the_bucket_a_budget_between_buckets_runs_at():
    buckets = [64, 128, 256]
    assert pads_to(128, buckets) is None  # exactly a bucket
    assert pads_to(129, buckets) == 256 and pads_to(127, buckets) == 128  # one past, one short
    assert pads_to(1, buckets) == 64  # below the smallest
    assert pads_to(256, buckets) is None and pads_to(257, buckets) is None  # past the largest


def test_an_engine_warns_of_a_prefill_budget_between_token_buckets():
    mr = _runner()  # token buckets 64 .. 1024 (576 tokens of KV)
    with pytest.warns(UserWarning, match="max_prefill_tokens_with_decode=96 .* padded to 128"):
        Engine(mr, max_prefill_tokens_with_decode=96).shutdown()
    with pytest.warns(UserWarning, match="max_prefill_tokens=300 .* padded to 512"):
        Engine(mr, max_prefill_tokens=300, max_prefill_tokens_with_decode=None).shutdown()
    with warnings.catch_warnings(record=True) as caught:  # buckets, defaults, no cap: none
        warnings.simplefilter("always")
        Engine(mr, max_prefill_tokens=512, max_prefill_tokens_with_decode=128).shutdown()
        Engine(mr).shutdown()
        Engine(mr, max_prefill_tokens_with_decode=None).shutdown()
        Engine(mr, max_prefill_tokens_with_decode=16).shutdown()  # below 64: every budget pads
    assert [str(w.message) for w in caught if "token bucket" in str(w.message)] == []


def _assert_no_leak(engine: Engine) -> None:
    cache, kv = engine.prefix_cache, engine.model_runner.kv_cache
    assert not cache._tree.refs, f"pages still referenced: {cache._tree.refs}"
    cache.clear()
    assert kv.allocator.num_free == kv.num_pages - 1


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_engine_tokens_equal_the_unpadded_prefills_in_float32(mode):
    g = torch.Generator().manual_seed(9)
    head = torch.randint(1, VOCAB, (20,), generator=g).tolist()  # a shared, cached prefix
    lens = (3, 40, 17, 6, 29, 1, 64, 65)
    prompts = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in lens]
    prompts += [head + [5, 6], head + [7], head + list(range(1, 30))]
    want = Engine(_runner(max_context_len=160), "eager", prefill="unpadded").generate(prompts, 6)
    config = None if mode == "eager" else RunnerConfig(max_bs=6, show_progress=False)
    engine = Engine(_runner(max_context_len=160), mode, config, max_prefill_tokens=48)
    assert engine.generate(prompts, 6) == want
    stats = engine.prefiller.stats
    assert (stats.padded_batches if mode == "eager" else stats.graph_batches) >= 3
    assert engine.stats.cached_tokens > 0  # a chunk ran after a cached prefix
    _assert_no_leak(engine)
    engine.shutdown()


def test_a_lone_chunk_runs_at_one_chunk_and_more_at_max_chunks(pair):
    graph, eager = pair
    assert graph.chunk_buckets == [1, MAX_CHUNKS]
    one = _run(pair, [7], [0], seed=1)
    two = _run(pair, [7, 3], [0, 0], seed=1)  # the same first prompt, packed with another
    assert one.shape == (1, VOCAB) and two.shape == (2, VOCAB)
    torch.testing.assert_close(one[0], two[0], rtol=1e-4, atol=1e-4)  # another shape: close
    with pytest.raises(ConfigError, match="chunk_buckets must end at max_chunks=4"):
        GraphPrefill(_runner(), BUCKETS, MAX_CHUNKS, chunk_buckets=(1, 2))


def test_refusals():
    with pytest.raises(ConfigError, match="prefill must be one of"):
        Engine(_runner(), prefill="padded")
    with pytest.raises(ConfigError, match="eager must be True or False"):
        GraphPrefill(_runner(), BUCKETS, eager=1)
    eager = GraphPrefill(_runner(), BUCKETS, eager=True)
    with pytest.raises(ConfigError, match="captures no graph"):
        eager.capture()


def test_the_check_runs_every_engine_with_the_default_prefill():
    from stepgraph.check import build_engines

    engines = build_engines(_runner(), ["eager", "graph", "walk"], 4)
    got = {m: (e.prefill, e.prefiller.eager) for m, e in engines.items()}
    assert got == {"eager": ("eager", True), "graph": ("graph", False), "walk": ("graph", False)}
    for e in engines.values():
        e.shutdown()


def _pack_reference(chunks, page_size, layout):
    """Token by token, in Python: what ``pack_extend`` computes with numpy."""
    import numpy as np

    out = np.zeros(layout.numel, dtype=np.int64)
    ids, pos, slots, last, indptr, kv, table = np.split(out, np.cumsum(layout.sizes()[:-1]))
    table = table.reshape(layout.chunks, layout.width)
    n = 0
    for b, c in enumerate(chunks):
        for i, tok in enumerate(c.tokens):
            p = c.start + i
            ids[n], pos[n], slots[n] = tok, p, c.pages[p // page_size] * page_size + p % page_size
            n += 1
        table[b, : len(c.pages[: layout.width])] = c.pages[: layout.width]
        last[b], indptr[b + 1], kv[b] = n - 1, n, c.end
    indptr[len(chunks) + 1 :] = n
    return out


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_pack_extend_equals_a_token_by_token_reference(page_size):
    import random

    rng = random.Random(page_size)
    width = 40
    for _ in range(60):
        chunks = []
        for _ in range(rng.randint(0, 5)):
            start, q = rng.randint(0, 70), rng.randint(1, 50)
            if start + q > width * page_size:
                continue
            pages = [rng.randint(1, 999) for _ in range(-(-(start + q) // page_size))]
            pages += [rng.randint(1, 999) for _ in range(rng.randint(0, 2))]  # reserved beyond
            chunks.append(PrefillChunk([rng.randint(1, 500) for _ in range(q)], start, pages))
        tokens = sum(len(c.tokens) for c in chunks) + rng.randint(1, 5)
        layout = ExtendLayout(tokens, 6, width, 8, 8)
        want = _pack_reference(chunks, page_size, layout)
        assert (pack_extend(chunks, page_size, layout) == want).all()


@pytest.mark.parametrize("mlp_rows", [5, 16, 10**6])
def test_the_padded_forward_is_the_models_forward_at_the_last_rows(mlp_rows):
    """``padded_forward`` keeps only the chunks' last rows after the last layer's attention and
    runs the MLP a few rows at a time: the model's forward at those rows, in float32, and every
    K/V it writes is the model's (bit for bit where the MLP runs whole)."""
    from stepgraph.model.prefill.extend_batch import build_extend_batch
    from stepgraph.model.prefill.graph_prefill import padded_forward

    mrs = [_runner(), _runner()]
    g = torch.Generator().manual_seed(mlp_rows % 97)
    lens = [13, 1, 7]
    pages = [mrs[0].kv_cache.reserve(n) for n in lens]
    assert [mrs[1].kv_cache.reserve(n) for n in lens] == pages
    chunks = [
        PrefillChunk(torch.randint(1, VOCAB, (n,), generator=g).tolist(), 0, pg)
        for n, pg in zip(lens, pages)
    ]
    outs = []
    for k, mr in enumerate(mrs):
        batch = build_extend_batch(chunks, mr.page_size, mr.device)
        mr.attn_backend.init_extend_metadata(batch)
        with torch.no_grad():
            if k == 0:
                outs.append(padded_forward(mr.model, batch, mr.attn_backend, mlp_rows))
            else:
                h = mr.model(batch.input_ids, batch.positions, mr.attn_backend)
                outs.append(h[batch.last_idx])
    assert outs[0].shape == (3, mrs[0].config.hidden_size)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    kv = [mr.kv_cache.k_caches + mr.kv_cache.v_caches for mr in mrs]
    for a, b in zip(*kv):  # every token's K/V: written before any row is dropped
        if mlp_rows >= sum(lens):
            assert torch.equal(a, b)
        else:  # the MLP in parts: other GEMM shapes under the next layers' K/V
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
