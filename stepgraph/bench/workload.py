"""The decode workload `stepgraph bench` times: a model, a KV cache filled with random keys and
values, and one decode batch per (batch size, context) point."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..batch import ForwardBatch
from ..model.fp8_linear import fp8_modules
from ..model.model_runner import ModelRunner


@dataclass(frozen=True)
class Point:
    bs: int
    context: int  # KV length of every request, this step's token included


def build_model_runner(
    model: str,
    device: str,
    dtype: torch.dtype,
    max_bs: int,
    max_context: int,
    seed: int = 0,
    page_size: int = 64,
    tp: int = 1,
    quantization: str | None = None,
) -> ModelRunner:
    """A preset (random weights from ``seed``) or a local HF directory, with a KV cache that
    holds ``max_bs`` requests of ``max_context`` tokens; ``tp > 1``: this rank's shard;
    ``quantization="fp8"``: the projections in FP8, quantized on load."""
    from ..model.launch import build_model_runner as build

    return build(
        model,
        device,
        dtype,
        seed=seed,
        tp=tp,
        max_bs=max_bs,
        max_context_len=max_context,
        page_size=page_size,
        quantization=quantization,
    )


def fill_kv_random(mr: ModelRunner, seed: int = 0) -> None:
    """Random K/V everywhere (never zeros: zeros run faster than real data)."""
    g = torch.Generator(device=mr.device).manual_seed(seed)
    for cache in (*mr.kv_cache.k_caches, *mr.kv_cache.v_caches):
        cache.normal_(generator=g)


def decode_batch(mr: ModelRunner, point: Point, seed: int = 0) -> tuple[ForwardBatch, list]:
    """``point.bs`` requests of ``point.context`` tokens; returns the batch and their pages
    (release each with ``mr.kv_cache.release`` when done)."""
    g = torch.Generator().manual_seed(seed)
    pages = [mr.kv_cache.reserve(point.context) for _ in range(point.bs)]
    tokens = torch.randint(1, mr.config.vocab_size, (point.bs,), generator=g).tolist()
    batch = mr.decode_batch(tokens, [point.context - 1] * point.bs, pages)
    batch.max_seq_len = point.context
    return batch, pages


def weight_bytes(mr: ModelRunner) -> int:
    """Bytes of weights a decode step reads: every parameter once, except an untied input
    embedding, of which a step reads only ``bs`` rows; FP8 projections as they are held (e4m3
    data and float32 scales, ``Fp8Linear.nbytes``), the head in the model's dtype."""
    model = mr.model
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    total += sum(m.weight.numel() + 4 * m.weight_scale.numel() for m in fp8_modules(model).values())
    if not mr.config.tie_word_embeddings:
        emb = model.embed_tokens.weight
        total -= emb.numel() * emb.element_size()
    return total


def param_count(config) -> int:
    """Parameters of a ``ModelConfig``'s model, counted from its shapes (before building it)."""
    h, q, kv, inter = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    layer = h * (q + 2 * kv) + q * h + h * 2 * inter + inter * h + 2 * h  # + the two norms
    if config.attention_bias:
        layer += q + 2 * kv
    head = 0 if config.tie_word_embeddings else config.vocab_size * h
    return config.vocab_size * h + config.num_layers * layer + h + head


def bench_bytes(
    config, dtype: torch.dtype, max_bs: int, max_context: int, page_size: int = 64
) -> dict[str, int]:
    """What the bench holds at once, by part, before anything is built: the KV cache for
    ``max_bs`` requests of ``max_context`` tokens (sized as ``ModelRunner.from_model`` sizes
    it), the weights, and two ``[max_bs, vocab]`` float32 logits (the eager step's and the
    graph's static output). Activations and the attention's gathers come on top."""
    elt = torch.empty((), dtype=dtype).element_size()
    pages = max_bs * -(-max_context // page_size) + 1
    return {
        "KV cache": 2 * config.num_layers * pages * page_size * config.kv_size * elt,
        "weights": param_count(config) * elt,
        "logits": 2 * max_bs * config.vocab_size * 4,
    }


def kv_bytes(mr: ModelRunner, point: Point) -> int:
    """Bytes of live K and V a step reads: every layer, every request's ``context`` tokens."""
    c = mr.config
    elt = mr.kv_cache.k_caches[0].element_size()
    return point.bs * point.context * c.num_layers * 2 * c.num_kv_heads * c.head_dim * elt


def memory_shortfall(parts: dict[str, int], device: str, ranks: int = 1) -> tuple | None:
    """``(need, free, each)`` when ``parts`` (bytes by what holds them, split over ``ranks``)
    cannot fit in the memory free on ``device``: bytes needed and free, and the parts as text
    in GiB; None when they fit or the free memory is unknown."""
    from ..model.kv_cache import free_bytes

    need, free = sum(parts.values()) // ranks, free_bytes(device)
    if free is None or need <= free:
        return None
    return need, free, ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in parts.items())
