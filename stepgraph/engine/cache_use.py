"""How the engine uses the prefix cache (``prefix_cache.py``): one cache per KV cache, shared by
every engine over it, a request's pages at admission, and the tokens whose KV it has written.

The cache belongs to the KV cache, not to an engine: an engine that is dropped leaves its cached
pages where the next engine over the same model runner can match or evict them, so nothing leaks
between engines. An engine built with ``prefix_caching=False`` uses the same cache for its pages
(so it can evict what another engine cached) but never matches and never inserts.
"""

from __future__ import annotations

import weakref
from typing import Any

from .prefix_cache import PrefixCache, PrefixMatch, Reservation
from .requests import Request

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


def written_tokens(req: Request) -> list[int]:
    """The tokens whose KV the launched steps write into ``req``'s pages: its prefilled prompt,
    then each landed output token that was fed back (all but the newest one the request was
    scheduled; the last sampled token is never fed, so its KV is never written)."""
    fed = max(req.scheduled - 1, 0) if req.prefilled == len(req.prompt) else 0
    return req.prompt[: req.prefilled] + req.output[:fed]


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
        return self.cache.match(req.prompt, req.cache_salt) if self.enabled else None

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
        return self.cache.reserve(req.prompt, n, req.cache_salt)

    def insert(self, req: Request) -> None:
        """Cache ``req``'s full written pages (before they are released)."""
        if self.enabled and req.pages:
            self.cache.insert(written_tokens(req), req.pages, req.cache_salt)

    def release(self, pages: list[int]) -> None:
        self.cache.release(pages)

    def state(self) -> tuple[int, int, int]:
        """What admission decides from: cached, evictable and free pages (tensor parallel
        checks it is the same on every rank)."""
        c = self.cache
        return c.num_cached, c.num_evictable, c.num_free


__all__ = ["EngineCache", "model_identity", "shared_prefix_cache", "written_tokens"]
