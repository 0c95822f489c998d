"""The engine's scheduling decisions, as pure functions of host numbers (tested on the CPU).

One engine step runs at most one budget of prefill tokens, then the decode batch:

- ``step_prefill_budget``: the budget of this step: ``max_prefill_tokens``, or, when the step
  also decodes running requests, at most ``max_prefill_tokens_with_decode`` (vLLM's and
  SGLang's cap on a mixed step): a prefill never stalls the running requests for long.
- ``plan_admission``: how many requests at the head of the queue start now, first come, first
  served, while (1) ``max_running`` allows, (2) their pages fit (a request reserves every page
  it will ever need at admission, so a step never runs out of pages halfway), (3) this step's
  prefill budget has a token left for them (a request that could not start prefilling now
  waits in the queue, where a later lookup finds what the requests before it computed), and
  (4) the first page of the request's prompt not yet cached is not being computed right now
  by a request still prefilling or admitted before it in this round (vLLM's scheduler and
  SGLang's in-batch prefix check): the request waits at the head of the queue until those
  pages are cached, then starts first and finds them. ``admit_count`` is (1) and (2) alone.
- ``plan_prefill``: which prompt tokens this step prefills. Requests in admission order take
  what is left of their prompt until ``max_prefill_tokens`` is spent; the first one that does
  not fit whole is cut there (chunked prefill), and its next chunk continues from the cache at
  the next step. Later requests wait, so a long prompt never starves and the decode batch that
  follows runs after at most one budget of prefill work: inter-token latency stays bounded.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

from ..errors import ConfigError

DEFAULT_MAX_PREFILL_TOKENS = 8192  # SGLang's chunk on H100/H200; vLLM's throughput setting
# prompt tokens of a step that also decodes: vLLM's latency setting (max_num_batched_tokens),
# a prefill of a few ms on the H200 for the 1B model, so inter-token latency stays low
DEFAULT_MAX_PREFILL_TOKENS_WITH_DECODE = 2048


@dataclass(frozen=True)
class ChunkPlan:
    index: int  # into the prefilling requests given to plan_prefill
    start: int  # first prompt position of the chunk (= tokens already in the cache)
    length: int  # tokens in the chunk, >= 1
    last: bool  # the chunk ends the prompt: its logits give the request's first token


@dataclass(frozen=True)
class Candidate:
    """A waiting request as admission sees it."""

    pages: int  # KV pages admitting it takes from the available ones (its cached prefix is free)
    tokens: int  # prompt tokens it must still prefill (after its cached prefix), >= 1
    # a key of the first page of its prompt it could still find cached (None: none can be):
    # equal keys, equal tokens up to and including that page, under the same cache_salt
    waits_on: Hashable | None = None
    # the key of the first full prompt page it will compute and cache (None: none)
    computes: Hashable | None = None


def check_budget(max_prefill_tokens: int, name: str = "max_prefill_tokens") -> None:
    if (
        isinstance(max_prefill_tokens, bool)
        or not isinstance(max_prefill_tokens, int)
        or max_prefill_tokens < 1
    ):
        default, what = DEFAULT_MAX_PREFILL_TOKENS, "one step prefills"
        if name != "max_prefill_tokens":
            default = DEFAULT_MAX_PREFILL_TOKENS_WITH_DECODE
            what = "a step that also decodes prefills (None: max_prefill_tokens)"
        raise ConfigError(
            f"{name} must be an integer >= 1, got {max_prefill_tokens!r}; it is the most "
            f"prompt tokens {what} (default {default})."
        )


def step_prefill_budget(
    max_prefill_tokens: int, max_prefill_tokens_with_decode: int | None, decoding: bool
) -> int:
    """Prompt tokens this step may prefill: ``max_prefill_tokens``, capped at
    ``max_prefill_tokens_with_decode`` (None: no cap) when the step also decodes."""
    if decoding and max_prefill_tokens_with_decode is not None:
        return min(max_prefill_tokens, max_prefill_tokens_with_decode)
    return max_prefill_tokens


def plan_admission(
    candidates: Iterable[Candidate],
    free_pages: int,
    running: int,
    max_running: int | None,
    budget: int,
    computing: Iterable[Hashable] = (),
) -> tuple[int, str]:
    """How many requests from the head of the queue start now (module docstring), and why
    admission stopped there: "queue" (none left), "running" (``max_running``, None: no limit),
    "pages" (not ``free_pages`` enough), "budget" (no prefill token of this step left) or
    "computing" (its first uncached page is being computed). ``candidates`` is read lazily,
    one past the last admitted at most; ``budget``: this step's prefill tokens left after the
    running requests' chunks; ``computing``: the ``computes`` keys of the running requests
    still prefilling."""
    busy = set(computing)
    it = iter(candidates)
    n = 0
    while True:
        if max_running is not None and running + n >= max_running:
            return n, "running"
        if budget <= 0:
            return n, "budget"
        c = next(it, None)
        if c is None:
            return n, "queue"
        if c.pages > free_pages:
            return n, "pages"
        if c.waits_on is not None and c.waits_on in busy:
            return n, "computing"
        free_pages -= c.pages
        budget -= c.tokens
        if c.computes is not None:
            busy.add(c.computes)
        n += 1


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
    "DEFAULT_MAX_PREFILL_TOKENS_WITH_DECODE",
    "Candidate",
    "ChunkPlan",
    "admit_count",
    "check_budget",
    "plan_admission",
    "plan_prefill",
    "step_prefill_budget",
]
