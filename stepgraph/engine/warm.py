"""``warm_up(engine)``: run every shape class a request can bring once at start-up, so that no
request after it compiles a kernel variant (``runner/compiles.py`` counts them).

A Triton kernel compiles one variant per specialization of its arguments: an int that is 1, a
multiple of 16, or neither; a pointer aligned to 16 bytes or not; and per tile the launcher
picks by shape. So a prefill of a new length may compile where the last did not. The warm-up
prefills prompts of lengths in every such class (1, below and at and past multiples of 16,
powers of two to the prefill budget, a prompt longer than the budget so a chunk attends to a
cached prefix), alone and packed two at a time, greedy and sampled (the step's sampling and a
request's own), and decodes each a few steps, then a batch of ``max_running`` rows (the decode
graphs are captured already; this warms what runs around them).

The prefill is padded to a token bucket in every mode (``model/prefill/graph_prefill.py``): its
graphs, one per bucket, are captured when the engine is built (modes graph and exact), and the
padded forward's kernels see a bucket's shapes whatever the prompt, so one prefill warms what
every bucket of the eager mode runs. The lengths still reach each bucket and past the largest,
and the widest decode batch packs more chunks than a bucket holds where ``max_running`` allows
it: both run the unpadded forward, whose Triton variants are warmed here too.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .requests import Sampling


def warm_lengths(max_prompt: int, budget: int) -> list[int]:
    """Prompt lengths of every specialization class up to ``max_prompt`` (at most the
    prefill ``budget`` plus one chunk, so one prompt is chunked): 1-3, around each power of
    two from 16 and at the budget."""
    lengths = {1, 2, 3}
    p = 16
    while p <= budget * 2:
        lengths.update((p - 1, p, p + 1))
        p *= 2
    lengths.update((budget - 1, budget, budget + 1, budget + 17))
    return sorted(n for n in lengths if 1 <= n <= max_prompt)


def warm_room(engine: Any, new_tokens: int = 3) -> int:
    """The longest warm-up prompt: one that, with ``new_tokens``, fits the model's positions,
    one request's KV and the whole cache (what ``check_request`` refuses past)."""
    mr = engine.model_runner
    kv = mr.kv_cache
    room = min(
        mr.config.max_position_embeddings, kv.max_context_len, (kv.num_pages - 1) * kv.page_size
    )
    return room - new_tokens - 1


def warm_up(engine: Any, new_tokens: int = 3) -> int:
    """Run ``engine`` through every shape class (``warm_lengths``), then drain it; returns the
    requests run, also counted in ``engine.stats.warm_requests``. Nothing stays queued, every
    page goes back, the prefix cache holds none of the warm-up's prompts (it is cleared: call
    this before serving) and the other counts of ``engine.stats`` are as they were."""
    mr = engine.model_runner
    stats = engine.stats
    before = dataclasses.replace(stats, batch_sizes=stats.batch_sizes.copy())
    lengths = warm_lengths(warm_room(engine, new_tokens), engine.max_prefill_tokens)
    prompts = [[1 + (i * 7 + k) % 200 for k in range(n)] for i, n in enumerate(lengths)]
    if not prompts:  # no prompt fits with new_tokens: nothing to serve either
        return 0
    stops = {"ignore_eos": True}
    for p in prompts:  # alone, greedy
        engine.generate([p], new_tokens, **stops)
    for a, b in zip(prompts[::2], prompts[1::2]):  # two packed in one prefill, sampled
        engine.generate([a, b], new_tokens, temperature=0.7, top_k=20, seed=0, **stops)
    rows = min(engine.max_running or mr.max_bs, mr.max_bs)
    batch = [prompts[i % len(prompts)][:16] for i in range(rows)]  # the widest decode
    engine.generate(batch, new_tokens, **stops)
    sampled = Sampling(0.7, 20)  # a request's own sampling (its generator)
    for p in prompts[:2]:
        engine.add_request(p, new_tokens, sampling=sampled, seed=1, ignore_eos=True)
    while engine.has_unfinished:
        engine.step()
    engine.drain()
    engine.finished.clear()
    if engine.prefix_cache is not None:
        engine.prefix_cache.clear()  # synthetic prompts: no request should find them cached
    ran = len(prompts) + len(prompts) // 2 * 2 + rows + min(len(prompts), 2)
    for f in dataclasses.fields(before):  # in place: a reader of engine.stats keeps it
        setattr(stats, f.name, getattr(before, f.name))
    stats.warm_requests += ran
    return ran


__all__ = ["warm_lengths", "warm_room", "warm_up"]
