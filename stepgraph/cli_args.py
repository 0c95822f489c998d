"""Argument checks for the command line: every value is checked before anything runs, and an
error names the flag. ``main`` prints each as one line, ``stepgraph: error: <message>``, exit 2
(``--debug`` adds the traceback)."""

from __future__ import annotations

import argparse
import math
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

from .errors import StepGraphError


class UsageError(StepGraphError):
    """A command-line argument that cannot be used as given."""


class Parser(argparse.ArgumentParser):
    """``error`` raises (one line in ``main``) instead of printing usage and exiting; the
    subcommand parsers inherit it (``add_subparsers`` builds them of this class)."""

    def error(self, message: str):  # type: ignore[override]
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def run_main(func: Callable[[list[str]], int], argv: list[str] | None) -> int:
    """``func(argv)`` with user errors turned into one line on stderr and exit status 2:
    every ``StepGraphError`` (argument and config errors included) and file errors
    (``OSError``). ``--debug`` anywhere in ``argv`` also prints the traceback."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    try:
        return func(argv)
    except (StepGraphError, OSError) as e:
        if debug:
            traceback.print_exc()
        message = " ".join(str(e).split()) or type(e).__name__
        print(f"stepgraph: error: {message}", file=sys.stderr)
        return 2


# -- value types (argparse ``type=``; argparse names the flag in the error) -----------------


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def nonneg_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def int_list(flag: str, text: str | None) -> list[int] | None:
    """``"1,8,32"`` -> ``[1, 8, 32]``, each >= 1; ``None`` stays ``None`` (the default)."""
    if text is None:
        return None
    items = text.split(",")
    try:
        values = [int(x) for x in items]
    except ValueError:
        raise UsageError(
            f"argument {flag}: expected positive integers separated by commas, got {text!r}"
        ) from None
    if not values or min(values) < 1:
        raise UsageError(f"argument {flag}: every value must be >= 1, got {text!r}")
    return values


def check_prompts(prompts: list[list[int]], max_new_tokens: int, config, flag: str) -> None:
    """Ids within the vocabulary; prompt + new tokens within ``max_position_embeddings``."""
    vocab, limit = config.vocab_size, config.max_position_embeddings
    for i, p in enumerate(prompts):
        bad = [t for t in p if not 0 <= t < vocab]
        if bad:
            raise UsageError(f"argument {flag}: prompt {i} has ids outside [0, {vocab}): {bad[:5]}")
        if len(p) + max_new_tokens - 1 > limit:
            raise UsageError(
                f"argument {flag}: prompt {i} has {len(p)} tokens; with --max-new-tokens "
                f"{max_new_tokens} it needs {len(p) + max_new_tokens - 1} positions, more than "
                f"the model's max_position_embeddings={limit}"
            )


def model_config(model: str):
    """The ``ModelConfig`` of ``--model``: a local HF directory or a preset, else an error
    saying it is neither (nothing is downloaded)."""
    from .model.config import PRESETS

    if Path(model).is_dir():
        from .model.hf_loader import load_hf_config

        return load_hf_config(model)
    if model in PRESETS:
        return PRESETS[model]
    raise UsageError(
        f"argument --model: {model!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor a "
        "directory; pass a preset name or the path of a local Hugging Face checkpoint"
    )


def resolve_device(device: str | None) -> str:
    """``--device``, default cuda when a GPU is visible; cuda without one is one-line error."""
    import torch

    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError(
            "argument --device: cuda, but no CUDA GPU is visible; run on a machine with an "
            "NVIDIA GPU, or pass --device cpu"
        )
    return device


def check_output_path(flag: str, path: str | None) -> None:
    """A file to write later: its directory must exist now, not after minutes of work."""
    if path is not None and not Path(path).resolve().parent.is_dir():
        raise UsageError(f"argument {flag}: directory {Path(path).parent} does not exist")


def check_bench_args(args: argparse.Namespace) -> None:
    """``stepgraph bench`` arguments, before the model is built."""
    int_list("--batch-sizes", args.batch_sizes)
    int_list("--contexts", args.contexts)
    for flag in ("tp", "iters"):
        if getattr(args, flag, 1) < 1:
            raise UsageError(f"argument --{flag}: must be >= 1, got {getattr(args, flag)}")
    check_output_path("--json", args.json)
    check_output_path("--plot", args.plot)
    if args.model is not None:
        model_config(args.model)


__all__ = [
    "Parser",
    "UsageError",
    "check_bench_args",
    "check_output_path",
    "check_prompts",
    "int_list",
    "model_config",
    "nonneg_float",
    "positive_int",
    "resolve_device",
    "run_main",
]
