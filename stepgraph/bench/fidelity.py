"""`stepgraph bench --quantization fp8`: the FP8 model beside the bf16 one on the same weights,
and how far its next-token distributions move: the mean KL divergence KL(bf16 || FP8) and the
top-1 agreement, over the bench's steps (each point's batch, eager, on the same random KV)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model.model_runner import ModelRunner
from .workload import Point, decode_batch


@dataclass(frozen=True)
class Fidelity:
    """Of ``rows`` next-token distributions: the mean KL(reference || quantized) in nats and
    the share whose argmax agrees."""

    kl: float
    top1: float
    rows: int

    def text(self) -> str:
        return f"KL {self.kl:.2e}, top-1 {self.top1:.1%}"

    def as_dict(self) -> dict:
        return {"mean_kl": self.kl, "top1_agreement": self.top1, "rows": self.rows}


def kl_top1(ref: torch.Tensor, quant: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of ``[n, vocab]`` logits: ``KL(softmax(ref) || softmax(quant))`` in nats (float64)
    and whether the argmaxes agree."""
    lp = torch.log_softmax(ref.double(), -1)
    lq = torch.log_softmax(quant.double(), -1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    return kl, ref.argmax(-1) == quant.argmax(-1)


def mean_fidelity(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> Fidelity:
    """``Fidelity`` over every row of ``parts`` (``kl_top1``'s pairs)."""
    kl = torch.cat([k.flatten() for k, _ in parts]) if parts else torch.zeros(0)
    top = torch.cat([t.flatten() for _, t in parts]) if parts else torch.zeros(0)
    n = kl.numel()
    return Fidelity(
        float(kl.mean()) if n else float("nan"),
        float(top.double().mean()) if n else float("nan"),
        n,
    )


@torch.no_grad()
def step_logits(mr: ModelRunner, point: Point, seed: int = 0) -> torch.Tensor:
    """``[bs, vocab]`` float32 logits of one eager decode step at ``point`` (the bench's batch
    for ``seed``), the pages released after."""
    batch, pages = decode_batch(mr, point, seed)
    try:
        return mr.forward(batch).float().clone()
    finally:
        for p in pages:
            mr.kv_cache.release(p)


def compare(ref: ModelRunner, quant: ModelRunner, points: list[Point]) -> dict[Point, Fidelity]:
    """Each point's ``Fidelity`` of ``quant`` against ``ref``: the same batch (same tokens,
    positions, pages) on each, over KV caches holding the same values."""
    out = {}
    for p in points:
        out[p] = mean_fidelity([kl_top1(step_logits(ref, p), step_logits(quant, p))])
    return out


def overall(per_point: dict[Point, Fidelity]) -> Fidelity:
    """The mean over every row of every point (points weighted by their rows)."""
    rows = sum(f.rows for f in per_point.values())
    if not rows:
        return Fidelity(float("nan"), float("nan"), 0)
    kl = sum(f.kl * f.rows for f in per_point.values()) / rows
    top = sum(f.top1 * f.rows for f in per_point.values()) / rows
    return Fidelity(kl, top, rows)


__all__ = ["Fidelity", "compare", "kl_top1", "mean_fidelity", "overall", "step_logits"]
