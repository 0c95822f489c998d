"""One engine step on the device: admit what fits, prefill one budget of prompt tokens as one
packed forward, decode the requests that have a token to feed, and sample, leaving the tokens
on the device (``overlap.InFlight``). Nothing here waits for the device."""

from __future__ import annotations

import contextlib
import itertools
from typing import Any

import torch

from ..errors import ConfigError
from .overlap import InFlight
from .prefill import prefill_step
from .requests import Sampling, sample_rows
from .scheduler import admit_count


def admit(engine: Any) -> None:
    """Start the requests at the head of the queue that fit (``scheduler.admit_count``)."""
    kv = engine.model_runner.kv_cache
    needs = (kv.pages_for(r.kv_tokens) for r in engine.waiting)
    count = admit_count(needs, kv.allocator.num_free, len(engine.running), engine.max_running)
    if engine._sync is not None:  # tensor parallel: rank 0's count on every rank
        rids = [r.rid for r in engine.waiting], [r.rid for r in engine.running]
        count = engine._sync.admit(count, *rids, engine._landed)
    for _ in range(count):
        req = engine.waiting.popleft()
        req.pages = kv.reserve(req.kv_tokens)
        engine.running.append(req)
    if engine.waiting and not engine.running:
        raise ConfigError(
            f"request {engine.waiting[0].rid} needs {kv.pages_for(engine.waiting[0].kv_tokens)} "
            f"pages but only {kv.allocator.num_free} are free and nothing is running; pages "
            "are held outside this engine."
        )


def abort_everything(engine: Any) -> list[int]:
    """``Engine.abort_all``: every request closed, the device idle, then every page freed."""
    everyone = list(itertools.chain(engine.waiting, engine.running, engine._draining))
    for req in everyone:
        req.closed = True
        engine._pending.add(None, req.pages)
        req.pages = []
    engine.waiting.clear()
    engine.running.clear()
    engine._draining.clear()
    engine._inflight = None
    if engine.model_runner.device.type == "cuda":
        with contextlib.suppress(Exception):  # a faulted device may fail here too
            torch.cuda.synchronize(engine.model_runner.device)
    engine._pending.reclaim(wait=True)
    return [r.rid for r in everyone]


def launch_step(
    engine: Any,  # the Engine (not imported: it imports this module)
    sampling: Sampling,
    generator: torch.Generator | None,
    prev: InFlight | None,
) -> InFlight | None:
    """Admit, prefill one budget, decode once and sample, all on the device; the tokens
    stay there (``InFlight``)."""
    decoding = [r for r in engine.running if 0 < r.scheduled < r.max_new_tokens]
    admit(engine)
    logits, rows = [], []
    # one packed forward of this step's chunks: requests whose prompt is now all cached
    first = prefill_step(engine.prefiller, engine.running, engine.max_prefill_tokens, engine.stats)
    if first is not None:
        rows, prefill_logits = first
        logits.append(prefill_logits)
    if decoding:
        logits.append(engine.decoder.logits(decoding, engine.stats, prev))
        engine.stats.decode_tokens += len(decoding)
        engine.stats.batch_sizes[len(decoding)] += 1
    if not logits:
        return None
    rows += decoding
    fused = engine.model_runner.fused_tokens(len(decoding))  # argmax inside the decode step
    if fused is not None and len(rows) == len(decoding) and _greedy(rows, sampling):
        tokens = fused  # a static buffer: the next step reads it before its replay rewrites it
    else:
        both = logits[0] if len(logits) == 1 else torch.cat(logits)
        tokens = sample_rows(both, rows, sampling, generator)  # [n] int64, no host sync
    for req in rows:
        req.scheduled += 1
    return InFlight.launch(rows, tokens)


def _greedy(rows, sampling: Sampling) -> bool:
    return sampling.temperature <= 0 and all(r.sampling is None for r in rows)


__all__ = ["abort_everything", "admit", "launch_step"]
