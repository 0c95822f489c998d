"""The engine's prefill step: this step's chunks (``scheduler.plan_prefill``) as one packed
forward of the prefiller (the padded ``GraphPrefill``, from graphs or eagerly;
``ModelRunner.extend`` unpadded; or ``PiecewisePrefill.extend``)."""

from __future__ import annotations

import bisect
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from ..model.prefill.extend_batch import PrefillChunk
from .requests import EngineStats, Request
from .scheduler import plan_prefill


def default_prefill(mode: str) -> str:
    """``Engine(prefill=None)``: "graph" in modes "graph" and "exact", "eager" in mode
    "eager": the same padded forward, so the same bits, from graphs or not."""
    return "eager" if mode == "eager" else "graph"


def padded_prefill_config(model_runner: Any, max_prefill_tokens: int) -> dict:
    """The engine's default ``GraphPrefill`` arguments: token buckets, powers of two from 64
    up to the first holding the prefill budget (or the whole KV cache, if less; 8192 at most,
    ``DEFAULT_TOKEN_BUCKETS``), so a step's chunks fit a bucket; ``max_chunks``: at most
    ``DEFAULT_MAX_CHUNKS``, and no more than the requests that can run at once (one chunk
    each)."""
    from ..model.prefill.graph_prefill import (
        DEFAULT_MAX_CHUNKS,
        DEFAULT_TOKEN_BUCKETS,
        token_buckets_for,
    )

    kv = model_runner.kv_cache
    most = min(max_prefill_tokens, (kv.num_pages - 1) * kv.page_size, DEFAULT_TOKEN_BUCKETS[-1])
    chunks = min(DEFAULT_MAX_CHUNKS, max(1, getattr(model_runner, "max_bs", DEFAULT_MAX_CHUNKS)))
    return {"token_buckets": token_buckets_for(most), "max_chunks": chunks}


def build_prefiller(engine: Any, config: Any | None) -> Any:
    """What prefills for ``Engine(prefill=...)`` (``engine.prefill``, resolved by
    ``default_prefill``), over ``engine.model_runner``: a ``GraphPrefill`` ("graph": the
    chunks padded to the smallest token bucket holding them and replayed from its graph,
    captured here with a progress line where the decode capture shows one; "eager": the same
    padded forward without graphs, so the same shapes, kernels and bits; a batch above the
    largest bucket or of more chunks than a bucket holds runs unpadded in both; ``config``:
    keyword arguments over ``padded_prefill_config``'s), the model runner itself ("unpadded":
    ``ModelRunner.extend`` on the live tokens only, whose bf16 bits may differ from the
    padded forward's), or a ``PiecewisePrefill`` ("piecewise", ``config``: its
    ``PrefillShapes``). Each has ``extend(chunks) -> logits``. A padded prefiller warns of a
    prefill budget between its token buckets: such steps pay for the next bucket."""
    model_runner, prefill = engine.model_runner, engine.prefill
    if prefill == "piecewise":
        from ..model.prefill.piecewise_prefill import PiecewisePrefill

        return PiecewisePrefill(model_runner, config)
    if prefill in ("graph", "eager"):
        from ..model.prefill.graph_prefill import GraphPrefill

        kw = padded_prefill_config(model_runner, engine.max_prefill_tokens) | dict(config or {})
        runner = engine.runner  # the decode runner: its progress setting
        kw.setdefault("show_progress", runner is not None and runner.config.show_progress)
        prefiller = GraphPrefill(model_runner, eager=prefill == "eager", **kw)
        _warn_between_buckets(engine, prefiller.token_buckets)
        return prefiller
    return model_runner


def _warn_between_buckets(engine: Any, buckets: Sequence[int]) -> None:
    """Warn of each prefill budget of ``engine`` that pads to a larger token bucket (below the
    smallest bucket every budget pads alike: no warning)."""
    budgets = (
        ("max_prefill_tokens", engine.max_prefill_tokens),
        ("max_prefill_tokens_with_decode", engine.max_prefill_tokens_with_decode),
    )
    for name, budget in budgets:
        if budget is not None and budget > buckets[0] and (padded := pads_to(budget, buckets)):
            warnings.warn(
                f"{name}={budget} is not a prefill token bucket: a step of {budget} tokens "
                f"runs padded to {padded}, doing less work than a step of {padded} at its "
                f"cost; pass a bucket ({', '.join(map(str, buckets))})"
                " (docs/experiments.md#a-prefill-cap-on-steps-that-decode)",
                stacklevel=4,  # build_prefiller, Engine.__init__, the caller's line
            )


def pads_to(budget: int, buckets: Sequence[int]) -> int | None:
    """The token bucket a full prefill step of ``budget`` tokens is padded to, where that is
    more than ``budget`` (None where ``budget`` is a bucket, or past the largest, where a step
    runs unpadded)."""
    i = bisect.bisect_left(buckets, budget)
    return buckets[i] if i < len(buckets) and buckets[i] != budget else None


def prefill_step(
    prefiller: Any,  # anything with extend(chunks) -> [n, vocab] logits
    running: Sequence[Request],
    max_prefill_tokens: int,
    stats: EngineStats,
) -> tuple[list[Request], torch.Tensor] | None:
    """Prefill at most ``max_prefill_tokens`` prompt tokens of the ``running`` requests that
    are still prefilling, in admission order; return the requests whose last chunk ran and
    their logits ``[n, vocab]`` float32 (a cut chunk's logits are not sampled), or None."""
    prefilling = [r for r in running if r.prefilled < len(r.prompt)]
    plan = plan_prefill([(r.prefilled, len(r.prompt)) for r in prefilling], max_prefill_tokens)
    if not plan:
        return None
    chunks = []
    for c in plan:
        req = prefilling[c.index]
        chunks.append(PrefillChunk(req.prompt[c.start : c.start + c.length], c.start, req.pages))
    logits = prefiller.extend(chunks)  # [len(plan), vocab]
    for c in plan:
        prefilling[c.index].prefilled = c.start + c.length
    stats.prefill_steps += 1
    stats.prefill_tokens += sum(c.length for c in plan)
    last = [k for k, c in enumerate(plan) if c.last]
    stats.prefills += len(last)
    if not last:
        return None
    if len(last) < len(plan):
        logits = logits[torch.tensor(last, device=logits.device)]
    return [prefilling[plan[k].index] for k in last], logits


__all__ = ["build_prefiller", "default_prefill", "padded_prefill_config", "prefill_step"]
