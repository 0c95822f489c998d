"""The engine's prefill step: this step's chunks (``scheduler.plan_prefill``) as one packed
forward of the prefiller (``ModelRunner.extend``, or ``PiecewisePrefill.extend``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..model.prefill.extend_batch import PrefillChunk
from .requests import EngineStats, Request
from .scheduler import plan_prefill


def build_prefiller(model_runner: Any, prefill: str, config: Any | None) -> Any:
    """What prefills for ``Engine(prefill=...)``: the model runner itself ("eager"), a
    ``PiecewisePrefill`` ("piecewise", ``config``: its ``PrefillShapes``) or a ``GraphPrefill``
    ("graph", ``config``: its keyword arguments). Each has ``extend(chunks) -> logits``."""
    if prefill == "piecewise":
        from ..model.prefill.piecewise_prefill import PiecewisePrefill

        return PiecewisePrefill(model_runner, config)
    if prefill == "graph":
        from ..model.prefill.graph_prefill import GraphPrefill

        return GraphPrefill(model_runner, **(config or {}))
    return model_runner


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


__all__ = ["build_prefiller", "prefill_step"]
