"""How the engine uses the prefix cache (``prefix_cache.py``): one cache per KV cache, shared by
every engine over it, a request's pages at admission, and the tokens whose KV it has written.

Admission (``scheduler.plan_admission``) sees a waiting request as a ``Candidate``: its pages,
its tokens still to prefill, and keys of its first uncached page. A request's lookup is kept on
it (``Lookup``) until the cache's ``version`` changes, and then continues after the pages it
found unless a page was evicted since, so a long queue costs no repeated lookups; the page keys
(``page_keys``: a hash per full page of the prompt, chained, salted) are computed once, and
only as far as asked for.

The cache belongs to the KV cache, not to an engine: an engine that is dropped leaves its cached
pages where the next engine over the same model runner can match or evict them, so nothing leaks
between engines. An engine built with ``prefix_caching=False`` uses the same cache for its pages
(so it can evict what another engine cached) but never matches and never inserts.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

from .prefix_cache import PrefixCache, PrefixMatch, Reservation, page_tokens
from .requests import Request
from .scheduler import Candidate

_CACHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # KVCache -> PrefixCache


def model_identity(model_runner: Any) -> str:
    """The namespace of the cached pages: the model's shapes, the weights' origin, the dtype."""
    c = model_runner.config
    origin = getattr(model_runner, "weights_origin", None) or getattr(c, "name_or_path", "")
    shape = f"{c.num_layers}x{c.hidden_size}x{c.vocab_size}"
    return f"{type(c).__name__}:{shape}:{origin}:{model_runner.dtype}"


def shared_prefix_cache(model_runner: Any) -> PrefixCache:
    """The prefix cache over ``model_runner``'s KV cache (made on first use)."""
    kv = model_runner.kv_cache
    cache = _CACHES.get(kv)
    if cache is None:
        cache = PrefixCache(kv.allocator, kv.page_size, model=model_identity(model_runner))
        _CACHES[kv] = cache
    return cache


def written_count(req: Request) -> int:
    """How many tokens' KV the launched steps write into ``req``'s pages: its prefilled prompt,
    then each landed output token that was fed back (all but the newest one the request was
    scheduled; the last sampled token is never fed, so its KV is never written)."""
    fed = max(req.scheduled - 1, 0) if req.prefilled == len(req.prompt) else 0
    return req.prefilled + fed


def written_tokens(req: Request) -> list[int]:
    """The tokens whose KV the launched steps write into ``req``'s pages (``written_count``)."""
    return req.prompt[: req.prefilled] + req.output[: written_count(req) - req.prefilled]


def page_keys(
    prompt: Sequence[int], page_size: int, namespace: Any, keys: list[int] | None = None, upto=None
) -> list[int]:
    """A key per full page of ``prompt``: a hash of the page's tokens chained with the key of
    the page before (the first with ``namespace``: model and salt). Equal keys at a page mean,
    up to a hash collision, equal prompts up to its end; a collision only delays an admission.
    ``keys``: those made so far, extended in place through page ``upto`` (None: the last)."""
    keys = [] if keys is None else keys
    done, ps = len(keys), page_size
    end = len(prompt) // ps if upto is None else min(upto + 1, len(prompt) // ps)
    key = keys[-1] if keys else hash(namespace)
    for chunk in page_tokens(prompt[done * ps : end * ps], ps):
        key = hash((key, chunk))
        keys.append(key)
    return keys


class Lookup:
    """A request's prefix lookup while it waits, kept while the cache's ``version`` stays the
    same; its page keys; once it runs, how many of its pages its inserts have covered."""

    __slots__ = ("version", "match", "keys", "inserted")

    def __init__(self) -> None:
        self.version = -1
        self.match: PrefixMatch | None = None
        self.keys: list[int] = []  # page_keys of the prompt, made as far as needed
        self.inserted = 0  # once running: its first pages an insert has covered


class EngineCache:
    """One engine's use of the shared prefix cache; ``enabled=False``: pages only."""

    def __init__(self, model_runner: Any, enabled: bool) -> None:
        self.kv = model_runner.kv_cache
        self.cache = shared_prefix_cache(model_runner)
        self.enabled = enabled

    @property
    def num_available(self) -> int:
        """Pages admission can take: free, or cached and unreferenced."""
        return self.cache.num_available

    def match(self, req: Request) -> PrefixMatch | None:
        """``req``'s longest cached prefix now: its kept lookup while the cache's ``version``
        is unchanged, else looked up again (after the pages found before, if none was
        evicted since). None with caching off."""
        if not self.enabled:
            return None
        look = req.lookup
        if look is None:
            look = req.lookup = Lookup()
        version = self.cache.version
        if look.version != version:
            look.match = self.cache.match(req.prompt, req.cache_salt, since=look.match)
            look.version = version
        return look.match

    def key(self, req: Request, page: int) -> int:
        """``page_keys(req.prompt)[page]`` (a full page of the prompt), made once."""
        look = req.lookup
        if look is None:
            look = req.lookup = Lookup()
        if page >= len(look.keys):
            namespace = (self.cache.model, req.cache_salt)
            page_keys(req.prompt, self.cache.page_size, namespace, look.keys, page)
        return look.keys[page]

    def candidate(self, req: Request) -> Candidate:
        """``req`` as admission sees it (``scheduler.Candidate``)."""
        m = self.match(req)
        if m is None:
            return Candidate(self.kv.pages_for(req.kv_tokens), len(req.prompt))
        first, n = len(m.pages), len(req.prompt)
        ps = self.cache.page_size
        computes = self.key(req, first) if first < n // ps else None
        waits_on = computes if first < (n - 1) // ps else None
        return Candidate(self.cost(req, m), n - m.num_tokens, waits_on, computes)

    def prefilling(self, running: Sequence[Request]) -> tuple[int, list[int]]:
        """Of the ``running`` requests still prefilling: the prompt tokens they have left (this
        step's chunks take them first), and the key of the first full prompt page each will
        compute and cache (its prefill's frontier; none with caching off)."""
        tokens, keys, ps = 0, [], self.cache.page_size
        for req in running:
            if req.prefilled < len(req.prompt):
                tokens += len(req.prompt) - req.prefilled
                page = req.prefilled // ps
                if self.enabled and page < len(req.prompt) // ps:
                    keys.append(self.key(req, page))
        return tokens, keys

    def cost(self, req: Request, match: PrefixMatch | None) -> int:
        """Pages admitting ``req`` takes from ``num_available`` (its match is free)."""
        n = self.kv.pages_for(req.kv_tokens)
        return n if match is None else self.cache.admission_cost(match, n)

    def reserve(self, req: Request) -> Reservation:
        """Every page ``req`` will use: its cached prefix, referenced, then new pages."""
        self.kv.check_fits(req.kv_tokens)
        n = self.kv.pages_for(req.kv_tokens)
        if not self.enabled:
            return Reservation(self.cache.allocate(n), 0)
        m = self.match(req)  # the kept lookup, unless a reservation before it evicted pages
        req.lookup.match, req.lookup.version = None, -1  # admitted: its page keys stay
        return self.cache.reserve(req.prompt, n, req.cache_salt, match=m)

    def insert(self, req: Request) -> None:
        """Cache ``req``'s full written pages (before they are released): only those no
        earlier insert of it covered, handed in from the page before them on (no copy of the
        whole prompt); nothing at all when no page was completed since."""
        if not self.enabled or not req.pages:
            return
        look = req.lookup
        if look is None:
            look = req.lookup = Lookup()
        ps, prompt, start = self.cache.page_size, req.prompt, look.inserted
        n = min(written_count(req) // ps, len(req.pages))
        if n <= start:
            return
        # from the page before the new ones (the insert resumes under it), unless that page
        # stayed private (its tokens were cached in another page): then every written token
        offset = start - 1 if start > 1 and self.cache.is_cached(req.pages[start - 1]) else 0
        lo, hi = offset * ps, n * ps
        if hi <= len(prompt):
            tokens = prompt[lo:hi]
        else:
            tokens = prompt[lo:] + req.output[max(lo - len(prompt), 0) : hi - len(prompt)]
        self.cache.insert(tokens, req.pages, req.cache_salt, start=start, offset=offset)
        look.inserted = n

    def release(self, pages: list[int]) -> None:
        self.cache.release(pages)

    def state(self) -> tuple[int, int, int]:
        """What admission decides from: cached, evictable and free pages (tensor parallel
        checks it is the same on every rank)."""
        c = self.cache
        return c.num_cached, c.num_evictable, c.num_free


__all__ = [
    "EngineCache",
    "Lookup",
    "model_identity",
    "page_keys",
    "shared_prefix_cache",
    "written_count",
    "written_tokens",
]
