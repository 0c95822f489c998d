"""Which rows and columns of each weight a tensor-parallel rank holds (pure slicing, no
collectives): the layout, the rank-local config and the slicing of a full state dict."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from ..errors import ConfigError
from .config import ModelConfig


@dataclass(frozen=True)
class TPLayout:
    """The slices rank ``rank`` of ``world_size`` holds, as ``[start, stop)`` ranges."""

    rank: int
    world_size: int
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    inter: tuple[int, int]  # rows of gate and of up, columns of down
    vocab: tuple[int, int]  # rows of the padded vocab; stop - start = vocab_per_rank
    vocab_size: int  # the real vocab (logits are trimmed to it)
    head_dim: int
    replicated_kv: bool

    def span(self, kind: str) -> slice:
        """Element range of ``kind`` ("q", "kv", "inter", "vocab") on the split dim."""
        if kind in ("q", "kv"):
            a, b = self.q_heads if kind == "q" else self.kv_heads
            return slice(a * self.head_dim, b * self.head_dim)
        return slice(*(self.inter if kind == "inter" else self.vocab))

    @property
    def vocab_per_rank(self) -> int:
        return self.vocab[1] - self.vocab[0]


def tp_layout(config: ModelConfig, rank: int, world_size: int) -> TPLayout:
    """The layout of ``rank``; ``ConfigError`` if the model cannot be split ``world_size`` ways."""
    w = world_size
    if w < 1 or not 0 <= rank < w:
        raise ConfigError(f"need 0 <= rank < world_size, got rank={rank}, world_size={w}.")
    h, kv, inter = config.num_heads, config.num_kv_heads, config.intermediate_size
    for name, n in (("num_heads", h), ("intermediate_size", inter)):
        if n % w:
            raise ConfigError(
                f"{name}={n} is not divisible by the tensor-parallel size {w}; use a "
                f"world_size that divides it (or run unsharded with world_size=1)."
            )
    if kv % w and w % kv:
        raise ConfigError(
            f"num_kv_heads={kv} and world_size={w}: one must divide the other so KV heads are "
            "either split evenly or replicated whole; pick another world_size."
        )
    hr = h // w
    if kv >= w:
        kv_heads = (rank * kv // w, (rank + 1) * kv // w)
    else:  # replicate: the KV head that this rank's query heads read
        first = rank * hr // (h // kv)
        kv_heads = (first, first + 1)
    vr = -(-config.vocab_size // w)
    return TPLayout(
        rank=rank,
        world_size=w,
        q_heads=(rank * hr, (rank + 1) * hr),
        kv_heads=kv_heads,
        inter=(rank * inter // w, (rank + 1) * inter // w),
        vocab=(rank * vr, (rank + 1) * vr),
        vocab_size=config.vocab_size,
        head_dim=config.head_dim,
        replicated_kv=kv < w,
    )


def rank_config(config: ModelConfig, layout: TPLayout) -> ModelConfig:
    """The shapes one rank's layers have (``vocab_size`` stays full: logits are gathered)."""
    return replace(
        config,
        num_heads=layout.q_heads[1] - layout.q_heads[0],
        num_kv_heads=layout.kv_heads[1] - layout.kv_heads[0],
        intermediate_size=layout.inter[1] - layout.inter[0],
    )


# Unfused part -> (split dim, layout span); norms and everything else are replicated.
_RULES = {
    "q_proj": (0, "q"),
    "k_proj": (0, "kv"),
    "v_proj": (0, "kv"),
    "gate_proj": (0, "inter"),
    "up_proj": (0, "inter"),
    "o_proj": (1, "q"),
    "down_proj": (1, "inter"),
    "embed_tokens": (0, "vocab"),
    "lm_head": (0, "vocab"),
}
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def take_rank_slice(
    part: str, get: Callable[[int, slice], torch.Tensor], layout: TPLayout, full: int
):
    """Rank slice of unfused ``part`` of ``full`` rows; ``get(dim, slice)`` reads it."""
    rule = _RULES.get(part)
    if rule is None:
        return get(0, slice(None))
    dim, kind = rule
    s = layout.span(kind)
    if kind != "vocab":
        return get(dim, s)
    t = get(0, slice(s.start, min(s.stop, full)))  # the last rank may hold padding rows
    return torch.cat([t, t.new_zeros(layout.vocab_per_rank - t.shape[0], *t.shape[1:])])


def shard_state(
    state: dict[str, torch.Tensor], config: ModelConfig, layout: TPLayout
) -> dict[str, torch.Tensor]:
    """Our parameter names (fused qkv / gate-up) -> this rank's slices, re-fused."""
    sizes = {"q_proj": config.q_size, "k_proj": config.kv_size, "v_proj": config.kv_size}
    sizes |= {"gate_proj": config.intermediate_size, "up_proj": config.intermediate_size}
    out = {}
    for name, t in state.items():
        module = name.split(".")[-2]  # layers.3.self_attn.qkv_proj.weight -> qkv_proj
        parts = _FUSED.get(module, (module,))
        pieces = t.split([sizes[p] for p in parts]) if len(parts) > 1 else (t,)
        rank_parts = []
        for part, x in zip(parts, pieces):
            get = lambda d, s, x=x: x[s] if d == 0 else x[:, s]
            rank_parts.append(take_rank_slice(part, get, layout, config.vocab_size))
        out[name] = torch.cat(rank_parts)
    return out


__all__ = ["TPLayout", "rank_config", "shard_state", "take_rank_slice", "tp_layout"]
