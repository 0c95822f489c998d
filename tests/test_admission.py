"""The engine's admission on the CPU (tiny preset, float32): a request whose prefix a request
admitted before it is computing waits, then starts the step after those pages are cached and
finds them; requests wait in the queue while this step's prefill budget is spent; a step that
also decodes prefills at most ``max_prefill_tokens_with_decode``; the tokens equal caching off
and every cap; a waiting request's lookup is kept until the cache changes, and continues after
the pages it found; the cache's version, the bisected admission cost and a resumed insert
against their plain counterparts."""

from __future__ import annotations

import random

import pytest
import torch

from stepgraph.engine import Engine
from stepgraph.engine.prefix_cache import PrefixCache
from stepgraph.errors import ConfigError
from stepgraph.model.kv_cache import PageAllocator

from .guards import time_limit
from .test_prefix_engine import PS, _assert_no_leak, _drive, _engine, _mix, _runner, _tokens


def _state(engine: Engine) -> tuple[list[int], list[int]]:
    return [r.rid for r in engine.running], [r.rid for r in engine.waiting]


def test_a_group_mate_waits_for_the_prefix_being_computed_then_finds_it():
    g = torch.Generator().manual_seed(4)
    head = _tokens(g, 3 * PS)
    prompts = [head + _tokens(g, 10), head + _tokens(g, 12), _tokens(g, 30)]
    engine = _engine(True)
    rids = [engine.add_request(p, 4) for p in prompts]
    engine.step()
    # the second's first uncached page is the first's page 0, being computed: it waits, and
    # the third waits behind it (first come, first served)
    assert _state(engine) == ([rids[0]], rids[1:])
    assert engine.running[0].cached_tokens == 0
    engine.step()  # the first's pages are cached now: the second finds them
    assert _state(engine) == (rids, [])
    assert [r.cached_tokens for r in engine.running] == [0, 3 * PS, 0]
    while engine.has_unfinished:
        engine.step()
    want = _engine(False).generate(prompts, 4)
    assert [engine.finished[r].output for r in rids] == want
    assert engine.stats.cached_tokens == 3 * PS
    _assert_no_leak(engine)


def test_a_request_waits_in_the_queue_while_the_budget_is_spent():
    g = torch.Generator().manual_seed(5)
    prompts = [_tokens(g, 20) for _ in range(3)]
    engine = _engine(False, max_prefill_tokens=40, max_prefill_tokens_with_decode=None)
    rids = [engine.add_request(p, 3) for p in prompts]
    engine.step()  # 20 + 20 tokens: the budget exactly; the third waits in the queue
    assert _state(engine) == (rids[:2], rids[2:])
    assert engine.stats.prefill_tokens == 40
    engine = _engine(False, max_prefill_tokens=41, max_prefill_tokens_with_decode=None)
    rids = [engine.add_request(p, 3) for p in prompts]
    engine.step()  # one token left: the third starts with a chunk of one token
    assert _state(engine) == (rids, [])
    assert engine.stats.prefill_tokens == 41
    assert [r.prefilled for r in engine.running] == [20, 20, 1]


def test_a_step_that_decodes_prefills_at_most_the_cap():
    g = torch.Generator().manual_seed(6)
    short, long_ = _tokens(g, 5), _tokens(g, 100)
    outs = {}
    for cap in (16, 17, None):
        engine = _engine(True, max_prefill_tokens_with_decode=cap)
        a = engine.add_request(short, 12)
        engine.step()  # nothing decodes yet: the whole budget (the short prompt)
        b = engine.add_request(long_, 4)
        per_step = []
        while engine.has_unfinished:
            before = engine.stats.prefill_tokens
            engine.step()
            per_step.append(engine.stats.prefill_tokens - before)
        assert sum(per_step) == 100
        most = 100 if cap is None else cap
        assert max(per_step) == most  # while the short one decodes: at most the cap a step
        outs[cap] = [engine.finished[a].output, engine.finished[b].output]
        _assert_no_leak(engine)
    assert outs[16] == outs[17] == outs[None]
    engine = _engine(True, max_prefill_tokens_with_decode=16)
    engine.add_request(long_, 2)
    engine.step()  # alone, nothing decoding: the whole prompt in one step
    assert engine.stats.prefill_tokens == 100


@pytest.mark.parametrize("cap", [4, 16, None])
@pytest.mark.parametrize("seed", range(2))
def test_tokens_equal_caching_off_under_every_cap(cap, seed):
    mix = _mix(seed + 10)
    want = _drive(_engine(False, max_prefill_tokens=40, max_prefill_tokens_with_decode=None), mix)
    engine = _engine(True, max_prefill_tokens=40, max_prefill_tokens_with_decode=cap)
    with time_limit(60):
        assert _drive(engine, mix) == want
    assert engine.stats.cached_tokens > 0
    _assert_no_leak(engine)


def test_the_cap_is_checked():
    with pytest.raises(ConfigError, match="max_prefill_tokens_with_decode must be an integer"):
        Engine(_runner(), "eager", max_prefill_tokens_with_decode=0)
    assert Engine(_runner(), "eager").max_prefill_tokens_with_decode == 2048


def test_a_waiting_request_is_not_looked_up_again_until_the_cache_changes():
    g = torch.Generator().manual_seed(7)
    head = _tokens(g, 4 * PS)
    engine = _engine(True, num_pages=10)  # 9 pages to use
    engine.generate([head + [1]], 2)  # head's 4 pages cached
    cache = engine.prefix_cache
    calls = []
    match = cache.match
    cache.match = lambda *a, **k: (calls.append(k.get("since")), match(*a, **k))[1]
    a = engine.add_request(head + [2], 40)  # head's pages and 3 more: 2 pages stay free
    b = engine.add_request(head + _tokens(g, 40), 20)  # 4 more pages: waits for a's
    engine.step()
    assert _state(engine) == ([a], [b]) and len(calls) == 2
    calls.clear()
    for _ in range(30):  # a decodes; the cache does not change: b is not looked up again
        engine.step()
        assert _state(engine) == ([a], [b])
    assert calls == []
    while engine.has_unfinished:
        engine.step()
    # a's pages were cached when it ended: b's lookup continued after the pages it had found
    assert len(calls) == 1 and len(calls[0].pages) == 4
    assert engine.finished[b].cached_tokens == 4 * PS
    _assert_no_leak(engine)


def _cache(num_pages: int = 40) -> PrefixCache:
    return PrefixCache(PageAllocator(num_pages), PS)


def test_the_version_changes_when_a_lookup_could_change():
    c = _cache(6)  # page 0 is reserved: 5 pages
    toks = list(range(1, 3 * PS + 2))
    v = c.version
    pages = c.allocate(4)
    c.insert(toks, pages)
    assert c.version == v + 1
    c.insert(toks, pages)  # nothing new cached
    assert c.version == v + 1
    c.release(pages)
    assert c.version == v + 1  # a release evicts nothing
    assert c.match(toks).version == c.version
    c.allocate(5)  # two free pages (the fourth was private), then three evictions
    assert c.version == v + 4
    assert c.allocate(0) == [] and c.version == v + 4


def test_a_continued_lookup_equals_a_fresh_one():
    rng = random.Random(0)
    c = _cache(64)
    toks = [rng.randrange(1, 50) for _ in range(6 * PS + 3)]
    first = c.match(toks)
    pages = c.allocate(3)
    c.insert(toks[: 2 * PS], pages)  # two pages cached since
    later = c.match(toks, since=first)
    assert later.pages == c.match(toks).pages == pages[:2]
    more = c.allocate(4)
    c.insert(toks[: 6 * PS], pages[:2] + more)
    again = c.match(toks, since=later)
    assert again.pages == c.match(toks).pages == pages[:2] + more
    assert again.keys == c.match(toks).keys
    c.release(pages + more)
    c.clear()  # evictions: the earlier match is stale and the lookup starts over
    assert c.match(toks, since=again).pages == []


def test_the_bisected_admission_cost_counts_the_blocked_pages():
    rng = random.Random(1)
    c = _cache(200)
    prompts, held = [], []
    for _ in range(60):
        if prompts and rng.random() < 0.5:
            base = rng.choice(prompts)
            toks = base[: rng.randrange(0, len(base) + 1)] + [rng.randrange(1, 9)] * 20
        else:
            toks = [rng.randrange(1, 9) for _ in range(rng.randrange(1, 6 * PS))]
        n = -(-len(toks) // PS) + 1
        if c.admission_cost(c.match(toks), n) > c.num_available:
            c.release(held.pop(0))
            continue
        pages, _ = c.reserve(toks, n)
        c.insert(toks, pages)
        prompts.append(toks)
        held.append(pages)
        if rng.random() < 0.4:
            c.release(held.pop(rng.randrange(len(held))))
        for p in prompts[-8:]:
            m = c.match(p)
            linear = sum(c._tree.is_blocked(page) for page in m.pages)
            assert c.admission_cost(m, 50) == 50 - linear
    c.check()


def test_a_resumed_insert_caches_what_a_whole_one_does():
    rng = random.Random(2)
    toks = [rng.randrange(1, 50) for _ in range(5 * PS + 7)]
    whole, parts = _cache(), _cache()
    a, b = whole.allocate(6), parts.allocate(6)
    assert whole.insert(toks, a) == 5
    assert parts.insert(toks[: 2 * PS + 3], b) == 2
    assert parts.insert(toks, b, start=2) == 3
    assert {k[1] for k in whole._tree.keys.values()} == {k[1] for k in parts._tree.keys.values()}
    assert parts.match(toks).num_tokens == whole.match(toks).num_tokens == 5 * PS
    wrong = _cache()
    w = wrong.allocate(6)
    wrong.insert(toks[: 2 * PS], w)
    other = [t + 1 for t in toks]
    with pytest.raises(ConfigError, match="cached for other tokens"):
        wrong.insert(other, w, start=2)  # a wrong start is not trusted: the walk starts over
    parts.check()
    whole.check()


def test_an_insert_refused_at_a_later_page_takes_back_the_keys_it_claimed():
    rng = random.Random(3)
    toks = [rng.randrange(1, 50) for _ in range(3 * PS)]
    c = _cache()
    held, gone = c.allocate(2), c.allocate(1)
    c.release(gone)
    with pytest.raises(ConfigError, match="not held"):
        c.insert(toks, held + gone)  # two pages checked and claimed, the third refused
    assert c.num_cached == 0 and c.version == 0 and c.match(toks).pages == []
    c.check()
    assert c.insert(toks[: 2 * PS], held) == 2  # the same pages cache once the call is right
    c.check()


def test_an_insert_from_an_offset_caches_what_a_whole_one_does_and_checks_the_offset():
    rng = random.Random(4)
    toks = [rng.randrange(1, 50) for _ in range(6 * PS + 5)]
    whole, parts = _cache(), _cache()
    a, b = whole.allocate(7), parts.allocate(7)
    assert whole.insert(toks, a) == 6
    assert parts.insert(toks[: 3 * PS], b) == 3
    # only the tokens from the page before the new ones: pages 2.. of the written tokens
    assert parts.insert(toks[2 * PS :], b, start=3, offset=2) == 3
    assert [k[1] for k in whole._tree.keys.values()] == [k[1] for k in parts._tree.keys.values()]
    assert parts.match(toks).num_tokens == whole.match(toks).num_tokens == 6 * PS
    assert parts.insert(toks[5 * PS :], b, start=6, offset=5) == 0  # nothing new
    for offset, start in ((3, 3), (6, 6), (7, 6)):  # at most start - 1: one past it refused
        with pytest.raises(ConfigError, match=r"offset=\d+ must be in \[1, start - 1\]"):
            parts.insert(toks[offset * PS :], b, start=start, offset=offset)
    with pytest.raises(ConfigError, match="is not cached with tokens"):  # wrong tokens
        parts.insert([t + 1 for t in toks[2 * PS :]], b, start=3, offset=2)
    parts.check()
    whole.check()


def test_the_engine_hands_in_only_the_pages_each_chunk_completed():
    """Chunks of 7 tokens: each insert gets the tokens of the page before the new ones and the
    new ones (at most 3 pages), never the whole prompt, resuming after the pages before; the
    cache ends as a whole insert leaves it, and the tokens equal caching off."""
    g = torch.Generator().manual_seed(5)
    prompt = _tokens(g, 5 * PS + 3)
    engine = _engine(True, max_prefill_tokens=7)
    cache = engine.prefix_cache
    seen = []
    insert = cache.insert

    def recording(tokens, pages, salt=None, **kw):
        seen.append((len(tokens), kw.get("start", 0), kw.get("offset", 0)))
        return insert(tokens, pages, salt, **kw)

    cache.insert = recording
    [out] = engine.generate([prompt], 20)
    assert out == _engine(False, max_prefill_tokens=7).generate([prompt], 20)[0]
    assert max(n for n, _, _ in seen) <= 3 * PS and len(seen) == 6  # once a page completed
    assert [s for _, s, _ in seen] == list(range(6))  # each resumed after the one before
    # the prompt and 20 outputs, the last never written: 5 * PS + 22 tokens, 6 full pages
    assert cache.num_cached == 6 and cache.match(prompt + out[:19]).num_tokens == 6 * PS
    _assert_no_leak(engine)


def test_an_insert_after_a_private_page_walks_from_the_first_page():
    """A request's page whose tokens another page cached first stays private; its next insert
    cannot resume under it, so it hands in every written token and walks from the first."""
    from stepgraph.engine.cache_use import EngineCache
    from stepgraph.engine.requests import Request

    g = torch.Generator().manual_seed(6)
    prompt = _tokens(g, 4 * PS + 1)
    mr = _runner()
    ec = EngineCache(mr, True)
    other = ec.cache.allocate(2)
    ec.cache.insert(prompt[: 2 * PS], other)  # the first two pages, cached by another request
    req = Request(0, prompt, 4)
    req.pages = ec.cache.allocate(5)  # computed again (as if admitted before they were cached)
    seen = []
    insert = ec.cache.insert
    ec.cache.insert = lambda t, p, s=None, **kw: (seen.append((len(t), kw)), insert(t, p, s, **kw))
    req.prefilled = 2 * PS
    ec.insert(req)  # both pages private
    req.prefilled = 4 * PS
    ec.insert(req)
    assert seen == [(2 * PS, {"start": 0, "offset": 0}), (4 * PS, {"start": 2, "offset": 0})]
    assert ec.cache.num_cached == 4 and ec.cache.match(prompt).pages == other + req.pages[2:4]
    ec.cache.release(req.pages)
    ec.cache.release(other)
    ec.cache.check()
    assert ec.cache.clear() == 4
