"""Prefix caching over the paged KV cache: a prompt's full pages are computed once and shared.

A cached page is keyed by ``(parent, its page_size tokens)``: ``parent`` is the cached page
of the tokens before it, or, for a prompt's first page, the namespace ``(model, cache_salt)``.
The keys chain: a page matches only under the very page its prefix matched, so two tenants
(different salts) never share, and a dict lookup compares the tokens and the parent exactly on
a hash hit — a hash collision can never return another prompt's KV. (A radix tree of pages,
as SGLang's, stored as one dict; vLLM's hashed blocks, verified.) Parent ids stay valid
because a page is only evicted once no cached page lists it as parent (leaves first).

Page states: free (in the ``PageAllocator``), held (``acquire`` / ``allocate``: a reference
count, never evicted), cached and unreferenced (kept for a later match; evictable). A
request's last, partial page is never cached: only full pages are inserted, and shared pages
are read-only (a request writes only the pages after its match). A cached page whose subtree
holds a referenced page is *blocked*: not evictable. ``num_available`` counts free pages plus
unblocked cached ones; ``allocate`` takes free pages first, then evicts the least recently
released leaf.

The engine's use (all on its one thread):

1. admission: ``m = match(prompt, salt)``; ``admission_cost(m, num_pages)`` is what the
   request takes from ``num_available`` (compare the running sum with it, as
   ``scheduler.plan_admission`` does); then ``reserve(prompt, num_pages, salt, match=m)``
   (acquire, allocate the rest, or raise and take nothing; ``m`` is matched again if the cache
   changed since) gives the block table and the cached tokens. A match stays the longest
   while ``version`` is unchanged, and ``match(since=m)`` continues after ``m``'s pages.
2. prefill only ``prompt[num_cached_tokens:]`` (the chunked prefill's start offset). A fully
   cached prompt still recomputes its last page: ``match`` leaves the last token out
   (``recompute_last``), for its logits.
3. finish or abort: ``insert(tokens whose KV is written, pages, salt)``, then
   ``release(pages)`` (late, once no launched step writes them: insert first, while held;
   a later step that reads them runs after the writes, in stream order). After a device
   fault, release without inserting: the pages may hold anything.

The sum of several requests' ``admission_cost``, all taken before any is admitted, never
undercounts what reserving them in turn takes: a matched page an earlier one references
first costs nothing more, one it evicts costs what a new page does. Which pages match and
which are evicted depends on the operations alone, not on hash seeds: tensor-parallel ranks
agree.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from itertools import islice
from typing import Any

from ..errors import ConfigError
from ..model.kv_cache import PageAllocator
from .prefix_match import (
    PrefixCacheStats,
    PrefixMatch,
    Reservation,
    check_count,
    check_salt,
    token_list,
)
from .prefix_tree import PageTree


def page_tokens(tokens: Sequence[int], page_size: int) -> Iterator[tuple[int, ...]]:
    """The tokens of each full page, as tuples, lazily (one C loop: no slice per page)."""
    return zip(*[iter(tokens)] * page_size)


class PrefixCache:
    """Shared, reference-counted KV pages over ``allocator`` (module docstring). ``model``
    names the weights the pages hold; ``enabled=False`` caches nothing (``match`` finds
    nothing, ``insert`` keeps nothing) and leaves only the reference counts."""

    def __init__(
        self,
        allocator: PageAllocator,
        page_size: int = 16,
        *,
        model: str = "",
        enabled: bool = True,
    ) -> None:
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
            raise ConfigError(f"page_size must be an integer >= 1, got {page_size!r}.")
        self.allocator = allocator
        self.page_size = page_size
        self.model = model
        self.enabled = enabled
        self.stats = PrefixCacheStats()
        self._tree = PageTree()
        self._inserts = 0  # insert calls that cached a page

    @property
    def version(self) -> int:
        """Changes whenever a lookup could find something else: a page cached, evicted or
        cleared. A ``match`` made at the same version is still the longest (the engine keeps
        a waiting request's lookup until it changes)."""
        return self._inserts + self._tree.epoch

    # -- counts --------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    @property
    def num_cached(self) -> int:
        return len(self._tree.keys)

    @property
    def num_evictable(self) -> int:
        return self._tree.evictable

    @property
    def epoch(self) -> int:
        """Evictions so far: a match made at the same epoch still holds every page it found."""
        return self._tree.epoch

    @property
    def num_available(self) -> int:
        """Pages ``allocate`` can hand out now: free ones, then evictable cached ones."""
        return self.allocator.num_free + self._tree.evictable

    def refcount(self, page: int) -> int:
        return self._tree.refs.get(page, 0)

    def is_cached(self, page: int) -> bool:
        return page in self._tree.keys

    # -- lookup and admission ------------------------------------------------------------
    def match(
        self,
        tokens: Sequence[int],
        salt: str | None = None,
        *,
        recompute_last: bool = True,
        since: PrefixMatch | None = None,
    ) -> PrefixMatch:
        """The longest cached full-page prefix of ``tokens`` under ``salt``. With
        ``recompute_last`` (the default, for a prompt about to be prefilled) the last token is
        left out, so at most ``(len(tokens) - 1) // page_size`` pages match: a prompt that is
        a whole number of pages recomputes its last page, and its last token's logits.
        ``since``: an earlier match of the same tokens, salt and ``recompute_last``; if
        nothing was evicted since (its ``epoch``), the lookup continues after its pages
        instead of from the first page (pages are only ever added then)."""
        check_salt(salt)
        toks = token_list(tokens)
        n, ps = len(toks), self.page_size
        limit = max(n - 1 if recompute_last else n, 0) // ps if self.enabled else 0
        pages: list[int] = []
        keys: list[tuple] = []
        parent: Any = (self.model, salt)
        if since is not None and since.epoch == self._tree.epoch and since.pages:
            pages, keys = list(since.pages), list(since.keys)
            parent = pages[-1]
            limit -= len(pages)
            toks = toks[len(pages) * ps :]
        get = self._tree.by_key.get
        for chunk in islice(page_tokens(toks, ps), limit):
            key = (parent, chunk)
            page = get(key)
            if page is None:
                break
            pages.append(page)
            keys.append(key)
            parent = page
        return PrefixMatch(pages, len(pages) * ps, n, self._tree.epoch, keys, self.version)

    def pages_to_allocate(self, match: PrefixMatch, num_pages: int) -> int:
        """New pages a request of ``num_pages`` pages needs beyond its match."""
        return num_pages - len(match.pages)

    def admission_cost(self, match: PrefixMatch, num_pages: int) -> int:
        """Pages admitting this request takes from ``num_available``: its new pages, plus the
        matched pages now evictable (referencing them takes them off the evictable count).
        Never less than the true cost, even after other admissions evict or share pages."""
        tree = self._tree
        if match.epoch == tree.epoch:  # nothing evicted since: every page still holds its key
            # a blocked page's parents are blocked (``prefix_tree``): the matched pages that
            # are blocked are a prefix of them, found by bisection
            pages, lo, hi = match.pages, 0, len(match.pages)
            while lo < hi:
                mid = (lo + hi) // 2
                if tree.is_blocked(pages[mid]):
                    lo = mid + 1
                else:
                    hi = mid
            return num_pages - lo
        shared = 0
        for page, key in zip(match.pages, match.keys):
            if tree.keys.get(page) == key and tree.is_blocked(page):
                shared += 1
        return num_pages - shared

    def reserve(
        self,
        tokens: Sequence[int],
        num_pages: int,
        salt: str | None = None,
        *,
        match: PrefixMatch | None = None,
    ) -> Reservation:
        """A request's pages at admission: its cached prefix (referenced), then new pages.
        Raises ``ConfigError`` and takes nothing if they do not fit in ``num_available``.
        ``match``: this request's lookup made at the cache's current ``version`` (else it is
        looked up again here)."""
        check_count(num_pages, "num_pages")
        if num_pages * self.page_size < len(tokens):
            raise ConfigError(
                f"num_pages={num_pages} pages of {self.page_size} tokens cannot hold the "
                f"{len(tokens)} prompt tokens; pass the pages of every token it will hold."
            )
        m = match if match is not None and match.version == self.version else None
        m = m if m is not None else self.match(tokens, salt)
        cost = self.admission_cost(m, num_pages)
        if cost > self.num_available:
            raise ConfigError(
                f"the request needs {cost} more KV pages, {self.num_available} are available "
                "(free or evictable); wait for running requests to finish, or build the cache "
                "with more pages."
            )
        pages = self.acquire(m)
        return Reservation(pages + self.allocate(num_pages - len(pages)), m.num_tokens)

    # -- references ----------------------------------------------------------------------
    def acquire(self, pages: PrefixMatch | Sequence[int]) -> list[int]:
        """Reference cached ``pages`` (a match, or page ids): never evicted until released.
        A match counts in ``stats`` (one query); one made stale by an eviction since is
        re-checked page by page, and refused if a page no longer holds its tokens."""
        if isinstance(pages, PrefixMatch):
            m = pages
            if m.epoch != self._tree.epoch:
                for page, key in zip(m.pages, m.keys):
                    if self._tree.keys.get(page) != key:
                        raise ConfigError(
                            f"page {page} of this match was evicted since it was made; call "
                            "match again (or use reserve, which matches and acquires at once)."
                        )
            if self.enabled:
                self.stats.requests += 1
                self.stats.queries += m.query_tokens
                self.stats.hits += m.num_tokens
            pages = m.pages
        else:
            pages = list(pages)
            bad = [p for p in pages if p not in self._tree.keys]
            if bad:
                raise ConfigError(
                    f"pages {bad} are not cached; only cached pages are shared (acquire the "
                    "pages of a match)."
                )
        self._tree.hold(pages)  # the prefix first: each parent is blocked before its child
        return list(pages)

    def release(self, pages: Sequence[int]) -> None:
        """Drop one reference to each page (a request's pages, all together). A cached page
        stays cached, evictable once nothing references it; any other page goes back to the
        allocator. Releasing a page more often than it is held raises and changes nothing."""
        tree = self._tree
        if len(set(pages)) == len(pages):
            bad = sorted(p for p in pages if p not in tree.refs)
        else:
            bad = sorted(p for p, n in Counter(pages).items() if tree.refs.get(p, 0) < n)
        if bad:
            raise ConfigError(
                f"pages {bad} are released more often than they are held (double release?); "
                "release each reference once."
            )
        tree.clock += 1
        freed = tree.drop(list(pages)[::-1], tree.clock)  # the tail first
        if freed:
            self.allocator.free(freed)

    def allocate(self, n: int) -> list[int]:
        """``n`` new pages, held (reference 1): free pages first, then the least recently
        released evictable leaves. ``ConfigError``, and nothing taken, past ``num_available``."""
        check_count(n, "the page count")
        if n > self.num_available:
            raise ConfigError(
                f"KV cache has {self.num_available} available pages (free or evictable), {n} "
                "needed; wait for running requests to finish, or build the cache with more pages."
            )
        pages = self.allocator.allocate(min(n, self.allocator.num_free))
        if len(pages) < n:
            evicted = self._tree.evict_leaves(n - len(pages))
            self.stats.evictions += len(evicted)
            pages += evicted
        self._tree.hold(pages)
        return pages

    # -- caching -------------------------------------------------------------------------
    def insert(
        self,
        tokens: Sequence[int],
        pages: Sequence[int],
        salt: str | None = None,
        *,
        start: int = 0,
        offset: int = 0,
    ) -> int:
        """Cache the full pages of a request: ``tokens`` are those whose KV is written in
        ``pages`` (prompt, then generated), ``pages`` its block table, still held. A page
        whose tokens are already cached in another page stays private (freed at release).
        Returns the pages newly cached. ``start``: an earlier insert of the same request
        covered its first ``start`` pages; the walk starts after them when ``pages[start-1]``
        is cached with those tokens (a held page stays cached), else at the first page.
        ``offset``: ``tokens`` leave out the first ``offset`` pages' tokens (``tokens[0]`` is
        the first token of page ``offset``), at most ``start - 1`` of them, so only what is new
        is handed in; then ``pages[start-1]`` must be cached with its tokens."""
        check_salt(salt)
        if not self.enabled:
            return 0
        toks, ps = token_list(tokens), self.page_size
        n = min(offset + len(toks) // ps, len(pages))
        if offset and not 0 < offset < start <= n:
            raise ConfigError(
                f"offset={offset} must be in [1, start - 1] (start={start}, {n} full pages); "
                "pass the tokens from the page before start on."
            )
        tree = self._tree
        parent: Any = (self.model, salt)
        first = 0
        if 0 < start <= n:
            page = pages[start - 1]
            cached = tree.keys.get(page)
            lo = (start - 1 - offset) * ps
            if cached is not None and cached[1] == tuple(toks[lo : lo + ps]):
                first, parent = start, page
            elif offset:
                raise ConfigError(
                    f"page {page} is not cached with tokens[{lo}:{lo + ps}] (start={start}); "
                    "pass every written token (offset=0)."
                )
        new = pages[first:n]
        if len(set(new)) != len(new) or (first and pages[first - 1] in new):
            raise ConfigError("pages repeats a page; pass the request's block table.")
        refs, keys, claim = tree.refs, tree.keys, tree.by_key.setdefault
        chunks = page_tokens(toks[(first - offset) * ps :], ps)
        if refs.keys() >= set(new) and keys.keys().isdisjoint(new):
            # the common case, a request caching its own new pages: nothing can be refused,
            # so each page is added as its key is claimed (no plan to take back)
            added, add = 0, tree.add_held_page
            for page, chunk in zip(new, chunks):
                key = (parent, chunk)
                cached = claim(key, page)
                if cached != page:
                    parent = cached  # the same tokens in another page: ours stays private
                    continue
                add(page, key, parent)
                added += 1
                parent = page
            self._inserts += bool(added)
            return added
        plan = []
        get_key = keys.get
        # keys are claimed as the pages are checked; a refusal takes them back: it changes
        # nothing
        for i, page, chunk in zip(range(first, n), new, chunks):
            key = (parent, chunk)
            why = None
            if page not in refs:
                why = f"page {page} is not held; insert a request's pages before releasing them."
            else:
                cached_key = get_key(page)
                if cached_key is None:
                    cached = claim(key, page)
                    if cached != page:
                        parent = cached  # the same tokens in another page: ours stays private
                        continue
                    plan.append((page, key, parent))
                elif cached_key != key:
                    at = (i - offset) * ps
                    why = (
                        f"page {page} is cached for other tokens than tokens[{at}:{at + ps}]; "
                        "pass the tokens whose KV the pages hold."
                    )
            if why is not None:
                for _, k, _ in plan:
                    del tree.by_key[k]
                raise ConfigError(why)
            parent = page
        if plan:
            tree.add_held(plan)
            self._inserts += 1
        return len(plan)

    def clear(self) -> int:
        """Drop every cached page nothing references (leaves first); returns how many."""
        dropped = self._tree.evict_leaves(self._tree.evictable)
        if dropped:
            self.allocator.free(dropped)
        return len(dropped)

    def check(self) -> None:
        """Recount the bookkeeping from scratch and check it against the allocator: every
        page is free, held or cached, exactly one of free and not (tests; costs O(pages))."""
        self._tree.check()
        alloc = self.allocator
        taken = set(self._tree.refs) | set(self._tree.keys)
        assert taken == alloc._used, f"pages lost or doubled: {sorted(taken ^ alloc._used)}"
        assert not taken & set(alloc._free), "a held or cached page is also free"


__all__ = ["PrefixCache", "PrefixCacheStats", "PrefixMatch", "Reservation"]
