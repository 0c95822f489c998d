"""Joining the process group torchrun describes: the one place that reads its environment."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ..errors import ConfigError

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device


def torchrun_world_size() -> int | None:
    """``WORLD_SIZE`` when torchrun started this process (it sets every one of its variables),
    else ``None``: a lone process."""
    if any(k not in os.environ for k in _TORCHRUN_VARS):
        return None
    return int(os.environ["WORLD_SIZE"])


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


__all__ = ["DistEnv", "init_distributed", "torchrun_world_size"]
