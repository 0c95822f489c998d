"""The prefix cache's small values: a lookup's result (``PrefixMatch``), a request's pages at
admission (``Reservation``), the counters (``PrefixCacheStats``), and the checks of what a
caller hands in (tokens, ``cache_salt``) — pure."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ..errors import ConfigError


@dataclass(frozen=True, eq=False)
class PrefixMatch:
    """The longest cached full-page prefix of a prompt. Unpacks as ``pages, num_tokens``.

    ``pages``: the cached pages, in prompt order (the first ``len(pages)`` entries of the
    request's block table); ``num_tokens``: the prompt tokens they hold, ``len(pages) *
    page_size``, the offset its prefill starts at; ``query_tokens``: the prompt's length."""

    pages: list[int]
    num_tokens: int
    query_tokens: int
    epoch: int = field(repr=False)  # the cache's eviction count when matched
    keys: list[tuple] = field(repr=False)  # each page's key, re-checked if pages were evicted
    version: int = field(default=-1, repr=False)  # the cache's ``version`` when matched

    def __iter__(self) -> Iterator[Any]:
        return iter((self.pages, self.num_tokens))

    def __len__(self) -> int:
        return 2


class Reservation(NamedTuple):
    """Every page a request will use (its cached prefix first, then new pages, held by it)
    and how many of its prompt tokens are already in them (its prefill starts there)."""

    pages: list[int]
    num_cached_tokens: int


@dataclass
class PrefixCacheStats:
    """Counted in tokens, as vLLM's ``prefix_cache_queries`` / ``prefix_cache_hits``: one
    query per admitted request, of its prompt tokens; its hits are the tokens served from the
    cache. ``evictions`` counts cached pages taken back for new use (``clear`` not included)."""

    requests: int = 0
    queries: int = 0
    hits: int = 0
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        """``hits / queries`` (0.0 before any query)."""
        return self.hits / self.queries if self.queries else 0.0

    def as_dict(self) -> dict[str, float]:
        return {
            "requests": self.requests,
            "queries": self.queries,
            "hits": self.hits,
            "evictions": self.evictions,
            "hit_rate": self.hit_rate,
        }


def token_list(tokens: Sequence[int] | Any) -> list[int] | tuple[int, ...]:
    """``tokens`` as a list or tuple of ints (a numpy array or tensor through ``tolist``)."""
    if isinstance(tokens, (list, tuple)):
        return tokens
    if hasattr(tokens, "tolist"):
        out = tokens.tolist()
        if isinstance(out, list) and all(isinstance(t, int) for t in out[:1]):
            return out
    raise ConfigError(
        f"tokens must be a list of token ids (or a 1-D integer array), got {type(tokens).__name__}."
    )


def check_salt(salt: object) -> None:
    if salt is not None and not isinstance(salt, str):
        raise ConfigError(
            f"cache_salt must be a string or None, got {type(salt).__name__}; requests share "
            "cached pages only when they pass the same cache_salt."
        )


def check_count(n: object, what: str) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ConfigError(f"{what} must be an integer >= 0, got {n!r}.")


__all__ = [
    "PrefixCacheStats",
    "PrefixMatch",
    "Reservation",
    "check_count",
    "check_salt",
    "token_list",
]
