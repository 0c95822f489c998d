"""The engine with prefix caching on the CPU (tiny preset, float32): greedy tokens equal caching
off over random mixes of shared and unshared prompts (requests joining mid-stream, max_running
below the batch, chunk boundaries inside and outside the cached prefix); the packed batch of a
chunk after a cached prefix, field by field; no page leaks after aborts or a fault mid-prefill
that reads cached pages; eviction under memory pressure takes only unreferenced pages; a
different cache_salt never hits."""

from __future__ import annotations

import pytest
import torch

from stepgraph.engine import Engine
from stepgraph.engine.cache_use import written_tokens
from stepgraph.errors import ConfigError
from stepgraph.model import ModelRunner
from stepgraph.runner import RunnerConfig

from .guards import time_limit

VOCAB, PS = 512, 16


def _runner(num_pages: int = 64, max_bs: int = 4) -> ModelRunner:
    return ModelRunner.from_preset(
        "tiny",
        "cpu",
        torch.float32,
        seed=3,
        max_bs=max_bs,
        max_context_len=128,
        num_pages=num_pages,
    )


def _engine(caching: bool, mode: str = "eager", num_pages: int = 64, **kw) -> Engine:
    config = None if mode == "eager" else RunnerConfig(max_bs=4, show_progress=False)
    return Engine(_runner(num_pages), mode, config, prefix_caching=caching, **kw)


def _tokens(g: torch.Generator, n: int) -> list[int]:
    return torch.randint(1, VOCAB, (n,), generator=g).tolist()


def _mix(seed: int, n: int = 10):
    """(step to add it at, prompt, max_new_tokens): most prompts start with one of three
    shared prefixes (a page and a half, exactly two pages, three pages and a bit), some share
    nothing, one repeats an earlier prompt whole."""
    g = torch.Generator().manual_seed(seed)
    heads = [_tokens(g, k) for k in (24, 32, 50)]
    out = []
    for _ in range(n):
        at = int(torch.randint(0, 12, (1,), generator=g))
        tail = _tokens(g, int(torch.randint(1, 20, (1,), generator=g)))
        kind = int(torch.randint(0, 4, (1,), generator=g))
        prompt = tail if kind == 3 else heads[kind] + tail
        new = int(torch.randint(1, 10, (1,), generator=g))
        out.append((at, prompt, new))
    out.append((14, list(out[0][1]), 5))  # the whole prompt again, later: fully cached
    return sorted(out, key=lambda r: r[0])


def _drive(engine: Engine, mix, abort=None) -> list[list[int] | None]:
    rids, step = [], 0
    while len(rids) < len(mix) or engine.has_unfinished:
        for at, prompt, new in mix:
            if at == step:
                rids.append(engine.add_request(prompt, new))
        if abort is not None and step == abort[0] and rids:
            engine.abort(rids[min(abort[1], len(rids) - 1)])
        engine.step()
        step += 1
        assert step < 500, "the loop does not end"
    engine.drain()
    return [engine.finished[r].output if r in engine.finished else None for r in rids]


def _assert_no_leak(engine: Engine) -> None:
    """Nothing referenced; every page free once the cache is cleared."""
    cache, kv = engine.prefix_cache, engine.model_runner.kv_cache
    cache.check()
    assert not cache._tree.refs, f"pages still referenced: {cache._tree.refs}"
    cache.clear()
    assert kv.allocator.num_free == kv.num_pages - 1


@pytest.mark.parametrize("mode", ["eager", "graph"])
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("budget", [7, 16, 40, 8192])  # chunks cut inside and at page bounds
def test_caching_on_gives_the_tokens_of_caching_off(mode, seed, budget):
    mix = _mix(seed)
    max_running = 2 if seed % 2 else None  # below the batch: admission waits for finishes
    kw = dict(max_running=max_running, max_prefill_tokens=budget)
    want = _drive(_engine(False, mode, **kw), mix)
    engine = _engine(True, mode, **kw)
    with time_limit(60):
        assert _drive(engine, mix) == want
    assert engine.stats.cached_tokens > 0  # the shared prefixes did hit
    assert engine.stats.hit_rate == engine.stats.cached_tokens / engine.stats.queried_tokens
    _assert_no_leak(engine)


def test_caching_off_never_hits_and_bad_arguments_are_refused():
    mix = _mix(5)
    engine = _engine(False)
    _drive(engine, mix)
    assert engine.stats.cached_tokens == 0 and engine.stats.hit_rate == 0.0
    assert engine.stats.queried_tokens == sum(len(p) for _, p, _ in mix)
    assert engine.prefix_cache.num_cached == 0  # off: nothing inserted
    with pytest.raises(ConfigError, match="prefix_caching must be True or False"):
        Engine(_runner(), "eager", prefix_caching=1)
    with pytest.raises(ConfigError, match="cache_salt must be a string"):
        engine.add_request([1, 2, 3], 2, cache_salt=7)
    assert not engine.waiting


def test_a_fully_cached_prompt_recomputes_its_last_token():
    g = torch.Generator().manual_seed(1)
    for n in (32, 33, 47):  # a whole number of pages, one past, one short
        prompt = _tokens(g, n)
        engine = _engine(True)
        first = engine.generate([prompt], 4)
        before = engine.stats.cached_tokens
        assert engine.generate([prompt], 4) == first
        assert engine.stats.cached_tokens - before == (n - 1) // PS * PS
        assert engine.stats.prefill_tokens == n + n - (n - 1) // PS * PS
        _assert_no_leak(engine)


def test_the_chunk_after_a_cached_prefix_counts_it_field_by_field():
    """The CPU's attention does not read kv_lens, positions or the block table beyond its
    pages: check each field of the packed batch of the chunk that starts after the prefix."""
    g = torch.Generator().manual_seed(2)
    head, tail = _tokens(g, 40), _tokens(g, 9)
    engine = _engine(True, max_prefill_tokens=8192)
    engine.generate([head + _tokens(g, 5)], 3)  # caches head's first two pages
    mr = engine.model_runner
    batches = []
    init = mr.attn_backend.init_extend_metadata
    mr.attn_backend.init_extend_metadata = lambda b: (batches.append(b), init(b))[1]
    other = _tokens(g, 6)
    a = engine.add_request(head + tail, 2)
    b = engine.add_request(other, 2)  # a second chunk, from 0, packed behind it
    engine.step()
    req = engine.running[0]
    assert req.rid == a and req.cached_tokens == 32 and req.prefilled == 49
    cached = req.pages[:2]
    assert engine.prefix_cache.refcount(cached[0]) == 1  # referenced by it, while it runs
    (batch,) = batches  # padded to its token bucket: the live rows first, then padding
    n = 49 - 32
    live = n + 6
    assert batch.num_tokens == 64 and batch.max_q_len == 64
    assert batch.input_ids[:live].tolist() == (head + tail)[32:] + other
    assert batch.positions[:live].tolist() == list(range(32, 49)) + list(range(6))
    assert batch.kv_lens[:2].tolist() == [49, 6] and batch.kv_lens_host == [49, 6]
    assert batch.q_lens == [n, 6] and batch.qo_indptr[:3].tolist() == [0, n, n + 6]
    assert batch.last_idx[:2].tolist() == [n - 1, n + 5]
    assert (batch.qo_indptr[3:] == live).all() and not batch.kv_lens[2:].any()  # empty chunks
    pages_a, pages_b = req.pages, engine.running[1].pages
    kv = mr.kv_cache
    assert batch.slots[:live].tolist() == kv.slots(pages_a, 32, 49) + kv.slots(pages_b, 0, 6)
    for field in (batch.input_ids, batch.positions, batch.slots):  # token 0 into scratch slot 0
        assert not field[live:].any()
    assert batch.block_table[0, : len(pages_a)].tolist() == pages_a
    assert batch.block_table[0, :2].tolist() == cached  # the prefix's pages, read through it
    assert batch.block_table[1, : len(pages_b)].tolist() == pages_b
    assert batch.pages == [pages_a, pages_b]
    while engine.has_unfinished:
        engine.step()
    engine.drain()
    ref = Engine(_runner(), "eager", prefix_caching=False)
    assert [engine.finished[r].output for r in (a, b)] == ref.generate([head + tail, other], 2)
    _assert_no_leak(engine)


def test_written_tokens_leave_out_the_last_sampled_token():
    engine = _engine(True)
    rid = engine.add_request(list(range(1, 20)), 4)
    engine.step()
    req = engine.running[0]
    assert written_tokens(req) == list(range(1, 20))  # prefilled; its first token in flight
    req.output, req.scheduled = [7, 8], 3  # two landed, a third in flight: 7 and 8 fed
    assert written_tokens(req) == list(range(1, 20)) + [7, 8]
    req.scheduled = 2  # nothing in flight: 8 was never fed
    assert written_tokens(req) == list(range(1, 20)) + [7]
    engine.abort(rid)
    engine.drain()


@pytest.mark.parametrize("overlap", [False, True])
def test_aborts_leak_nothing(overlap):
    mix = _mix(7)
    for at in (2, 3, 5, 8, 11):
        engine = _engine(True, overlap=overlap, max_prefill_tokens=16)
        _drive(engine, mix, abort=(at, at % 4))
        _assert_no_leak(engine)


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_a_fault_mid_prefill_that_reads_cached_pages_leaks_nothing(mode):
    g = torch.Generator().manual_seed(4)
    head = _tokens(g, 48)
    engine = _engine(True, mode, max_prefill_tokens=20)
    want = Engine(_runner(), "eager", prefix_caching=False).generate([head + [5, 6, 7]], 4)
    engine.generate([head + _tokens(g, 3)], 2)  # head's three pages are cached
    assert engine.prefix_cache.num_cached >= 3
    mr = engine.model_runner
    forward, calls = mr.model.forward, {"n": 0}

    def faulty(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected fault")
        return forward(*args, **kwargs)

    mr.model.forward = faulty
    rids = [engine.add_request(head + _tokens(g, 30), 4) for _ in range(2)]
    engine.step()  # the first chunk, after the cached 48 tokens
    assert all(r.cached_tokens == 48 for r in engine.running)
    with time_limit(30), pytest.raises(RuntimeError, match="injected fault"):
        while engine.has_unfinished:
            engine.step()
    assert not engine.has_unfinished and all(r not in engine.finished for r in rids)
    _assert_no_leak(engine)  # nothing referenced, and the cache was dropped
    del mr.model.forward
    assert engine.generate([head + [5, 6, 7]], 4) == want


def test_eviction_under_memory_pressure_takes_only_unreferenced_pages():
    """14 usable pages; 12 prompts of 3-4 pages each, some sharing: far more than the cache
    holds together. Every request finishes with the tokens of caching off, and an evicted page
    is never one a running request holds."""
    g = torch.Generator().manual_seed(6)
    heads = [_tokens(g, 33), _tokens(g, 20)]
    prompts = [heads[i % 2] + _tokens(g, 10 + i) for i in range(12)]
    mix = [(i, p, 6) for i, p in enumerate(prompts)]
    want = _drive(_engine(False, num_pages=15), mix)
    engine = _engine(True, num_pages=15)
    cache = engine.prefix_cache
    evict, evicted = cache._tree.evict_leaves, []

    def checked_evict(n):
        pages = evict(n)
        held = {p for r in engine.running for p in r.pages}
        assert not held & set(pages) and not any(map(cache.refcount, pages))
        evicted.extend(pages)
        return pages

    cache._tree.evict_leaves = checked_evict
    assert _drive(engine, mix) == want
    assert evicted and cache.stats.evictions == len(evicted)
    assert engine.stats.cached_tokens > 0
    _assert_no_leak(engine)


def test_a_different_cache_salt_never_hits():
    g = torch.Generator().manual_seed(8)
    prompt = _tokens(g, 40)
    engine = _engine(True)
    a = engine.add_request(prompt, 3, cache_salt="tenant-a")
    while engine.has_unfinished:
        engine.step()
    hits = []
    for salt in ("tenant-b", None, "", "tenant-a"):
        rid = engine.add_request(prompt, 3, cache_salt=salt)
        engine.step()
        hits.append(engine.running[0].cached_tokens)
        while engine.has_unfinished:
            engine.step()
        assert engine.finished[rid].output == engine.finished[a].output
    # another salt, none and the empty string each miss (then cache their own pages)
    assert hits == [0, 0, 0, 32]
    _assert_no_leak(engine)


def test_engines_over_one_model_runner_share_one_cache():
    mr = _runner()
    g = torch.Generator().manual_seed(9)
    prompt = _tokens(g, 40)
    first = Engine(mr, "eager")
    out = first.generate([prompt], 3)
    second = Engine(mr, "eager")
    assert second.prefix_cache is first.prefix_cache
    assert second.generate([prompt], 3) == out and second.stats.cached_tokens == 32
    off = Engine(mr, "eager", prefix_caching=False)  # evicts what it needs, matches nothing
    assert off.generate([prompt], 3) == out and off.stats.cached_tokens == 0
    second.shutdown()  # drops the unreferenced pages
    assert mr.kv_cache.allocator.num_free == mr.kv_cache.num_pages - 1
