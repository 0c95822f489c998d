"""``ModelConfig``: the shape of a Llama / Qwen2 decoder, its presets, and the Hugging Face
``config.json`` translation."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..errors import ConfigError

ARCHITECTURES = ("llama", "qwen2")
# Hugging Face ``architectures[0]`` -> ours.
HF_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3 frequency scaling (the only rope scaling we support): long wavelengths are
    divided by ``factor``, short ones kept, the band between smoothly interpolated."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None  # None, or llama3 scaling (a dict is converted)
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2); o_proj never has one
    max_position_embeddings: int = 8192
    architecture: str = "llama"
    # ids that end a request (the checkpoint's eos_token_id); () for presets: random weights
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.rope_scaling, Mapping):
            object.__setattr__(self, "rope_scaling", _rope_scaling(dict(self.rope_scaling)))
        if self.architecture not in ARCHITECTURES:
            raise ConfigError(
                f"architecture {self.architecture!r} is not supported; use one of {ARCHITECTURES}."
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}.")
        if self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads={self.num_heads} must be a positive multiple of "
                f"num_kv_heads={self.num_kv_heads} (grouped-query attention)."
            )
        if self.head_dim < 2 or self.head_dim % 2:
            raise ConfigError(f"head_dim must be even (RoPE rotates pairs), got {self.head_dim}.")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def with_layers(self, num_layers: int) -> ModelConfig:
        """The same shapes with fewer (or more) layers: a fast real-shaped test model."""
        return replace(self, num_layers=num_layers)

    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any]) -> ModelConfig:
        """Translate a Hugging Face ``config.json`` dict (transformers 4.x or 5.x layout)."""
        archs = hf.get("architectures") or []
        arch = HF_ARCHITECTURES.get(archs[0]) if archs else None
        if arch is None:
            arch = {"llama": "llama", "qwen2": "qwen2"}.get(hf.get("model_type", ""))
        if arch is None:
            raise ConfigError(
                f"unsupported architecture {archs or hf.get('model_type')!r}; stepgraph loads "
                f"{sorted(HF_ARCHITECTURES)} checkpoints only."
            )
        if hf.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act {hf['hidden_act']!r} is not supported; only 'silu'.")
        if hf.get("mlp_bias", False):
            raise ConfigError("mlp_bias=True is not supported (no Llama/Qwen2 release uses it).")
        if arch == "llama" and hf.get("attention_bias", False):
            raise ConfigError(
                "Llama with attention_bias=True (bias on o_proj too) is not supported."
            )
        if arch == "qwen2" and hf.get("use_sliding_window", False):
            raise ConfigError("Qwen2 sliding-window attention is not supported; disable it.")
        # transformers 5 nests theta and scaling in ``rope_parameters``; 4.x has them top-level.
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "llama3"):
            raise ConfigError(
                f"rope type {rope_type!r} is not supported; only default and 'llama3' scaling."
            )
        n_heads = hf["num_attention_heads"]
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=n_heads,
            num_kv_heads=hf.get("num_key_value_heads") or n_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // n_heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=_rope_scaling(rope) if rope_type == "llama3" else None,
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            attention_bias=arch == "qwen2",  # Qwen2 always biases q/k/v
            max_position_embeddings=hf.get("max_position_embeddings", 8192),
            architecture=arch,
            eos_token_ids=eos_token_ids(hf.get("eos_token_id")),
        )


def eos_token_ids(value: Any) -> tuple[int, ...]:
    """A Hugging Face ``eos_token_id`` (None, an int or a list of ints) as a tuple of ints."""
    if value is None:
        return ()
    values = [value] if isinstance(value, int) else list(value)
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in values):
        raise ConfigError(f"eos_token_id must be an int or a list of ints >= 0, got {value!r}.")
    return tuple(values)


def _rope_scaling(d: dict[str, Any]) -> RopeScaling:
    try:
        return RopeScaling(
            factor=float(d["factor"]),
            low_freq_factor=float(d["low_freq_factor"]),
            high_freq_factor=float(d["high_freq_factor"]),
            original_max_position_embeddings=int(d["original_max_position_embeddings"]),
        )
    except KeyError as e:
        raise ConfigError(f"llama3 rope scaling is missing {e}; got {d}.") from e


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` float32, computed as transformers does."""
    dim = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    s = config.rope_scaling
    if s is None:
        return inv
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / s.factor, inv)  # long waves: / factor
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


_LLAMA3_SCALING = dict(low_freq_factor=1.0, high_freq_factor=4.0)
PRESETS: dict[str, ModelConfig] = {
    # CPU tests: a few MB, every code path of the real models (GQA, tied head, llama3 rope).
    "tiny": ModelConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling=RopeScaling(8.0, **_LLAMA3_SCALING, original_max_position_embeddings=64),
        tie_word_embeddings=True,
        max_position_embeddings=2048,
    ),
    "tiny-qwen2": ModelConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        tie_word_embeddings=True,
        attention_bias=True,
        max_position_embeddings=2048,
        architecture="qwen2",
    ),
    "llama-3.2-1b": ModelConfig(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=RopeScaling(32.0, **_LLAMA3_SCALING, original_max_position_embeddings=8192),
        tie_word_embeddings=True,
        max_position_embeddings=131072,
    ),
    "qwen2.5-0.5b": ModelConfig(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_layers=24,
        num_heads=14,
        num_kv_heads=2,
        head_dim=64,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        tie_word_embeddings=True,
        attention_bias=True,
        max_position_embeddings=32768,
        architecture="qwen2",
    ),
    "llama-3.1-8b": ModelConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=RopeScaling(8.0, **_LLAMA3_SCALING, original_max_position_embeddings=8192),
        tie_word_embeddings=False,
        max_position_embeddings=131072,
    ),
}


def get_preset(name: str) -> ModelConfig:
    """The config of preset ``name`` (weights are random, from a seed; see ``init_random``)."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(
            f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}, or load a local "
            "Hugging Face directory (ModelRunner.from_hf_dir)."
        ) from None


__all__ = ["ModelConfig", "PRESETS", "RopeScaling", "get_preset", "rope_inv_freq"]
