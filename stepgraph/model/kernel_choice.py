"""Which decode-step kernels a model runs: ``"fused"`` (``fused_decode``, the default on CUDA)
or ``"reference"`` (the unfused kernels: the numerical reference and the CPU path), the check
of a user's choice, and why a model cannot take the fused step."""

from __future__ import annotations

import os

import torch
from torch import nn

from ..errors import ConfigError
from .llama import Linear, LlamaModel
from .parallel import ParallelLMHead, RowParallelLinear, VocabParallelEmbedding

KERNEL_CHOICES = ("fused", "reference")


def buckets_env(name: str, default: range | None) -> range | None:
    """An A/B switch of a bucket range: ``$name`` as ``LO-HI`` (buckets LO..HI) or ``none``;
    ``default`` when unset."""
    raw = os.environ.get(name, "").strip().lower()
    if not raw:
        return default
    try:
        lo, _, hi = raw.partition("-")
        return range(0) if raw == "none" else range(int(lo), int(hi) + 1)
    except ValueError:
        raise ConfigError(f"{name}={raw!r}: give LO-HI (e.g. 2-32) or none") from None


ATTENTION_PARTS = {"1": (True, True), "both": (True, True), "split": (True, False),
                   "combine": (False, True)}  # fmt: skip


def attention_pdl_env(
    name: str = "STEPGRAPH_ATTENTION_PDL",
) -> tuple[bool | int, bool | int, int | None] | None:
    """``$name`` as (PDL on the split kernel, on the combine, trigger mode or None for the
    step's): unset is None (``step_attention``'s defaults); ``0`` is off, (False, False, None);
    ``PARTS[:MODE]``, PARTS one of 1, both, split, combine and MODE one of
    ``pdl.TRIGGER_MODES`` (``split:exit``); or ``SPLIT,COMBINE``, each a mode or 0, which gives
    the two modes themselves (``detached,early``). A bad value is refused."""
    from ..kernels.pdl import TRIGGER_MODES

    text = os.environ.get(name)
    if text is None:
        return None
    if text == "0":
        return (False, False, None)
    modes = {"0": False, **TRIGGER_MODES}
    if "," in text:
        split, _, combine = text.partition(",")
        if split in modes and combine in modes:
            return (modes[split], modes[combine], None)
    else:
        parts, sep, mode = text.partition(":")
        if parts in ATTENTION_PARTS and (not sep or mode in TRIGGER_MODES):
            return (*ATTENTION_PARTS[parts], TRIGGER_MODES[mode] if mode else None)
    raise ConfigError(
        f"{name}={text!r}: expected 0, PARTS[:MODE] (PARTS one of {sorted(ATTENTION_PARTS)}) "
        f"or SPLIT,COMBINE, a MODE one of {sorted(TRIGGER_MODES)} (or 0 in SPLIT,COMBINE)"
    )


def default_kernels(device: torch.device | str) -> str:
    """ "fused" on CUDA, "reference" elsewhere (the CPU runs the torch reference ops)."""
    return "fused" if torch.device(device).type == "cuda" else "reference"


def check_kernels(kernels: str) -> str:
    if kernels not in KERNEL_CHOICES:
        raise ConfigError(
            f"kernels must be one of {', '.join(KERNEL_CHOICES)}, got {kernels!r}; "
            "'reference' runs the unfused kernels (the numerical reference)."
        )
    return kernels


def unfusable_reason(model: LlamaModel) -> str | None:
    """Why the fused step cannot run this model (None: it can). A tensor-parallel shard
    (``model/parallel.py``) can: its all-reduces go between the fused kernels (``_row``)."""
    layer = model.layers[0]
    if not model.embed_tokens.weight.is_cuda:
        return "the fused kernels run on CUDA only"
    if type(model.lm_head) not in (Linear, ParallelLMHead):
        return f"an lm_head of type {type(model.lm_head).__name__}"
    if type(model.embed_tokens) not in (nn.Embedding, VocabParallelEmbedding):
        return f"an embedding of type {type(model.embed_tokens).__name__}"
    for proj in (layer.self_attn.o_proj, layer.mlp.down_proj):
        if type(proj) not in (Linear, RowParallelLinear):
            return f"an o_proj or down_proj of type {type(proj).__name__}"
    half = model.config.head_dim // 2
    if half & (half - 1):
        return f"head_dim / 2 = {half} is not a power of two (the RoPE epilogue needs one)"
    return None


__all__ = ["KERNEL_CHOICES", "check_kernels", "default_kernels", "unfusable_reason"]
