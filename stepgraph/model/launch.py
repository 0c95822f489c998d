"""Build the ModelRunner a command asks for: a preset (random weights from a seed) or a local
Hugging Face directory, unsharded or tensor-parallel over the ranks torchrun started."""

from __future__ import annotations

from pathlib import Path

import torch

from .model_runner import ModelRunner, default_context_len


def build_model_runner(
    model: str,
    device: str | torch.device,
    dtype: torch.dtype,
    *,
    seed: int = 0,
    tp: int = 1,
    max_bs: int = 8,
    max_context_len: int | None = None,
    page_size: int = 16,
    quantization: str | None = None,
) -> ModelRunner:
    """``model``: a preset name or a local HF directory. ``tp > 1`` joins the torchrun process
    group (nccl on CUDA, gloo on the CPU) and returns this rank's shard; every rank builds the
    same preset from ``seed`` before slicing, or reads only its slices of the checkpoint.
    ``quantization="fp8"``: the projections in FP8, quantized on load (unsharded only)."""
    kw = dict(
        max_bs=max_bs,
        max_context_len=max_context_len,
        page_size=page_size,
        quantization=quantization,
    )
    is_dir = Path(model).is_dir()
    if tp > 1:
        _refuse_fp8_shards(model, is_dir, quantization)
    if tp <= 1:
        if is_dir:
            return ModelRunner.from_hf_dir(model, device, dtype, **kw)
        return ModelRunner.from_preset(model, device, dtype, seed, **kw)

    from ..errors import ConfigError
    from .config import get_preset
    from .distributed import init_distributed
    from .hf_loader import load_hf_config
    from .llama import build_model, init_random
    from .parallel import load_hf_shard, shard_model

    env = init_distributed("nccl" if torch.device(device).type == "cuda" else "gloo")
    if env.world_size != tp:
        raise ConfigError(
            f"--tp {tp} but torchrun started {env.world_size} processes; launch with "
            f"`torchrun --nproc-per-node {tp} -m stepgraph ...`."
        )
    config = load_hf_config(model) if is_dir else get_preset(model)
    max_context_len = default_context_len(config, max_context_len)
    if is_dir:
        shard = load_hf_shard(model, env.rank, tp, env.device, dtype, max_positions=max_context_len)
    else:
        full = init_random(
            build_model(config, env.device, dtype, max_positions=max_context_len), seed
        )
        shard = shard_model(full, env.rank, tp)
        del full
    return ModelRunner.from_model(
        shard,
        device=env.device,
        dtype=dtype,
        max_bs=max_bs,
        max_context_len=max_context_len,
        page_size=page_size,
    )


def _refuse_fp8_shards(model: str, is_dir: bool, quantization: str | None) -> None:
    """ConfigError before any process group: tensor-parallel shards take no FP8 weights."""
    from ..errors import ConfigError
    from .hf_loader import read_json
    from .quant import detect_format

    fmt = detect_format(read_json(Path(model) / "config.json")) if is_dir else None
    if quantization is not None or fmt is not None:
        found = f"quantization={quantization!r}" if quantization else fmt.describe()
        raise ConfigError(
            f"{found} with tensor parallelism is not supported: FP8 weights run unsharded (tp=1)"
        )


def is_main_rank() -> bool:
    """Rank 0, or the only process: the one that prints."""
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


_LEFT_GROUP: list[bool] = []  # set once finish() has left a process group


def finish() -> None:
    """Leave the process group, if one was joined."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
        _LEFT_GROUP.append(True)


def exit_after_group(status: int) -> int:
    """``status``; a process that left a process group exits here at once (``os._exit``, after
    flushing). At interpreter exit gloo's C++ threads sometimes abort the process ("terminate
    called without an active exception", about 1 run in 3 of ``generate --tp 2`` on the CPU),
    after all its work is done and printed."""
    if _LEFT_GROUP:
        import os
        import sys

        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status
