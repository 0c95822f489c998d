"""The reference Llama / Qwen2 model: config and presets, decoder, paged KV cache, Hugging Face
loader, attention backend, model runner and the serving engine.

Subpackages: ``decode`` (the fused decode step and the choices it makes per bucket, the decode rows
and graph walks) and ``prefill`` (packed prefill over cached prefixes, eager, piecewise and
whole-graph).
"""

from __future__ import annotations

from .attention import PagedAttentionBackend
from .config import PRESETS, ModelConfig, RopeScaling, get_preset
from .kv_cache import KVCache, PageAllocator
from .llama import LlamaModel, build_model, init_random
from .model_runner import ModelRunner

__all__ = [
    "KVCache",
    "LlamaModel",
    "ModelConfig",
    "ModelRunner",
    "PRESETS",
    "PageAllocator",
    "PagedAttentionBackend",
    "RopeScaling",
    "build_model",
    "get_preset",
    "init_random",
]
