"""The Llama / Qwen2 decoder: RMSNorm, RoPE (llama3 scaling), fused qkv and gate-up
projections, SwiGLU, optionally tied embeddings.

Parameter names mirror Hugging Face's without the ``model.`` prefix, except the fused
``self_attn.qkv_proj`` (q, k, v stacked on the output dim) and ``mlp.gate_up_proj`` (gate, up).
The model knows nothing of graphs: attention goes through an attention backend object, whose
``attention(layer_id, q, k, v)`` writes the KV cache and attends (decode or prefill, as its
metadata says). Tokens are flattened: ``T`` is the batch size for decode, the prompt length for
prefill.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig, rope_inv_freq


class AttentionFn(Protocol):
    def attention(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor: ...


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, dim]
        # In float32, then back to the input dtype before the weight (as transformers does).
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def apply_rope(
    x: torch.Tensor,  # [T, heads, head_dim]
    cos: torch.Tensor,  # [T, head_dim]
    sin: torch.Tensor,  # [T, head_dim]
) -> torch.Tensor:  # [T, heads, head_dim]
    """Rotate-half RoPE (the Hugging Face layout: pairs are (i, i + head_dim/2))."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.n_heads, self.n_kv, self.head_dim = (
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
        )
        self.q_size, self.kv_size = config.q_size, config.kv_size
        # One GEMM for q, k and v: weight [q_size + 2 * kv_size, hidden]
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, head_dim]
        sin: torch.Tensor,  # [T, head_dim]
        backend: AttentionFn,
    ) -> torch.Tensor:  # [T, hidden]
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rope(q.view(t, self.n_heads, self.head_dim), cos, sin)  # [T, n_heads, hd]
        k = apply_rope(k.view(t, self.n_kv, self.head_dim), cos, sin)  # [T, n_kv, hd]
        v = v.view(t, self.n_kv, self.head_dim)  # [T, n_kv, hd]
        o = backend.attention(self.layer_id, q, k, v)  # [T, n_heads, hd]
        return self.o_proj(o.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.inter = config.intermediate_size
        # One GEMM for gate and up: weight [2 * intermediate, hidden]
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * self.inter, bias=False)
        self.down_proj = nn.Linear(self.inter, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, hidden]
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)  # [T, inter] each
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_id)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, backend: AttentionFn) -> torch.Tensor:  # x: [T, hidden]
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """Decoder plus LM head. ``max_positions`` bounds the precomputed RoPE table."""

    def __init__(self, config: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = config
        self.max_positions = max_positions or config.max_position_embeddings
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # cos/sin tables [max_positions, head_dim]; filled by build_rope() once on the device
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)

    def build_rope(self) -> None:
        """Fill the cos/sin tables on the model's device, in float32 then the model's dtype
        (as transformers computes them: angle = position * inv_freq in float32)."""
        device = self.embed_tokens.weight.device
        dtype = self.embed_tokens.weight.dtype
        inv_freq = rope_inv_freq(self.config).to(device)  # [head_dim / 2]
        pos = torch.arange(self.max_positions, device=device, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq[None, :]  # [max_positions, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]
        self.rope_cos = emb.cos().to(dtype)
        self.rope_sin = emb.sin().to(dtype)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        backend: AttentionFn,
    ) -> torch.Tensor:  # [T, hidden], after the final norm
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]  # [T, head_dim]
        x = self.embed_tokens(input_ids)  # [T, hidden]
        for layer in self.layers:
            x = layer(x, cos, sin, backend)
        return self.norm(x)

    def logits(self, h: torch.Tensor) -> torch.Tensor:  # h: [n, hidden] -> [n, vocab] float32
        # float32 logits: sampling and parity checks read them without another cast.
        return self.lm_head(h).float()


@torch.no_grad()
def init_random(model: LlamaModel, seed: int, std: float = 0.02) -> LlamaModel:
    """Fill every weight from ``seed`` (on the model's device).

    - embeddings ~ N(0, std); biases ~ N(0, std), non-zero so that a bias bug shows;
    - projections ~ N(0, 1 / fan_in) (0.022 at hidden 2048): each layer moves the residual
      stream as much as the embedding does, so attention shapes the next token;
    - layer norms ~ 1 + N(0, std); the final norm ~ N(0, 1): with tied embeddings a final
      weight near 1 makes ``logits ~ e_last . e_j``, and an untrained model would only repeat
      its last token (a random-sign weight cancels that self-match in expectation).
    """
    device = model.embed_tokens.weight.device
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in sorted(model.named_parameters()):  # tied weights appear once
        noise = torch.randn(p.shape, generator=gen, device=device, dtype=torch.float32)
        if name == "norm.weight":
            p.copy_(noise)
        elif name.endswith("norm.weight"):
            p.copy_(1.0 + std * noise)
        elif p.dim() == 2 and name != "embed_tokens.weight":
            p.copy_(noise * p.shape[1] ** -0.5)
        else:
            p.copy_(std * noise)
    model.build_rope()
    return model


def build_model(
    config: ModelConfig,
    device: torch.device | str,
    dtype: torch.dtype,
    *,
    max_positions: int | None = None,
) -> LlamaModel:
    """An uninitialised model on ``device`` (built on meta: no wasted default init)."""
    with torch.device("meta"):
        model = LlamaModel(config, max_positions)
    model = model.to(dtype=dtype).to_empty(device=device)
    if config.tie_word_embeddings:  # to_empty keeps sharing, but make it explicit
        model.lm_head.weight = model.embed_tokens.weight
    return model.eval().requires_grad_(False)


__all__ = ["Attention", "LlamaModel", "RMSNorm", "apply_rope", "build_model", "init_random"]
