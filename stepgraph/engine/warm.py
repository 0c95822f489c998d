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
"""

from __future__ import annotations

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


def warm_up(engine: Any, new_tokens: int = 3) -> int:
    """Run ``engine`` through every shape class (``warm_lengths``), then drain it; returns the
    requests run. Nothing stays queued and every page goes back."""
    mr = engine.model_runner
    most = mr.max_context_len - new_tokens - 1
    lengths = warm_lengths(most, engine.max_prefill_tokens)
    prompts = [[1 + (i * 7 + k) % 200 for k in range(n)] for i, n in enumerate(lengths)]
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
    return len(prompts) * 2 + rows + 2


__all__ = ["warm_lengths", "warm_up"]
