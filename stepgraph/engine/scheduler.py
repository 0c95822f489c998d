"""The engine's scheduling decisions, as pure functions of host numbers (tested on the CPU).

One engine step runs at most one budget of prefill tokens, then the decode batch:

- ``admit_count``: how many requests at the head of the queue start now. First come, first
  served, while their pages fit and ``max_running`` allows; a request reserves every page it
  will ever need at admission, so a step never runs out of pages halfway.
- ``plan_prefill``: which prompt tokens this step prefills. Requests in admission order take
  what is left of their prompt until ``max_prefill_tokens`` is spent; the first one that does
  not fit whole is cut there (chunked prefill), and its next chunk continues from the cache at
  the next step. Later requests wait, so a long prompt never starves and the decode batch that
  follows runs after at most one budget of prefill work: inter-token latency stays bounded.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..errors import ConfigError

DEFAULT_MAX_PREFILL_TOKENS = 8192  # SGLang's chunk on H100/H200; vLLM's throughput setting


@dataclass(frozen=True)
class ChunkPlan:
    index: int  # into the prefilling requests given to plan_prefill
    start: int  # first prompt position of the chunk (= tokens already in the cache)
    length: int  # tokens in the chunk, >= 1
    last: bool  # the chunk ends the prompt: its logits give the request's first token


def check_budget(max_prefill_tokens: int) -> None:
    if (
        isinstance(max_prefill_tokens, bool)
        or not isinstance(max_prefill_tokens, int)
        or max_prefill_tokens < 1
    ):
        raise ConfigError(
            f"max_prefill_tokens must be an integer >= 1, got {max_prefill_tokens!r}; it is the "
            f"most prompt tokens one step prefills (default {DEFAULT_MAX_PREFILL_TOKENS})."
        )


def admit_count(
    pages_needed: Iterable[int], free_pages: int, running: int, max_running: int | None
) -> int:
    """How many requests from the head of the queue (each needing ``pages_needed[i]`` pages)
    start now: in order, while their pages fit in ``free_pages`` and the running count stays
    within ``max_running`` (None: no limit). Stops at the first that does not fit."""
    n = 0
    for need in pages_needed:
        if max_running is not None and running + n >= max_running:
            break
        if need > free_pages:
            break
        free_pages -= need
        n += 1
    return n


def plan_prefill(pending: Sequence[tuple[int, int]], max_prefill_tokens: int) -> list[ChunkPlan]:
    """The chunks of this step. ``pending``: ``(tokens already prefilled, prompt length)`` of
    each request still prefilling, in admission order (module docstring)."""
    check_budget(max_prefill_tokens)
    plan, left = [], max_prefill_tokens
    for i, (done, total) in enumerate(pending):
        if left == 0:
            break
        if not 0 <= done < total:
            raise ConfigError(f"request {i} has {done} of {total} prompt tokens prefilled.")
        take = min(total - done, left)
        plan.append(ChunkPlan(i, done, take, done + take == total))
        left -= take
    return plan


__all__ = [
    "DEFAULT_MAX_PREFILL_TOKENS",
    "ChunkPlan",
    "admit_count",
    "check_budget",
    "plan_prefill",
]
