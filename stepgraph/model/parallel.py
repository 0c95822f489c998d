"""Megatron-style tensor parallelism for the reference model (``llama.py`` is not edited).

A rank's model is a ``LlamaModel`` of a rank-local config (``num_heads / world``, KV heads and
``intermediate_size / world``; ``vocab_size`` stays full because logits are gathered) whose
four boundary modules are swapped for parallel ones:

    qkv_proj, gate_up_proj   column-parallel: a rank holds its heads / its intermediate rows of
                             each fused part ([q; k; v], [gate; up]), sliced apart and re-fused
    o_proj, down_proj        RowParallelLinear: its input columns, then all_reduce(sum)
    embed_tokens             VocabParallelEmbedding: vocab / world rows, ids outside give zeros,
                             then all_reduce(sum)
    lm_head                  ParallelLMHead: its vocab slice of logits, then all_gather

KV heads split across ranks; with fewer KV heads than ranks each rank keeps the one KV head its
query heads read (replicated). The vocab is padded up to a multiple of ``world`` with zero rows
(their logits are dropped). Collectives run on the current stream, so a CUDA graph captures
them (see ``docs/tensor_parallel.md``). With ``world_size == 1`` no collective runs.

    env = init_distributed()                      # under torchrun (model/distributed.py)
    model = shard_model(full_model, env.rank, env.world_size)  # or load_hf_shard(path, ...)
    runner = ModelRunner.from_model(model, device=env.device, dtype=dtype)
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError
from .config import ModelConfig
from .hf_loader import convert_hf_state_dict, load_hf_config, shard_files
from .llama import LlamaModel
from .tp_layout import TPLayout, rank_config, shard_state, take_rank_slice, tp_layout

logger = logging.getLogger("stepgraph")

Group = dist.ProcessGroup | None


# -- parallel modules --------------------------------------------------------------------------


def _all_reduce(x: torch.Tensor, group: Group, world_size: int) -> torch.Tensor:
    if world_size > 1:
        dist.all_reduce(x, group=group)  # in place, on the current stream: graph-capturable
    return x


class RowParallelLinear(nn.Linear):
    """``y = all_reduce(x_r @ W_r^T)``: this rank's input columns of o_proj / down_proj."""

    def __init__(
        self, in_per_rank: int, out_features: int, world_size: int, group: Group = None
    ) -> None:
        super().__init__(in_per_rank, out_features, bias=False)
        self.world_size, self.group = world_size, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, in / world] -> [T, out]
        return _all_reduce(F.linear(x, self.weight), self.group, self.world_size)


class VocabParallelEmbedding(nn.Module):
    """Rows ``[start, start + vocab_per_rank)`` of the (padded) table; others give zeros."""

    def __init__(self, layout: TPLayout, hidden: int, group: Group = None) -> None:
        super().__init__()
        self.start, self.rows = layout.vocab[0], layout.vocab_per_rank
        self.weight = nn.Parameter(torch.empty(self.rows, hidden))
        self.world_size, self.group = layout.world_size, group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids: [T] int64 -> [T, hidden]
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)  # [T] bool
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return _all_reduce(x.masked_fill(outside[:, None], 0.0), self.group, self.world_size)


class ParallelLMHead(nn.Module):
    """This rank's vocab slice of the logits, all-gathered to ``[n, vocab]``."""

    def __init__(self, layout: TPLayout, hidden: int, group: Group = None) -> None:
        super().__init__()
        self.vocab_size, self.world_size = layout.vocab_size, layout.world_size
        self.weight = nn.Parameter(torch.empty(layout.vocab_per_rank, hidden))
        self.group = group

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # h: [n, hidden] -> [n, vocab]
        return self.gather(F.linear(h, self.weight))

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """Every rank's ``[n, vocab_per_rank]`` slice of the logits as ``[n, vocab]``."""
        if self.world_size == 1:
            return local[:, : self.vocab_size]
        n, vr = local.shape
        full = local.new_empty(self.world_size * n, vr)  # [world * n, vocab_per_rank]
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(full, local.contiguous(), group=self.group)
        full = full.view(self.world_size, n, vr).permute(1, 0, 2)  # [n, world, vocab_per_rank]
        return full.reshape(n, self.world_size * vr)[:, : self.vocab_size]


# -- building a rank's model ------------------------------------------------------------------


def build_tp_model(
    config: ModelConfig,
    layout: TPLayout,
    device: torch.device | str,
    dtype: torch.dtype,
    *,
    group: Group = None,
    max_positions: int | None = None,
) -> LlamaModel:
    """An uninitialised rank model: ``LlamaModel(rank_config)`` with the parallel modules."""
    local = rank_config(config, layout)
    if layout.replicated_kv:
        logger.info(
            "stepgraph TP: %d KV heads < world_size %d: KV heads replicated, rank %d keeps "
            "KV head %d",
            config.num_kv_heads,
            layout.world_size,
            layout.rank,
            layout.kv_heads[0],
        )
    hidden, w = config.hidden_size, layout.world_size
    with torch.device("meta"):  # nothing allocated until to_empty: the full vocab costs nothing
        model = LlamaModel(local, max_positions)
        model.embed_tokens = VocabParallelEmbedding(layout, hidden, group)
        model.lm_head = ParallelLMHead(layout, hidden, group)
        for layer in model.layers:
            layer.self_attn.o_proj = RowParallelLinear(local.q_size, hidden, w, group)
            layer.mlp.down_proj = RowParallelLinear(local.intermediate_size, hidden, w, group)
    model = model.to(dtype=dtype).to_empty(device=device)
    if config.tie_word_embeddings:  # the head's slice is the embedding's slice
        model.lm_head.weight = model.embed_tokens.weight
    model.tp_layout = layout
    return model.eval().requires_grad_(False)


@torch.no_grad()
def _load(model: LlamaModel, state: dict[str, torch.Tensor]) -> LlamaModel:
    params = dict(model.named_parameters())  # a tied head appears once, as the embedding
    missing = sorted(set(params) - set(state))
    if missing:
        raise ConfigError(f"no weights for {missing[:4]}; the checkpoint is incomplete.")
    for name, t in state.items():
        if name not in params or tuple(t.shape) != tuple(params[name].shape):
            want = tuple(params[name].shape) if name in params else "no such parameter"
            raise ConfigError(
                f"rank slice of {name} has shape {tuple(t.shape)}, the rank model wants "
                f"{want}; the config and the weights disagree."
            )
        params[name].copy_(t)
    model.build_rope()
    return model


def shard_model(model: LlamaModel, rank: int, world_size: int, group: Group = None) -> LlamaModel:
    """A new model holding rank ``rank``'s slices of ``model`` (same device and dtype)."""
    layout = tp_layout(model.config, rank, world_size)
    w = model.embed_tokens.weight
    tp = build_tp_model(
        model.config, layout, w.device, w.dtype, group=group, max_positions=model.max_positions
    )
    full = dict(model.named_parameters())
    return _load(tp, shard_state(full, model.config, layout))


def load_hf_shard(
    path: str | Path,
    rank: int,
    world_size: int,
    device: torch.device | str,
    dtype: torch.dtype,
    *,
    group: Group = None,
    max_positions: int | None = None,
) -> LlamaModel:
    """Rank ``rank``'s model from a local Hugging Face directory, reading only its slices
    (``safe_open(...).get_slice(name)[rows]``); names as ``hf_loader`` maps them."""
    from safetensors import safe_open

    config = load_hf_config(path)
    layout = tp_layout(config, rank, world_size)
    hf: dict[str, torch.Tensor] = {}
    for f in shard_files(Path(path)):
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                sl = sf.get_slice(name)
                part = name.split(".")[-2]  # model.layers.3.self_attn.q_proj.weight -> q_proj
                get = lambda d, s, sl=sl: sl[s] if d == 0 else sl[:, s]
                hf[name] = take_rank_slice(part, get, layout, config.vocab_size)
    state = convert_hf_state_dict(hf, rank_config(config, layout))
    model = build_tp_model(config, layout, device, dtype, group=group, max_positions=max_positions)
    return _load(model, state)


__all__ = [
    "ParallelLMHead",
    "RowParallelLinear",
    "TPLayout",
    "VocabParallelEmbedding",
    "build_tp_model",
    "load_hf_shard",
    "rank_config",
    "shard_model",
    "tp_layout",
]
