"""The Llama / Qwen2 decoder: RMSNorm, RoPE (llama3 scaling), fused qkv and gate-up
projections, SwiGLU, optionally tied embeddings.

Parameter names mirror Hugging Face's without the ``model.`` prefix, except the fused
``self_attn.qkv_proj`` (q, k, v stacked on the output dim) and ``mlp.gate_up_proj`` (gate, up).
The model knows nothing of graphs: attention goes through an attention backend object, whose
``rope_attention(layer_id, qkv, positions, cos_table, sin_table)`` rotates q and k, writes the KV
cache and attends (decode or prefill, as its metadata says). Tokens are flattened: ``T`` is the
batch size for decode, the prompt length for prefill.

On CUDA a layer is ten launches: add+RMSNorm, qkv GEMM, RoPE+KV write, attention (two),
o_proj, add+RMSNorm, gate-up GEMM, SiLU*mul, down GEMM (``stepgraph.kernels.fused_*``,
``rope_kv``). The residual stream travels beside the hidden state, so each residual add is fused
into the next norm (the last one into the final norm). On the CPU the same functions run their
torch references, op for op what transformers does.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError
from ..kernels.elementwise.fused_act import silu_mul, silu_mul_reference
from ..kernels.elementwise.fused_norm import add_rmsnorm, add_rmsnorm_reference
from ..kernels.proj.gemv import MAX_M, gemv
from .config import ModelConfig, rope_inv_freq


def pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """``x`` with zero rows appended up to ``rows`` rows (``x`` itself when it has as many)."""
    n = x.shape[0]
    if n >= rows:
        return x
    padded = x.new_zeros((rows, *x.shape[1:]))
    padded[:n] = x
    return padded


def at_rows(fn, x: torch.Tensor, rows: int) -> torch.Tensor:
    """``fn(x)`` for a row-wise ``fn`` (a projection), computed on ``x`` padded to ``rows`` rows
    and cut back to ``x``'s. cuBLAS picks a GEMM's kernel, and so its reduction order, by the
    row count: an eager step of ``bs`` rows computes its GEMMs at the rows of the graph bucket
    it would replay in, so that it and the graph (exact mode) agree bit for bit."""
    n = x.shape[0]
    return fn(x) if n >= rows else fn(pad_rows(x, rows))[:n]


class AttentionFn(Protocol):
    def rope_attention(
        self,
        layer_id: int,
        qkv: torch.Tensor,  # [T, (n_heads + 2 * n_kv) * head_dim]
        positions: torch.Tensor,  # [T] int64
        cos_table: torch.Tensor,  # [max_positions, head_dim]
        sin_table: torch.Tensor,  # [max_positions, head_dim]
    ) -> torch.Tensor: ...  # [T, n_heads, head_dim]


# torch.mm(a, b, out_dtype=torch.float32): cuBLAS writes float32 from bf16 / fp16 operands
# (CUDA only; no CPU kernel)
_MM_OUT_DTYPE = "dtype" in torch.ops.aten.mm.overloads()


class Linear(nn.Linear):
    """``nn.Linear`` that serves batches of at most ``gemv_max_bs`` rows on CUDA with the
    Triton GEMV (0: always cuBLAS), writing ``out_dtype`` (None: the input's): the GEMV itself,
    and cuBLAS too on CUDA where the layer has no bias (``torch.mm``'s ``out_dtype``), so no
    temporary in the input's dtype is made. ``out``: write the result there (rows of the
    graph runner's shared output) instead of a new tensor. ``LlamaModel.use_gemv`` sets the
    GEMV's rows per projection shape."""

    gemv_max_bs: int = 0
    out_dtype: torch.dtype | None = None

    def forward(
        self, x: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:  # [T, in] -> [T, out]
        if self.gemv_max_bs and x.is_cuda and x.shape[0] <= self.gemv_max_bs:
            y = gemv(x, self.weight, self.bias, self.out_dtype)
        elif self.widens(x):
            return torch.mm(x, self.weight.t(), out_dtype=self.out_dtype, out=out)
        else:
            y = F.linear(x, self.weight, self.bias)
        return y if out is None else out.copy_(y)

    def widens(self, x: torch.Tensor) -> bool:
        """Whether cuBLAS writes ``out_dtype`` itself for ``x``: bf16 / fp16 into float32."""
        return (
            self.out_dtype is torch.float32  # the head alone sets it
            and _MM_OUT_DTYPE
            and x.is_cuda
            and self.bias is None
            and x.dtype in (torch.bfloat16, torch.float16)
            and x.dim() == 2
        )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(
        self,
        x: torch.Tensor,  # [T, dim]
        residual: torch.Tensor | None = None,  # [T, dim]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (normed [T, dim], x + residual [T, dim])
        """``norm(x + residual)`` and ``x + residual`` (``residual=None``: ``norm(x)``, ``x``).
        In float32, then back to the input dtype before the weight (as transformers does)."""
        if x.is_cuda:
            return add_rmsnorm(x, residual, self.weight, self.eps)
        return add_rmsnorm_reference(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    """The projections of one attention layer; ``DecoderLayer`` wires them around the backend's
    ``rope_attention``."""

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
        self.qkv_proj = Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=False)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.inter = config.intermediate_size
        # One GEMM for gate and up: weight [2 * intermediate, hidden]
        self.gate_up_proj = Linear(config.hidden_size, 2 * self.inter, bias=False)
        self.down_proj = Linear(self.inter, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, hidden]
        gate_up = self.gate_up_proj(x)  # [T, 2 * inter]: gate | up
        act = silu_mul(gate_up) if gate_up.is_cuda else silu_mul_reference(gate_up)
        return self.down_proj(act)  # act: [T, inter]


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP. The residual stream travels beside the hidden state, so each
    residual add is fused into the next norm. The two halves around attention are methods of
    their own, which the piecewise prefill captures while attention stays eager."""

    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_id)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def before_attention(
        self,
        x: torch.Tensor,  # [T, hidden], the previous layer's MLP output (or the embeddings)
        residual: torch.Tensor | None,  # [T, hidden], the stream before x (None at layer 0)
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (qkv [T, q_size + 2 * kv_size], residual)
        h, residual = self.input_layernorm(x, residual)
        return self.self_attn.qkv_proj(h), residual

    def after_attention(
        self,
        o: torch.Tensor,  # [T, q_size], attention output (heads flattened)
        residual: torch.Tensor,  # [T, hidden]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (MLP output, residual stream), [T, hidden] each
        h = self.self_attn.o_proj(o)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        residual: torch.Tensor | None,  # [T, hidden] (None at layer 0)
        positions: torch.Tensor,  # [T] int64
        rope: tuple[torch.Tensor, torch.Tensor],
        backend: AttentionFn,
        live: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (MLP output, residual stream), [T, hidden] each
        """``live``: the rows the attention serves (its metadata's); rows past it are padding
        that only the row-wise parts compute (``LlamaModel.forward``'s ``rows``)."""
        qkv, residual = self.before_attention(x, residual)
        if live is None:
            o = backend.rope_attention(self.self_attn.layer_id, qkv, positions, *rope)
            return self.after_attention(o.reshape(x.shape[0], -1), residual)  # [T, H * hd]
        o = backend.rope_attention(self.self_attn.layer_id, qkv[:live], positions[:live], *rope)
        return self.after_attention(pad_rows(o.reshape(live, -1), x.shape[0]), residual)


class LlamaModel(nn.Module):
    """Decoder plus LM head. ``max_positions`` bounds the precomputed RoPE table."""

    def __init__(self, config: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = config
        self.max_positions = max_positions or config.max_position_embeddings
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.lm_head.out_dtype = torch.float32  # the GEMV writes float32 logits directly
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
        rows: int = 0,
        keep_rows: bool = False,
    ) -> torch.Tensor:  # [T, hidden] (keep_rows: [max(T, rows), hidden]), after the final norm
        """``rows``: run the row-wise parts (embedding, norms, projections) on the batch padded
        to this many rows, as a decode graph of that bucket runs them, and the attention on
        the ``T`` live rows; the padding rows are dropped at the end, or kept with
        ``keep_rows`` for a row-wise head that runs at the same rows (cut after it: no second
        padding). An eager decode step passes its graph bucket's rows, so its GEMMs are the
        graph's (``at_rows``)."""
        rope = (self.rope_cos, self.rope_sin)
        n, live = input_ids.shape[0], None
        if rows > n:  # token 0 at position 0: any valid row; the attention never sees it
            input_ids, positions, live = pad_rows(input_ids, rows), pad_rows(positions, rows), n
        x, residual = self.embed_tokens(input_ids), None  # [T, hidden]
        for layer in self.layers:
            x, residual = layer(x, residual, positions, rope, backend, live)
        h = self.norm(x, residual)[0]
        return h if live is None or keep_rows else h[:n]

    def logits(
        self, h: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:  # h: [n, hidden] -> [n, vocab] float32
        """Float32 logits of ``h``: sampling and parity checks read them without another cast.
        The GEMV and cuBLAS write float32 themselves (``Linear.widens``), elsewhere the head's
        output is cast. ``out`` ``[m, vocab]`` float32, ``m <= n``: the first ``m`` rows'
        logits land there (``h`` may carry padding rows past them, the head's GEMM running at
        all ``n``: ``at_rows``); with ``m == n`` the head writes into it, no temporary."""
        head = self.lm_head
        if out is None:
            return head(h).float()
        if out.shape[0] == h.shape[0] and isinstance(head, Linear):
            return head(h, out=out)
        return out.copy_(head(h)[: out.shape[0]])

    def use_gemv(
        self,
        shapes: Mapping[tuple[int, int], int] | Iterable[tuple[int, int]] | str | None = "all",
        max_bs: int = MAX_M,
    ) -> list[str]:
        """Serve small batches of the projections whose weight shape ``(out_features,
        in_features)`` is in ``shapes`` with the Triton GEMV on CUDA, cuBLAS otherwise.

        ``shapes``: "all" (every projection), None (none), shapes (up to ``max_bs`` rows each)
        or ``{shape: max_bs}`` (0: cuBLAS). Returns the names of the projections switched on."""
        if shapes == "all" or shapes is None:
            limit = lambda shape: max_bs if shapes else 0  # noqa: E731
        elif isinstance(shapes, Mapping):
            limit = lambda shape: shapes.get(shape, 0)  # noqa: E731
        else:
            chosen = set(map(tuple, shapes))
            limit = lambda shape: max_bs if shape in chosen else 0  # noqa: E731
        mods = {n: m for n, m in self.named_modules() if isinstance(m, Linear)}
        limits = {n: limit((m.out_features, m.in_features)) for n, m in mods.items()}
        for name, n in limits.items():
            if n > MAX_M:
                raise ConfigError(
                    f"{name}: the Triton GEMV takes at most {MAX_M} rows, got {n}; pass a "
                    "smaller max_bs (cuBLAS serves larger batches)."
                )
        for name, mod in mods.items():
            mod.gemv_max_bs = limits[name]
        return [name for name, n in limits.items() if n]


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


__all__ = [
    "Attention",
    "AttentionFn",
    "at_rows",
    "Linear",
    "LlamaModel",
    "RMSNorm",
    "build_model",
    "init_random",
    "pad_rows",
]
