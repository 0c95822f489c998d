"""The prefix cache's page bookkeeping: reference counts, the cached pages as a tree (each
page's parent is the cached page before it), which are blocked, and the least recently
released unblocked leaf to evict — pure host state, no allocator.

A cached page is *blocked* while it or a page below it is referenced: it cannot be evicted,
now or by evicting leaves first. Each cached page counts its blocked children (``pinned``), so
a reference taken or dropped updates the parents only while their state flips (a prefix is
referenced root first and released tail first, so that is one step per page).

A cached page's record is spread over dicts keyed by the page (``keys``, ``children``,
``pinned``, ``stamps``), not held in an object of its own: a dict of ints holds nothing the
garbage collector tracks, and a key's tuples (ints, and the namespace's strings) are untracked
by the first young collection they survive, so cached pages add next to nothing to a
collection's walk (an object a page made each full pass 37 ms longer at 200,000 pages on the
CPU; ``benchmarks/prefix_lookup.py --gc`` measures it). A page's parent is its key's first
item when that is a page (an int); a prompt's first page has the namespace there.
"""

from __future__ import annotations

import heapq


class PageTree:
    """Referenced pages (``refs``) and cached pages (``keys``, ``by_key`` and their counts)."""

    def __init__(self) -> None:
        self.refs: dict[int, int] = {}  # held pages -> references
        # cached pages -> key: (parent page or namespace, the page's tokens)
        self.keys: dict[int, tuple] = {}
        self.children: dict[int, int] = {}  # cached pages -> cached pages whose parent it is
        # cached pages -> of those children, the blocked ones (referenced, or above one)
        self.pinned: dict[int, int] = {}
        self.stamps: dict[int, int] = {}  # cached pages -> when last released (LRU order)
        self.by_key: dict[tuple, int] = {}
        self.blocked = 0  # cached pages that are blocked
        self.clock = 0
        self.epoch = 0  # evictions so far
        self._heap: list[tuple[int, int]] = []  # (stamp, page): unblocked leaves, lazily

    @property
    def evictable(self) -> int:
        """Cached pages that leaf-first eviction can take back, now or after their children."""
        return len(self.keys) - self.blocked

    def parent(self, page: int) -> int | None:
        """The cached page before ``page`` (cached), None for a prompt's first page."""
        up = self.keys[page][0]
        return up if up.__class__ is int else None

    def hold(self, pages: list[int]) -> None:
        """One more reference to each page (new, or cached: a prefix root first)."""
        refs, keys, pinned = self.refs, self.keys, self.pinned
        for page in pages:
            r = refs.get(page, 0)
            refs[page] = r + 1
            if r:
                continue
            key = keys.get(page)
            if key is None or pinned[page]:
                continue
            up = key[0]
            if up.__class__ is int and (up in refs or pinned[up]):  # the parent is blocked
                self.blocked += 1
                pinned[up] += 1
            else:
                self._flip(page, True)

    def drop(self, pages: list[int], stamp: int) -> list[int]:
        """One reference fewer to each page (the caller checked they are held; a prefix tail
        first); returns those now neither referenced nor cached: the allocator's again."""
        refs, keys, pinned, stamps, freed = self.refs, self.keys, self.pinned, self.stamps, []
        children, heap, push = self.children, self._heap, heapq.heappush
        for page in pages:
            r = refs[page] - 1
            if r:
                refs[page] = r
                continue
            del refs[page]
            key = keys.get(page)
            if key is None:
                freed.append(page)
                continue
            stamps[page] = stamp
            if pinned[page]:
                continue
            up = key[0]
            if up.__class__ is int and up in refs:  # the parent stays blocked
                self.blocked -= 1
                pinned[up] -= 1
                if not children[page]:
                    push(heap, (stamp, page))
            else:
                self._flip(page, False)
        return freed

    def add(self, page: int, key: tuple, parent: int | None) -> None:
        """Cache ``page`` (referenced, so blocked) under ``key``, below ``parent``."""
        self.keys[page] = key
        self.children[page] = self.pinned[page] = 0
        self.stamps[page] = self.clock
        self.by_key[key] = page
        if parent is not None:
            self.children[parent] += 1
        self._flip(page, True)

    def add_held(self, plan: list[tuple[int, tuple, object]]) -> None:
        """``add_held_page`` each ``(page, key, parent)`` of ``plan`` in order."""
        for page, key, parent in plan:
            self.add_held_page(page, key, parent)

    def add_held_page(self, page: int, key: tuple, parent: object) -> None:
        """``add`` a referenced ``page`` (``parent``: a page, or a namespace for a prompt's
        first page), its key already in ``by_key``. A page whose parent is referenced, the
        common case of a request caching its own pages, takes no walk up."""
        if parent.__class__ is not int or parent not in self.refs:
            self.add(page, key, parent if parent.__class__ is int else None)
            return
        self.keys[page] = key
        self.children[page] = self.pinned[page] = 0
        self.stamps[page] = self.clock
        self.children[parent] += 1
        self.pinned[parent] += 1  # ``page`` is referenced, so blocked; its parent already was
        self.blocked += 1

    def is_blocked(self, page: int) -> bool:
        return page in self.refs or self.pinned[page] > 0

    def _flip(self, page: int, blocked: bool) -> None:
        """``page`` (cached) just became blocked / unblocked: count it, tell its parents."""
        keys, refs, pinned, step = self.keys, self.refs, self.pinned, 1 if blocked else -1
        while True:
            self.blocked += step
            if not blocked and not self.children[page]:
                heapq.heappush(self._heap, (self.stamps[page], page))
            up = keys[page][0]
            if up.__class__ is not int:
                return
            p = pinned[up]
            pinned[up] = p + step
            if up in refs or (p > 0) == (p + step > 0):  # its state did not flip
                return
            page = up

    def evict_leaf(self) -> int:
        """Uncache the least recently released unblocked leaf and return its page (the
        allocator's still). The caller checks ``evictable`` first."""
        return self.evict_leaves(1)[0]

    def evict_leaves(self, n: int) -> list[int]:
        """``evict_leaf`` ``n`` times, in the same order, in one pass: a leaf's parent that
        becomes the least recently released leaf (a request's pages are released together) is
        taken next without a trip through the heap."""
        refs, by_key, keys = self.refs, self.by_key, self.keys
        children, pinned, stamps = self.children, self.pinned, self.stamps
        heap, pop, push = self._heap, heapq.heappop, heapq.heappush
        out: list[int] = []
        nxt = None  # (stamp, page): a parent that became a leaf before the heap's head
        while len(out) < n:
            if nxt is not None:
                stamp, page = nxt
                nxt = None
            else:
                while True:
                    stamp, page = pop(heap)
                    if (
                        stamps.get(page) == stamp
                        and not children[page]
                        and not pinned[page]
                        and page not in refs
                    ):
                        break
            key = keys.pop(page)
            del children[page], pinned[page], stamps[page], by_key[key]
            out.append(page)
            up = key[0]
            if up.__class__ is int:
                c = children[up] - 1
                children[up] = c
                if not c and not pinned[up] and up not in refs:
                    item = (stamps[up], up)
                    if len(out) < n and (not heap or item < heap[0]):
                        nxt = item
                    else:
                        push(heap, item)
        self.epoch += len(out)
        if len(heap) > 2 * len(keys) + 1024:  # mostly stale entries: rebuild
            self._heap = [
                (stamps[p], p) for p in keys if not children[p] and not pinned[p] and p not in refs
            ]
            heapq.heapify(self._heap)
        return out

    def check(self) -> None:
        """Recount everything from scratch; ``AssertionError`` naming the first mismatch."""
        keys, refs = self.keys, self.refs
        for name in ("children", "pinned", "stamps"):
            assert getattr(self, name).keys() == keys.keys(), f"{name} is not kept per page"
        kids: dict[int, list[int]] = {p: [] for p in keys}
        for page, key in keys.items():
            assert self.by_key.get(key) == page, f"page {page} is not under its key"
            up = self.parent(page)
            if up is not None:
                assert up in keys, f"page {page}: parent {up} is not cached"
                kids[up].append(page)
        assert len(self.by_key) == len(keys), "keys without a cached page"
        depth: dict[int, int] = {}
        for page in keys:  # iterative: chains are thousands of pages deep
            path = [page]
            while path[-1] not in depth and self.parent(path[-1]) is not None:
                path.append(self.parent(path[-1]))
            d = depth.setdefault(path.pop(), 0)  # a root, or a page already counted
            for p in reversed(path):
                d += 1
                depth[p] = d
        blocked: dict[int, bool] = {}
        in_heap = set(self._heap)
        for page in sorted(keys, key=depth.__getitem__, reverse=True):  # leaves first
            assert self.children[page] == len(kids[page]), f"page {page}: children is off"
            pinned = sum(blocked[c] for c in kids[page])
            assert self.pinned[page] == pinned, f"page {page}: pinned is off"
            blocked[page] = page in refs or pinned > 0
            if not blocked[page] and not kids[page]:
                stamp = self.stamps[page]
                assert (stamp, page) in in_heap, f"evictable leaf {page} is not in the heap"
        assert self.blocked == sum(blocked.values()), "blocked count is off"
        assert all(r > 0 for r in refs.values()), "a zero reference count is kept"


__all__ = ["PageTree"]
