"""The fused decode step: six launches a layer and greedy sampling inside the step.

    r = embed(ids)                                           the residual stream [bs, hidden]
    per layer:
      q = qkv_rope(r)          norm, qkv (+ bias), RoPE, K/V into the pages        1 launch
      o = attention(q)         the backend's split-KV decode (split + combine)     2 launches
      r = r + o_proj(o)        residual add in the GEMV epilogue                   1 launch
      a = gate_up_silu(r)      norm, gate-up, SiLU * up                            1 launch
      r = r + down(a)          residual add in the GEMV epilogue                   1 launch
    logits, tokens = lm_head_argmax(r)   final norm, float32 logits, greedy argmax  2 launches

99 kernels a step for Llama-3.2-1B instead of 164 (``benchmarks/fused_step.py``; 105 and 171
inside the graph runner, which adds its input copies). The fused kernels are launched with
programmatic dependent launch where the GPU has it (``kernels/pdl.py``); the two attention
kernels are not (measured slower with it, see ``flash_decode``). The roundings are the
unfused path's: at one row and ctx 512 the logits equalled the reference kernels' bit for bit
on the H200 (same tiles and reduction order as ``gemv.py``). Measured there (2026-11-30,
``stepgraph bench``, bs=1, ctx 512, mode exact): 0.802 ms, 74% of the bandwidth floor, against
0.997 ms (60%) with ``--kernels reference``.

``ModelRunner.kernels`` chooses: "fused" (the default on CUDA) or "reference" (the unfused
kernels, the numerical reference and the CPU path). The fused kernels serve batches of up to
``FUSED_MAX_BS`` rows of an unsharded model; anything else runs the reference kernels, in
eager, graph and exact mode alike, so the three always run the same kernels for a batch size.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import ConfigError
from ..kernels.gate_up_silu import gate_up_silu
from ..kernels.lm_head_argmax import lm_head_argmax
from ..kernels.norm_gemv import gemv_residual
from ..kernels.qkv_rope import qkv_rope
from .llama import Linear, LlamaModel

KERNEL_CHOICES = ("fused", "reference")
# Rows the fused kernels serve. At one row they beat the reference step (H200, bs=1, ctx 512:
# 0.80 vs 1.00 ms); their several-row path is a broadcast-multiply GEMV far slower than cuBLAS
# (a first version: 7.2 vs 1.2 ms a step at bs=8), so larger batches keep cuBLAS until a tl.dot
# small-M kernel exists.
FUSED_MAX_BS = 1


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
    """Why the fused step cannot run this model (None: it can)."""
    layer = model.layers[0]
    if not model.embed_tokens.weight.is_cuda:
        return "the fused kernels run on CUDA only"
    if type(model.lm_head) is not Linear or type(model.embed_tokens) is not nn.Embedding:
        return "a tensor-parallel shard (its collectives sit between the fused kernels)"
    if type(layer.self_attn.o_proj) is not Linear or type(layer.mlp.down_proj) is not Linear:
        return "a tensor-parallel shard (its collectives sit between the fused kernels)"
    half = model.config.head_dim // 2
    if half & (half - 1):
        return f"head_dim / 2 = {half} is not a power of two (the RoPE epilogue needs one)"
    return None


def fused_decode_step(
    model: LlamaModel,
    backend,  # PagedAttentionBackend, prepared for this step (decode metadata)
    input_ids: torch.Tensor,  # [bs] int64
    positions: torch.Tensor,  # [bs] int64
    *,
    logits_out: torch.Tensor | None = None,  # [bs, vocab] float32
    tokens_out: torch.Tensor | None = None,  # [bs] int64, the greedy tokens
    use_pdl: bool | None = None,
) -> torch.Tensor:  # [bs, vocab] float32 logits
    """One decode step with the fused kernels; the K/V of this token land in the pages at the
    backend's ``out_cache_loc``. ``bs <= 8`` (the kernels' row limit)."""
    meta = backend.meta
    kv = backend.kv_cache
    n_heads = model.config.num_heads
    bs = input_ids.shape[0]
    r = model.embed_tokens(input_ids)  # [bs, hidden], the residual stream
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        norm1, norm2 = layer.input_layernorm, layer.post_attention_layernorm
        # q: [bs, n_heads, head_dim], rotated; this token's K/V are in the pages
        q = qkv_rope(
            r, norm1.weight, attn.qkv_proj.weight, attn.qkv_proj.bias, norm1.eps, positions,
            model.rope_cos, model.rope_sin, kv.k_caches[i], kv.v_caches[i],
            meta.out_cache_loc, n_heads, use_pdl=use_pdl,
        )  # fmt: skip
        o = backend.decode_attention(i, q)  # [bs, n_heads, head_dim]
        r = gemv_residual(o.reshape(bs, -1), attn.o_proj.weight, r, use_pdl=use_pdl)
        a = gate_up_silu(r, norm2.weight, mlp.gate_up_proj.weight, norm2.eps, use_pdl=use_pdl)
        r = gemv_residual(a, mlp.down_proj.weight, r, use_pdl=use_pdl)  # [bs, hidden]
    logits, _ = lm_head_argmax(
        r, model.norm.weight, model.lm_head.weight, model.norm.eps,
        logits_out=logits_out, tokens_out=tokens_out, use_pdl=use_pdl,
    )  # fmt: skip
    return logits


__all__ = [
    "FUSED_MAX_BS",
    "KERNEL_CHOICES",
    "check_kernels",
    "default_kernels",
    "fused_decode_step",
    "unfusable_reason",
]
