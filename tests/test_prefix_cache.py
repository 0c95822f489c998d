"""The prefix cache as pure host logic: matches of full pages only (the last token left to
recompute), tenants kept apart by cache_salt, reference counts that never leak, eviction of
unreferenced pages only (least recently released, leaves first), admission's page count at the
limit and one past it, and a random operation fuzz against a reference model of token
prefixes -> pages that checks every match and every eviction."""

from __future__ import annotations

import importlib.util
import json
import random
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from stepgraph.engine.prefix_cache import PrefixCache
from stepgraph.engine.scheduler import admit_count
from stepgraph.errors import ConfigError
from stepgraph.model.kv_cache import PageAllocator

PS = 16


def cache(usable: int, page_size: int = PS, **kw) -> PrefixCache:
    return PrefixCache(PageAllocator(usable + 1), page_size, **kw)


def toks(n: int, rng: random.Random | None = None) -> list[int]:
    rng = rng or random.Random(n)
    return [rng.randrange(50_000) for _ in range(n)]


def finish(c: PrefixCache, tokens: list[int], pages: list[int], salt=None) -> None:
    c.insert(tokens, pages, salt)
    c.release(pages)


def computed(c: PrefixCache, tokens: list[int], salt=None, extra_pages: int = 0) -> list[int]:
    """A request that ran ``tokens`` (all KV written), cached and released: its pages."""
    r = c.reserve(tokens, -(-len(tokens) // c.page_size) + extra_pages, salt)
    finish(c, tokens, r.pages, salt)
    return r.pages


# -- matches at the page limits --------------------------------------------------------------
@pytest.mark.parametrize(
    "n, want, want_all",  # want: pages matched for a prefill; want_all: recompute_last=False
    [(PS - 1, 0, 0), (PS, 0, 1), (PS + 1, 1, 1), (2 * PS - 1, 1, 1), (2 * PS, 1, 2)],
)
def test_a_cached_prompt_matches_whole_pages_and_leaves_its_last_token(n, want, want_all):
    c = cache(8)
    prompt = toks(3 * PS)[:n]
    pages = computed(c, toks(3 * PS))  # the same tokens, longer: every page of ours cached
    m = c.match(prompt)
    assert (m.pages, m.num_tokens, m.query_tokens) == (pages[:want], want * PS, n)
    assert c.match(prompt, recompute_last=False).pages == pages[:want_all]
    got_pages, got_tokens = m  # unpacks as (pages, num_cached_tokens)
    assert (got_pages, got_tokens) == (pages[:want], want * PS)


def test_an_empty_prompt_matches_nothing():
    c = cache(2)
    computed(c, toks(PS))
    for recompute_last in (True, False):
        assert tuple(c.match([], recompute_last=recompute_last)) == ([], 0)


def test_a_fully_cached_prompt_recomputes_its_last_page_into_a_private_one():
    c = cache(8)
    prompt = toks(2 * PS)
    first = computed(c, prompt)
    r = c.reserve(prompt, 2)
    assert r.num_cached_tokens == PS and r.pages[0] == first[0] and r.pages[1] != first[1]
    finish(c, prompt, r.pages)  # its last page duplicates a cached one: freed, not cached
    assert c.num_cached == 2 and c.num_free == 6
    c.check()


def test_a_miss_stops_at_the_first_page_that_differs():
    c = cache(8)
    a = toks(4 * PS)
    pages = computed(c, a)
    b = a[: 2 * PS] + [a[2 * PS] + 1] + a[2 * PS + 1 :]
    assert c.match(b).pages == pages[:2]
    assert c.match([a[0] + 1] + a[1:]).pages == []


def test_tokens_as_a_numpy_array_match_as_a_list():
    c = cache(8)
    prompt = toks(3 * PS)
    pages = computed(c, prompt)
    assert c.match(np.array(prompt, dtype=np.int64)).pages == pages[:2]
    with pytest.raises(ConfigError, match="list of token ids"):
        c.match("abc")


# -- tenants ---------------------------------------------------------------------------------
def test_a_different_salt_never_hits():
    c = cache(16)
    prompt = toks(3 * PS)
    pages = computed(c, prompt, salt="tenant-a")
    assert c.match(prompt, "tenant-a").pages == pages[:2]
    for other in (None, "", "tenant-b", "tenant-a "):
        assert c.match(prompt, other).pages == []
    other_pages = computed(c, prompt, salt="tenant-b")  # its own pages, cached apart
    assert not set(other_pages) & set(pages)
    assert c.match(prompt, "tenant-b").pages == other_pages[:2]
    with pytest.raises(ConfigError, match="cache_salt must be a string"):
        c.match(prompt, 7)


def test_the_model_is_part_of_the_namespace():
    alloc = PageAllocator(9)
    a = PrefixCache(alloc, PS, model="llama-3.2-1b")
    prompt = toks(3 * PS)
    computed(a, prompt)
    a.model = "qwen2.5-0.5b"  # the same pages seen as another model's
    assert a.match(prompt).pages == []


# -- reference counts ------------------------------------------------------------------------
def test_double_release_raises_and_changes_nothing():
    c = cache(8)
    prompt = toks(2 * PS + 3)
    r = c.reserve(prompt, 3)
    finish(c, prompt, r.pages)
    before = (c.num_free, c.num_cached, c.num_evictable)
    with pytest.raises(ConfigError, match="double release"):
        c.release(r.pages)
    with pytest.raises(ConfigError, match="double release"):
        c.release([r.pages[0], r.pages[0]])  # held once by nobody, released twice
    assert (c.num_free, c.num_cached, c.num_evictable) == before
    c.check()


def test_shared_pages_count_every_holder():
    c = cache(8)
    prompt = toks(3 * PS)
    pages = computed(c, prompt)
    a, b = c.reserve(prompt, 3), c.reserve(prompt, 3)
    assert a.pages[:2] == b.pages[:2] == pages[:2]
    assert [c.refcount(p) for p in pages[:2]] == [2, 2]
    assert c.num_evictable == 1  # the third page only: referenced pages are never evicted
    c.release(a.pages)
    assert [c.refcount(p) for p in pages[:2]] == [1, 1] and c.num_evictable == 1
    c.release(b.pages)
    assert c.num_evictable == 3 and c.clear() == 3 and c.num_free == 8
    c.check()


def test_acquire_refuses_pages_that_are_not_cached_and_a_stale_match():
    c = cache(4)
    prompt = toks(3 * PS)
    private = c.allocate(1)
    with pytest.raises(ConfigError, match="not cached"):
        c.acquire(private)
    c.release(private)
    computed(c, prompt)
    m = c.match(prompt)
    assert len(m.pages) == 2
    c.allocate(4)  # evicts every cached page: the match is stale
    with pytest.raises(ConfigError, match="evicted since"):
        c.acquire(m)
    c.check()


# -- insert ----------------------------------------------------------------------------------
def test_insert_twice_is_a_no_op_and_insert_as_pages_fill_caches_each_once():
    c = cache(8)
    prompt, out = toks(PS + 5), toks(2 * PS, random.Random(1))
    r = c.reserve(prompt, 4)
    assert c.insert(prompt, r.pages) == 1
    assert c.insert(prompt, r.pages) == 0
    assert c.insert(prompt + out[:PS], r.pages) == 1  # generated tokens fill the second page
    assert c.insert(prompt + out, r.pages) == 1
    c.release(r.pages)
    assert c.match(prompt + out + [1]).pages == r.pages[:3]
    c.check()


def test_the_same_prompt_computed_twice_keeps_one_copy_and_frees_the_other():
    c = cache(8)
    prompt = toks(2 * PS + 1)
    a, b = c.reserve(prompt, 3), c.reserve(prompt, 3)  # both admitted before either finished
    finish(c, prompt, a.pages)
    finish(c, prompt, b.pages)
    assert c.num_cached == 2 and c.num_free == 6
    assert c.match(prompt).pages == a.pages[:2]
    c.clear()
    assert c.num_free == 8
    c.check()


def test_insert_refuses_bad_input_and_changes_nothing():
    c = cache(8)
    prompt = toks(2 * PS)
    r = c.reserve(prompt, 2)
    c.insert(prompt, r.pages)
    other = c.allocate(1)
    with pytest.raises(ConfigError, match="cached for other tokens"):
        c.insert(toks(2 * PS, random.Random(9)), r.pages)
    with pytest.raises(ConfigError, match="repeats a page"):
        c.insert(toks(2 * PS, random.Random(9)), other * 2)
    c.release(other)
    with pytest.raises(ConfigError, match="not held"):
        c.insert(toks(PS, random.Random(9)), other)
    assert c.num_cached == 2
    c.release(r.pages)
    c.check()


# -- eviction --------------------------------------------------------------------------------
def test_allocate_takes_free_pages_first_then_the_least_recently_released_leaf():
    c = cache(6)
    a, b = computed(c, toks(2 * PS)), computed(c, toks(2 * PS, random.Random(2)))
    assert c.num_free == 2 and c.num_available == 6
    assert sorted(c.allocate(2)) == sorted(set(range(1, 7)) - set(a) - set(b))
    assert c.stats.evictions == 0
    order = [c.allocate(1)[0] for _ in range(4)]
    assert order == [a[1], a[0], b[1], b[0]]  # a released first; leaves before parents
    assert c.stats.evictions == 4 and c.num_cached == 0
    with pytest.raises(ConfigError, match="0 available pages"):
        c.allocate(1)
    c.check()


def test_a_parent_released_before_its_child_is_evicted_after_it():
    c = cache(4)
    prompt = toks(2 * PS)
    q = computed(c, prompt[:PS])[0]  # released first: the older stamp
    twin = c.allocate(2)  # a request computed both pages itself, page one duplicating q's
    c.insert(prompt, twin)  # its first page stays private, its second is cached under q
    assert c.match(prompt, recompute_last=False).pages == [q, twin[1]]
    assert c.num_evictable == 0  # q is not referenced, but its child is: blocked
    c.check()
    c.release(twin)
    assert c.num_evictable == 2
    c.allocate(2)  # the free pages first (the private twin among them)
    assert c.stats.evictions == 0
    assert c.allocate(1) == [twin[1]] and c.allocate(1) == [q]
    c.check()


@pytest.mark.parametrize("seed", range(6))
def test_evicting_many_leaves_at_once_takes_them_in_the_order_one_at_a_time_does(seed):
    """``evict_leaves(n)`` (a parent that becomes the least recent leaf taken next, past the
    heap) against ``evict_leaf`` n times on a twin: the same pages, in the same order, for every
    n from 0 to all that are evictable; released chains share a stamp, so ties are common."""
    rng = random.Random(seed)
    many, one = cache(120), cache(120)
    heads = [toks(2 * PS, rng) for _ in range(3)]
    for _ in range(14):  # chains released together, branching off shared heads, or a head
        head = rng.choice(heads)[: rng.choice((0, PS, 2 * PS))]  # released again alone (a
        prompt = head + toks(rng.randrange(1, 5) * PS, rng)  # parent newer than its leaves)
        prompt = head + [7] if head and rng.random() < 0.4 else prompt
        computed(many, prompt)
        computed(one, prompt)
    held = [c.reserve(heads[0], 3) for c in (many, one)]  # a head's pages stay blocked
    total, evicted = many.num_evictable, []
    assert total == one.num_evictable > 0
    while len(evicted) < total:
        n = min(rng.randrange(0, 6), total - len(evicted))
        pages = many._tree.evict_leaves(n)
        assert pages == [one._tree.evict_leaf() for _ in range(n)]
        evicted += pages
    assert many.num_evictable == one.num_evictable == 0
    for c, r in zip((many, one), held):
        c.allocator.free(evicted)  # evicted pages are the allocator's again
        c.release(r.pages)
        c.check()


def test_pressure_evicts_only_unreferenced_pages():
    c = cache(10)
    rng = random.Random(3)
    held_prompt = toks(3 * PS, rng)
    held = c.reserve(held_prompt, 3)
    c.insert(held_prompt, held.pages)
    for _ in range(20):  # prompts that together exceed the cache many times over
        prompt = toks(2 * PS + 1, rng)
        r = c.reserve(prompt, 3)
        assert not set(r.pages) & set(held.pages)
        finish(c, prompt, r.pages)
        c.check()
    assert all(c.refcount(p) == 1 for p in held.pages)
    c.release(held.pages)
    c.clear()
    assert c.num_free == 10


# -- admission's count -----------------------------------------------------------------------
def test_reserve_fits_a_cache_of_exactly_the_pages_needed_and_refuses_one_more():
    c = cache(4)
    pages = computed(c, toks(4 * PS))  # all four pages cached, none free
    prompt = toks(4 * PS)[: 3 * PS + 1]
    assert c.num_free == 0 and c.num_available == 4
    m = c.match(prompt)
    assert c.pages_to_allocate(m, 4) == 1
    assert c.admission_cost(m, 4) == 4  # its three matched pages leave the evictable count
    r = c.reserve(prompt, 4)
    assert r.num_cached_tokens == 3 * PS and r.pages[:3] == pages[:3]
    assert c.stats.evictions == 1  # the fourth cached page: its new last page
    c.release(r.pages)
    c.check()
    with pytest.raises(ConfigError, match="needs 5 more KV pages, 4 are available"):
        c.reserve(prompt, 5)
    assert c.num_available == 4 and all(c.refcount(p) == 0 for p in range(1, 5))
    c.check()


def test_admission_cost_counts_only_new_pages_when_the_prefix_is_held():
    c = cache(6)
    prompt = toks(2 * PS + 1)
    holder = c.reserve(prompt, 3)
    c.insert(prompt, holder.pages)
    m = c.match(prompt)
    assert c.admission_cost(m, 3) == c.pages_to_allocate(m, 3) == 1
    c.release(holder.pages)
    assert c.admission_cost(m, 3) == 3


@pytest.mark.parametrize("seed", range(30))
def test_costs_summed_before_admission_fit_every_reserve_in_turn(seed):
    rng = random.Random(seed)
    ps = rng.choice([2, 4])
    c = cache(rng.randrange(8, 24), ps)
    bases = [[rng.randrange(3) for _ in range(rng.randrange(ps, 5 * ps))] for _ in range(3)]
    prompt = lambda: rng.choice(bases) + [rng.randrange(3) for _ in range(rng.randrange(3))]  # noqa: E731
    for _ in range(rng.randrange(1, 6)):  # some finished requests' pages stay cached
        p = prompt()
        if c.admission_cost(c.match(p), -(-len(p) // ps)) <= c.num_available:
            computed(c, p)
    held = [c.reserve(p, -(-len(p) // ps)).pages for p in [prompt()] if len(p) < 3 * ps]
    waiting = [(p, -(-len(p) // ps) + rng.randrange(3)) for p in (prompt() for _ in range(6))]
    costs = [c.admission_cost(c.match(p), n) for p, n in waiting]
    count = admit_count(iter(costs), c.num_available, 0, None)
    for p, n in waiting[:count]:  # in turn, as the engine admits: none may fail
        held.append(c.reserve(p, n).pages)
        c.check()
    for pages in held:
        c.release(pages)
    c.clear()
    assert c.num_free == c.allocator.num_pages - 1


def test_reserve_checks_its_page_count():
    c = cache(4)
    with pytest.raises(ConfigError, match="cannot hold the 17 prompt tokens"):
        c.reserve(toks(PS + 1), 1)
    with pytest.raises(ConfigError, match="num_pages must be an integer >= 0"):
        c.reserve(toks(3), -1)
    assert c.num_free == 4


def test_check_catches_a_wrong_count():
    c = cache(4)
    prompt = toks(2 * PS + 1)
    r = c.reserve(prompt, 3)
    c.insert(prompt, r.pages)
    c.check()
    c._tree.pinned[r.pages[0]] = 0  # its held child no longer counted
    with pytest.raises(AssertionError, match="pinned is off"):
        c.check()
    c._tree.pinned[r.pages[0]] = 1
    c.allocator._free.append(r.pages[2])  # a held page also free
    with pytest.raises(AssertionError, match="also free"):
        c.check()


# -- stats and switches ----------------------------------------------------------------------
def test_stats_count_tokens_as_vllm():
    c = cache(8)
    prompt = toks(2 * PS + 4)
    computed(c, prompt)
    c.release(c.reserve(prompt, 3).pages)
    assert c.stats.as_dict() == {
        "requests": 2,
        "queries": 2 * len(prompt),
        "hits": 2 * PS,
        "evictions": 0,
        "hit_rate": 2 * PS / (2 * len(prompt)),
    }


def test_disabled_caches_nothing_and_frees_at_release():
    c = cache(4, enabled=False)
    prompt = toks(2 * PS + 1)
    computed(c, prompt)
    assert c.num_cached == 0 and c.num_free == 4 and c.match(prompt).pages == []
    assert c.stats.queries == 0
    c.check()


# -- random operations against a reference model ---------------------------------------------
class Reference:
    """What the cache must do, spelled out slowly: cached pages keyed by (salt, every token up
    to the page's end), references, release stamps; eviction picks the unreferenced leaf with
    the oldest stamp (then the lowest page id) whose subtree nothing references."""

    def __init__(self, page_size: int, usable: int) -> None:
        self.ps, self.usable = page_size, usable
        self.refs: Counter[int] = Counter()
        self.cached: dict[tuple, int] = {}
        self.key_of: dict[int, tuple] = {}
        self.stamp: dict[int, int] = {}
        self.clock = 0

    def match(self, tokens, salt, recompute_last=True) -> list[int]:
        limit = (len(tokens) - (1 if recompute_last else 0)) // self.ps
        pages = []
        while len(pages) < limit:
            page = self.cached.get((salt, tuple(tokens[: (len(pages) + 1) * self.ps])))
            if page is None:
                break
            pages.append(page)
        return pages

    def children(self, page: int) -> list[int]:
        salt, t = self.key_of[page]
        return [
            p
            for (s, u), p in self.cached.items()
            if s == salt and len(u) == len(t) + self.ps and u[: len(t)] == t
        ]

    def blocked(self, page: int) -> bool:
        return self.refs[page] > 0 or any(self.blocked(c) for c in self.children(page))

    def available(self) -> int:
        return self.free() + sum(not self.blocked(p) for p in self.key_of)

    def free(self) -> int:
        return self.usable - len({p for p, n in self.refs.items() if n} | set(self.key_of))

    def evict(self) -> int:
        leaves = [p for p in self.key_of if not self.blocked(p) and not self.children(p)]
        page = min(leaves, key=lambda p: (self.stamp[p], p))
        del self.cached[self.key_of.pop(page)]
        return page

    def allocated(self, pages: list[int], free_before: int) -> None:
        for i, page in enumerate(pages):
            if i < free_before:  # free pages first: never one that is held or cached
                assert self.refs[page] == 0 and page not in self.key_of
            else:
                assert page == self.evict(), "not the least recently released leaf"
            self.refs[page] += 1

    def released(self, pages: list[int]) -> None:
        self.clock += 1
        for page in pages:
            self.refs[page] -= 1
            if self.refs[page] == 0 and page in self.key_of:
                self.stamp[page] = self.clock

    def inserted(self, tokens, pages, salt) -> None:
        for i in range(min(len(tokens) // self.ps, len(pages))):
            key = (salt, tuple(tokens[: (i + 1) * self.ps]))
            if pages[i] not in self.key_of and key not in self.cached:
                self.cached[key] = pages[i]
                self.key_of[pages[i]] = key
                self.stamp[pages[i]] = self.clock


def agree(c: PrefixCache, ref: Reference) -> None:
    c.check()
    assert c.num_cached == len(ref.key_of)
    assert c.num_free == ref.free()
    assert c.num_available == ref.available()


def check_random_operations(seed: int, steps: int) -> None:
    rng = random.Random(seed)
    ps, usable, vocab = rng.choice([1, 2, 4]), rng.randrange(6, 30), rng.choice([2, 3, 50])
    c, ref = PrefixCache(PageAllocator(usable + 1), ps), Reference(ps, usable)
    word = lambda n: [rng.randrange(vocab) for _ in range(n)]  # noqa: E731
    bases = [word(rng.randrange(0, 6 * ps)) for _ in range(4)]
    running: list[dict] = []
    finished: list[list[int]] = []
    for _ in range(steps):
        op = rng.random()
        if op < 0.35:  # admit
            prompt = rng.choice(bases) + word(rng.randrange(0, 3 * ps)) or [0]
            salt = rng.choice([None, "a"])
            kv = len(prompt) + rng.randrange(0, 2 * ps)
            num_pages = -(-kv // ps)
            m = c.match(prompt, salt)
            want = ref.match(prompt, salt)
            assert m.pages == want and m.num_tokens == len(want) * ps
            cost = num_pages - sum(ref.blocked(p) for p in want)
            assert c.admission_cost(m, num_pages) == cost
            free_before, available = ref.free(), ref.available()
            if cost > available:
                with pytest.raises(ConfigError, match="more KV pages"):
                    c.reserve(prompt, num_pages, salt)
                continue
            if rng.random() < 0.5:
                pages = c.reserve(prompt, num_pages, salt).pages
            else:  # the steps reserve takes, one by one
                pages = c.acquire(m)
                pages += c.allocate(c.pages_to_allocate(m, num_pages))
            assert pages[: len(want)] == want
            for page in want:
                ref.refs[page] += 1
            ref.allocated(pages[len(want) :], free_before)
            running.append(dict(tokens=list(prompt), pages=pages, salt=salt, cap=kv))
        elif op < 0.5 and running:  # decode a few tokens; maybe cache the pages they filled
            req = rng.choice(running)
            req["tokens"] += word(rng.randrange(0, req["cap"] + 2 - len(req["tokens"])))
            if rng.random() < 0.5:
                written = req["tokens"][: len(req["tokens"]) - 1]
                c.insert(written, req["pages"], req["salt"])
                ref.inserted(written, req["pages"], req["salt"])
        elif op < 0.8 and running:  # finish (cache, release) or abort (release)
            req = running.pop(rng.randrange(len(running)))
            if op < 0.72:
                written = req["tokens"][: len(req["tokens"]) - 1]
                c.insert(written, req["pages"], req["salt"])
                ref.inserted(written, req["pages"], req["salt"])
            c.release(req["pages"])
            ref.released(req["pages"])
            finished.append(req["pages"])
        elif op < 0.85:
            n = c.clear()
            dropped = 0
            while any(not ref.blocked(p) for p in ref.key_of):
                ref.evict()
                dropped += 1
            assert n == dropped
        elif op < 0.9 and finished:  # a request's pages released again, none held now
            pages = rng.choice(finished)
            if all(ref.refs[p] == 0 for p in pages):
                with pytest.raises(ConfigError, match="double release"):
                    c.release(pages)
        else:  # a probe of any prefix, whole pages included
            probe = rng.choice(bases) + word(rng.randrange(0, 2 * ps))
            salt = rng.choice([None, "a"])
            assert c.match(probe, salt, recompute_last=False).pages == ref.match(
                probe, salt, recompute_last=False
            )
        agree(c, ref)
    for req in running:
        c.release(req["pages"])
    c.clear()
    assert c.num_free == usable and c.num_cached == 0  # nothing leaked
    c.check()


@pytest.mark.parametrize("seed", range(40))
def test_random_operations_match_the_reference_model(seed):
    check_random_operations(seed, 250)


def test_the_lookup_benchmark_runs_and_reports_every_length(tmp_path):
    spec = importlib.util.spec_from_file_location(
        "prefix_lookup", Path(__file__).resolve().parents[1] / "benchmarks" / "prefix_lookup.py"
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "lookup.json"
    assert bench.main(["--repeat", "3", "--json", str(out)]) in (0, 1)  # 1: over the target
    rows = json.loads(out.read_text())["rows"]
    assert [r["tokens"] for r in rows] == [1024, 8192, 32768]
    for r in rows:
        assert 0 < r["match_miss_us"] and 0 < r["match_hit_us"] <= r["match_hit_median_us"]


def test_cached_pages_add_nothing_the_garbage_collector_walks():
    """A cached page's record lives in dicts of ints, not an object of its own, and its key's
    tuples are untracked by the collector's passes: 300 cached pages add only the cache's own
    few containers to what a full pass walks (an object a page made it 300 more). Evicting
    them all keeps the invariants and leaks no page."""
    import gc

    gc.collect()
    before = len(gc.get_objects())
    c = cache(330)
    rng = random.Random(5)
    for _ in range(30):  # 30 requests of 10 full pages (and one more token), cached
        computed(c, toks(10 * PS + 1, rng))
    assert c.num_cached == 300
    gc.collect()  # a key whose tuple of tokens it met after the key is untracked the next pass
    gc.collect()
    assert len(gc.get_objects()) - before < 30
    held = c.allocate(330)  # evicts every cached page, least recently released first
    c.check()
    assert c.num_cached == 0 and c.num_available == 0
    c.release(held)
    c.check()
    assert c.num_free == 330


def test_the_lookup_benchmark_measures_the_collectors_passes(tmp_path):
    spec = importlib.util.spec_from_file_location(
        "prefix_lookup", Path(__file__).resolve().parents[1] / "benchmarks" / "prefix_lookup.py"
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    row = bench.gc_cost(500, PS)
    assert row["cached_pages"] == 500 and row["objects_added"] < 30
    keys = ("frozen_empty_ms", "frozen_cached_ms", "frozen_after_inserts_ms", "cached_ms")
    for key in (*keys, "empty_ms"):
        assert len(row[key]) == 7 and all(ms >= 0 for ms in row[key])
    import gc

    assert gc.get_freeze_count() == 0  # the heap it froze is thawed again
