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

    env = init_distributed()                                   # under torchrun
    model = shard_model(full_model, env.rank, env.world_size)  # or load_hf_shard(path, ...)
    runner = ModelRunner.from_model(model, device=env.device, dtype=dtype)
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError
from .config import ModelConfig
from .hf_loader import convert_hf_state_dict, load_hf_config, shard_files
from .llama import LlamaModel

logger = logging.getLogger("stepgraph")

Group = dist.ProcessGroup | None
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


# -- layout: which rows and columns a rank holds ----------------------------------------------


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
        local = F.linear(h, self.weight)  # [n, vocab_per_rank]
        if self.world_size == 1:
            return local[:, : self.vocab_size]
        n, vr = local.shape
        full = local.new_empty(self.world_size * n, vr)  # [world * n, vocab_per_rank]
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(full, local.contiguous(), group=self.group)
        full = full.view(self.world_size, n, vr).permute(1, 0, 2)  # [n, world, vocab_per_rank]
        return full.reshape(n, self.world_size * vr)[:, : self.vocab_size]


# -- building a rank's model ------------------------------------------------------------------

# Unfused part -> (split dim, layout span); norms and everything else are replicated.
_RULES = {
    "q_proj": (0, "q"), "k_proj": (0, "kv"), "v_proj": (0, "kv"),
    "gate_proj": (0, "inter"), "up_proj": (0, "inter"),
    "o_proj": (1, "q"), "down_proj": (1, "inter"),
    "embed_tokens": (0, "vocab"), "lm_head": (0, "vocab"),
}  # fmt: skip
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _take(part: str, get: Callable[[int, slice], torch.Tensor], layout: TPLayout, full: int):
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
            rank_parts.append(_take(part, get, layout, config.vocab_size))
        out[name] = torch.cat(rank_parts)
    return out


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
            config.num_kv_heads, layout.world_size, layout.rank, layout.kv_heads[0],
        )  # fmt: skip
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
                hf[name] = _take(part, get, layout, config.vocab_size)
    state = convert_hf_state_dict(hf, rank_config(config, layout))
    model = build_tp_model(config, layout, device, dtype, group=group, max_positions=max_positions)
    return _load(model, state)


# -- process group ----------------------------------------------------------------------------


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device


def init_distributed(backend: str | None = None, timeout_s: float = 300.0) -> DistEnv:
    """Join the process group torchrun describes (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``MASTER_ADDR``/``MASTER_PORT``). ``backend`` defaults to nccl with CUDA, else gloo; for
    nccl the current CUDA device becomes ``cuda:LOCAL_RANK``."""
    missing = [k for k in _TORCHRUN_VARS if k not in os.environ]
    if missing:
        raise ConfigError(
            f"environment variables {missing} are not set; launch with `torchrun "
            "--nproc-per-node N script.py`, or set them (or use world_size=1, unsharded)."
        )
    rank, world, local_rank = (int(os.environ[k]) for k in _TORCHRUN_VARS[:3])
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    device = torch.device("cpu")
    if backend == "nccl":
        if local_rank >= torch.cuda.device_count():
            raise ConfigError(
                f"LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} GPUs are "
                "visible; run fewer processes per node (--nproc-per-node)."
            )
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    if not dist.is_initialized():
        timeout = timedelta(seconds=timeout_s)
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout)
    return DistEnv(rank, world, local_rank, device)


__all__ = [
    "DistEnv", "ParallelLMHead", "RowParallelLinear", "TPLayout", "VocabParallelEmbedding",
    "build_tp_model", "init_distributed", "load_hf_shard", "rank_config", "shard_model",
    "shard_state", "tp_layout",
]  # fmt: skip
