"""Which decode-step kernels a model runs: ``"fused"`` (``fused_decode``, the default on CUDA)
or ``"reference"`` (the unfused kernels: the numerical reference and the CPU path), the check
of a user's choice, and why a model cannot take the fused step."""

from __future__ import annotations

import torch
from torch import nn

from ...errors import ConfigError
from ..fp8_linear import Fp8Linear
from ..llama import Linear, LlamaModel
from ..parallel import ParallelLMHead, RowParallelLinear, VocabParallelEmbedding

KERNEL_CHOICES = ("fused", "reference")


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
        if type(proj) not in (Linear, RowParallelLinear, Fp8Linear):
            return f"an o_proj or down_proj of type {type(proj).__name__}"
    half = model.config.head_dim // 2
    if half & (half - 1):
        return f"head_dim / 2 = {half} is not a power of two (the RoPE epilogue needs one)"
    return None


__all__ = ["KERNEL_CHOICES", "check_kernels", "default_kernels", "unfusable_reason"]
