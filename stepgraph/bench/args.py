"""The checks of `stepgraph bench` arguments, all before any work starts: a bad value is one
line, ``stepgraph: error: argument --flag: ...``, exit status 2, not an error after the run.
``--serve`` and ``--prefill`` add their own (``serve_args.py``, ``prefill.py``)."""

from __future__ import annotations

import argparse

import torch

from ..cli_args import (
    UsageError,
    check_output_path,
    check_threads,
    check_tp,
    choose_modes,
    int_list,
    model_config,
    resolve_device,
    resolve_dtype,
)
from ..model.fp8_linear import LOAD_BLOCKS
from .constants import CPU_MAX_BS, CPU_MODES, DTYPES, GPU_MAX_BS
from .modes import OUR_MODES
from .peers import PEERS
from .serve_args import serve_flags_given
from .workload import bench_bytes, memory_shortfall

GPU_SIZES, GPU_CONTEXTS = [1, 8, 32], [512, 4096, 32768]  # the decode bench's defaults
CPU_SIZES, CPU_CONTEXTS = [1, 2], [16, 64]


def bench_modes(text: str | None, device: str) -> list[str] | None:
    """``--modes``: ours and the peers; on the CPU only eager and graph. ``None``: default."""
    known = OUR_MODES + PEERS
    why = (
        "with --device cpu: exact edits CUDA graph nodes, compile and the HF peers are timed "
        "with CUDA events; run them on a GPU"
    )
    return choose_modes(text, known, CPU_MODES if device == "cpu" else known, why)


NO_GPU_NOTE = (
    "stepgraph bench: no GPU visible: running the CPU stand-in (--device cpu); pass --device "
    "cuda to require a GPU"
)


def choose_device(args: argparse.Namespace) -> bool:
    """Fill in ``args.device`` and ``args.dtype``: no ``--device`` runs on CUDA when a GPU is
    visible, else on the CPU stand-in (returns True: the caller says so first); ``--device cuda``
    without a GPU is refused. The dtype defaults to bfloat16 on CUDA, float32 on the CPU."""
    fell_back = args.device is None and not torch.cuda.is_available()
    fix = "or pass --device cpu (or no --device) for the CPU stand-in"
    args.device = resolve_device(args.device, fix)
    args.dtype = resolve_dtype(args.dtype, args.device)
    return fell_back


def check_mode_flags(args: argparse.Namespace) -> None:
    """A flag of one mode given to another is refused, naming the flag and the mode it needs:
    the ``--serve`` flags without ``--serve``; with ``--prefill`` the decode bench's flags
    (``--serve`` refuses its own list, ``check_serve_args``); ``--threads`` on CUDA and
    ``--peer-points`` on the CPU (no peers run there)."""
    serve, prefill = getattr(args, "serve", False), getattr(args, "prefill", False)
    if not serve:
        for flag in serve_flags_given(args):
            raise UsageError(
                f"{flag} applies only with --serve (the serving benchmark); add --serve, or "
                f"drop {flag}"
            )
    if prefill:
        decode_only = {
            "--modes": args.modes is not None,
            "--plot": args.plot is not None,
            "--batch-sizes": args.batch_sizes is not None,
            "--contexts": args.contexts is not None,
            "--peer-points": args.peer_points is not None,
            "--tp": args.tp != 1,
            "--kernels": args.kernels is not None,
        }
        for flag, given in decode_only.items():
            if given:
                raise UsageError(
                    f"{flag} does not apply to --prefill (it times eager vs piecewise prefill, "
                    f"one table); drop {flag}, or drop --prefill for the decode bench"
                )
    check_threads(args.threads, args.device)
    if args.device == "cpu" and not serve and not prefill and args.peer_points is not None:
        raise UsageError(
            "--peer-points applies only on CUDA (the peers run on a GPU; the CPU bench times "
            "eager and graph); drop --peer-points"
        )


def check_bench_args(args: argparse.Namespace) -> None:
    """Every ``stepgraph bench`` argument, before the model is built: with the decode bench
    also the modes, ``--tp`` (torchrun), the contexts the model can hold, and the memory all
    points need at once (``check_bench_memory``). ``args.device`` and ``args.dtype`` are
    resolved first (``choose_device``)."""
    check_mode_flags(args)
    sizes = int_list("--batch-sizes", args.batch_sizes)
    most = GPU_MAX_BS if args.device == "cuda" else CPU_MAX_BS
    if sizes and max(sizes) > most:
        raise UsageError(
            f"argument --batch-sizes: {max(sizes)} rows is more than the bench takes on "
            f"{args.device} ({most}); pass batch sizes of at most {most}"
        )
    contexts = int_list("--contexts", args.contexts)
    check_output_path("--json", args.json)
    check_output_path("--plot", args.plot, image=True)
    cuda = args.device == "cuda"
    model = args.model or ("llama-3.2-1b" if cuda else "tiny")
    config = model_config(model)
    if getattr(args, "serve", False) or getattr(args, "prefill", False):
        return
    bench_modes(args.modes, args.device)
    check_tp(args.tp, "bench")
    sizes = sizes or (GPU_SIZES if cuda else CPU_SIZES)
    contexts = contexts or (GPU_CONTEXTS if cuda else CPU_CONTEXTS)
    limit = config.max_position_embeddings
    if max(contexts) > limit:
        raise UsageError(
            f"argument --contexts: {max(contexts)} tokens is more than {model}'s "
            f"max_position_embeddings={limit}; pass contexts of at most {limit}"
        )
    dtype = DTYPES[args.dtype]
    parts = bench_bytes(config, dtype, max(sizes), max(contexts) + 64)
    if quant := getattr(args, "quantization", None):
        parts.update(quantized_model_bytes(parts, config, dtype, LOAD_BLOCKS[quant]))
    check_bench_memory(parts, args, args.tp)


def quantized_model_bytes(
    parts: dict[str, int], config, dtype: torch.dtype, block: tuple[int, int] | None = None
) -> dict[str, int]:
    """The second model that ``--quantization fp8`` builds beside the first (``parts``, its
    ``bench_bytes``): a KV cache and logits as large, and its weights with the projections in
    e4m3 (one byte an element, a float32 scale per output row, or per ``block``) and the rest
    (embeddings, norms, the LM head) in ``dtype``."""
    elt = torch.empty((), dtype=dtype).element_size()
    h, q, kv, inter = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    shapes = [(q + 2 * kv, h), (h, q), (2 * inter, h), (h, inter)]  # a layer's projections
    elems = sum(n * k for n, k in shapes)
    scales = sum(n if block is None else -(-n // block[0]) * -(-k // block[1]) for n, k in shapes)
    proj = config.num_layers * elems
    fp8_weights = parts["weights"] - proj * elt + proj + 4 * config.num_layers * scales
    return {
        "FP8 model's KV cache": parts["KV cache"],
        "FP8 model's weights": fp8_weights,
        "FP8 model's logits": parts["logits"],
    }


def check_bench_memory(parts: dict[str, int], args: argparse.Namespace, tp: int = 1) -> None:
    """Refuse up front what cannot fit (as the KV cache's ``check_memory`` does), naming the
    flags that set it: ``parts`` (``bench_bytes``) against the memory free on the device. With
    ``--tp`` on CUDA each rank holds a shard on its own GPU; on the CPU the ranks share it."""
    device = args.device
    short = memory_shortfall(parts, device, tp if device == "cuda" else 1)
    if short is None:
        return
    need, free, each = short
    raise UsageError(
        f"argument --batch-sizes/--contexts: the largest batch size at the longest context "
        f"needs at least {need / 2**30:.2f} GiB ({each}), but {free / 2**30:.2f} GiB is free "
        f"on {device}; lower --batch-sizes or --contexts"
        + (" (or drop --quantization)" if any(k.startswith("FP8") for k in parts) else "")
    )


__all__ = [
    "CPU_CONTEXTS",
    "CPU_SIZES",
    "GPU_CONTEXTS",
    "GPU_SIZES",
    "NO_GPU_NOTE",
    "bench_modes",
    "check_bench_args",
    "check_bench_memory",
    "check_mode_flags",
    "choose_device",
    "quantized_model_bytes",
]
