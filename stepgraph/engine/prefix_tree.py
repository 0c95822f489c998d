"""The prefix cache's page bookkeeping: reference counts, the cached pages as a tree (each
page's parent is the cached page before it), which are blocked, and the least recently
released unblocked leaf to evict — pure host state, no allocator.

A cached page is *blocked* while it or a page below it is referenced: it cannot be evicted,
now or by evicting leaves first. Each entry counts its blocked children (``pinned``), so a
reference taken or dropped updates the parents only while their state flips (a prefix is
referenced root first and released tail first, so that is one step per page).
"""

from __future__ import annotations

import heapq


class Entry:
    __slots__ = ("key", "parent", "children", "pinned", "stamp")

    def __init__(self, key: tuple, parent: int | None, stamp: int) -> None:
        self.key = key  # (parent page or namespace, the page's tokens)
        self.parent = parent  # the cached page before it, None for a prompt's first page
        self.children = 0  # cached pages whose parent it is
        self.pinned = 0  # of those, the blocked ones (referenced, or above a referenced page)
        self.stamp = stamp  # when last released: least recent is evicted first


class PageTree:
    """Referenced pages (``refs``) and cached pages (``entries``, ``by_key``)."""

    def __init__(self) -> None:
        self.refs: dict[int, int] = {}  # held pages -> references
        self.entries: dict[int, Entry] = {}  # cached pages
        self.by_key: dict[tuple, int] = {}
        self.blocked = 0  # cached pages that are blocked
        self.clock = 0
        self.epoch = 0  # evictions so far
        self._heap: list[tuple[int, int]] = []  # (stamp, page): unblocked leaves, lazily

    @property
    def evictable(self) -> int:
        """Cached pages that leaf-first eviction can take back, now or after their children."""
        return len(self.entries) - self.blocked

    def hold(self, pages: list[int]) -> None:
        """One more reference to each page (new, or cached: a prefix root first)."""
        refs, entries = self.refs, self.entries
        for page in pages:
            r = refs.get(page, 0)
            refs[page] = r + 1
            e = entries.get(page) if r == 0 else None
            if e is None or e.pinned:
                continue
            up = e.parent
            if up is not None and (up in refs or entries[up].pinned):  # the parent is blocked
                self.blocked += 1
                entries[up].pinned += 1
            else:
                self._flip(page, True)

    def drop(self, pages: list[int], stamp: int) -> list[int]:
        """One reference fewer to each page (the caller checked they are held; a prefix tail
        first); returns those now neither referenced nor cached: the allocator's again."""
        refs, entries, freed = self.refs, self.entries, []
        for page in pages:
            r = refs[page] - 1
            if r:
                refs[page] = r
                continue
            del refs[page]
            e = entries.get(page)
            if e is None:
                freed.append(page)
                continue
            e.stamp = stamp
            if e.pinned:
                continue
            up = e.parent
            if up is not None and up in refs:  # the parent stays blocked
                self.blocked -= 1
                entries[up].pinned -= 1
                if e.children == 0:
                    heapq.heappush(self._heap, (stamp, page))
            else:
                self._flip(page, False)
        return freed

    def add(self, page: int, key: tuple, parent: int | None) -> None:
        """Cache ``page`` (referenced, so blocked) under ``key``, below ``parent``."""
        self.entries[page] = Entry(key, parent, self.clock)
        self.by_key[key] = page
        if parent is not None:
            self.entries[parent].children += 1
        self._flip(page, True)

    def add_held(self, plan: list[tuple[int, tuple, object]]) -> None:
        """``add`` each ``(page, key, parent)`` in order (``parent``: a page, or a namespace for
        a prompt's first page), its key already in ``by_key``. A page whose parent is
        referenced, the common case of a request caching its own pages, takes no walk up."""
        entries, refs, clock = self.entries, self.refs, self.clock
        for page, key, parent in plan:
            if parent.__class__ is not int or parent not in refs:
                self.add(page, key, parent if parent.__class__ is int else None)
                continue
            entries[page] = Entry(key, parent, clock)
            pe = entries[parent]
            pe.children += 1
            pe.pinned += 1  # ``page`` is referenced, so blocked; its parent already was
            self.blocked += 1

    def is_blocked(self, page: int) -> bool:
        return page in self.refs or self.entries[page].pinned > 0

    def _flip(self, page: int, blocked: bool) -> None:
        """``page`` (cached) just became blocked / unblocked: count it, tell its parents."""
        entries, refs, step = self.entries, self.refs, 1 if blocked else -1
        while True:
            e = entries[page]
            self.blocked += step
            if not blocked and e.children == 0:
                heapq.heappush(self._heap, (e.stamp, page))
            if e.parent is None:
                return
            page = e.parent
            pe = entries[page]
            was = pe.pinned > 0 or page in refs
            pe.pinned += step
            if was == (pe.pinned > 0 or page in refs):
                return

    def evict_leaf(self) -> int:
        """Uncache the least recently released unblocked leaf and return its page (the
        allocator's still). The caller checks ``evictable`` first."""
        return self.evict_leaves(1)[0]

    def evict_leaves(self, n: int) -> list[int]:
        """``evict_leaf`` ``n`` times, in the same order, in one pass: a leaf's parent that
        becomes the least recently released leaf (a request's pages are released together) is
        taken next without a trip through the heap."""
        entries, refs, by_key = self.entries, self.refs, self.by_key
        heap, pop, push = self._heap, heapq.heappop, heapq.heappush
        out: list[int] = []
        nxt = None  # (stamp, page): a parent that became a leaf before the heap's head
        while len(out) < n:
            if nxt is not None:
                stamp, page = nxt
                e, nxt = entries[page], None
            else:
                while True:
                    stamp, page = pop(heap)
                    e = entries.get(page)
                    if (
                        e
                        and e.stamp == stamp
                        and not e.children
                        and not e.pinned
                        and page not in refs
                    ):
                        break
            del entries[page], by_key[e.key]
            out.append(page)
            up = e.parent
            if up is not None:
                pe = entries[up]
                pe.children -= 1
                if pe.children == 0 and pe.pinned == 0 and up not in refs:
                    item = (pe.stamp, up)
                    if len(out) < n and (not heap or item < heap[0]):
                        nxt = item
                    else:
                        push(heap, item)
        self.epoch += len(out)
        if len(heap) > 2 * len(entries) + 1024:  # mostly stale entries: rebuild
            self._heap = [
                (x.stamp, p)
                for p, x in entries.items()
                if not x.children and not x.pinned and p not in refs
            ]
            heapq.heapify(self._heap)
        return out

    def check(self) -> None:
        """Recount everything from scratch; ``AssertionError`` naming the first mismatch."""
        entries, refs = self.entries, self.refs
        kids: dict[int, list[int]] = {p: [] for p in entries}
        for page, e in entries.items():
            assert self.by_key.get(e.key) == page, f"page {page} is not under its key"
            assert e.parent is None or e.key[0] == e.parent, f"page {page}: parent is not keyed"
            if e.parent is not None:
                kids[e.parent].append(page)
        assert len(self.by_key) == len(entries), "keys without a cached page"
        depth: dict[int, int] = {}
        for page in entries:  # iterative: chains are thousands of pages deep
            path = [page]
            while path[-1] not in depth and entries[path[-1]].parent is not None:
                path.append(entries[path[-1]].parent)
            d = depth.setdefault(path.pop(), 0)  # a root, or a page already counted
            for p in reversed(path):
                d += 1
                depth[p] = d
        blocked: dict[int, bool] = {}
        in_heap = set(self._heap)
        for page in sorted(entries, key=depth.__getitem__, reverse=True):  # leaves first
            e = entries[page]
            assert e.children == len(kids[page]), f"page {page}: children is off"
            assert e.pinned == sum(blocked[c] for c in kids[page]), f"page {page}: pinned is off"
            blocked[page] = page in refs or e.pinned > 0
            if not blocked[page] and not e.children:
                assert (e.stamp, page) in in_heap, f"evictable leaf {page} is not in the heap"
        assert self.blocked == sum(blocked.values()), "blocked count is off"
        assert all(r > 0 for r in refs.values()), "a zero reference count is kept"


__all__ = ["Entry", "PageTree"]
