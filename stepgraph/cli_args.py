"""Argument checks for the command line: every value is checked before anything runs, and an
error names the flag. ``main`` prints each as one line, ``stepgraph: error: <message>``, exit 2
(``--debug`` adds the traceback)."""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

from .errors import SEED_MAX, StepGraphError


class UsageError(StepGraphError):
    """A command-line argument that cannot be used as given."""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` says each flag's default, except where there is none to say (``None``, a
    switch that is off) or the help text already says it (a default that depends on the
    device)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        unset = action.default is None or action.default is False  # not `in`: 0 == False
        if unset or action.default == argparse.SUPPRESS or "default" in text:
            return text
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """``error`` raises (one line in ``main``) instead of printing usage and exiting; the
    subcommand parsers inherit it (``add_subparsers`` builds them of this class).

    A value that starts with ``-`` and a digit is a value, not a flag: ``--prompt-ids -1,2``
    reaches the id check (argparse alone takes only ``-1`` or ``-1.5`` for numbers, and calls
    ``-1,2`` an unknown flag, "expected one argument")."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"^-\.?\d")  # no flag starts with a digit

    def error(self, message: str):  # type: ignore[override]
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def run_main(func: Callable[[list[str]], int], argv: list[str] | None) -> int:
    """``func(argv)`` with user errors turned into one line on stderr and exit status 2:
    every ``StepGraphError`` (argument and config errors included) and file errors
    (``OSError``). ``--debug`` anywhere in ``argv`` also prints the traceback. A reader of
    stdout that closed the pipe early ends the command quietly (``closed_pipe``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    try:
        status = func(argv)
        sys.stdout.flush()  # a reader that left early shows here, not at interpreter exit
        return status
    except BrokenPipeError:
        return closed_pipe()
    except (StepGraphError, OSError) as e:
        if debug:
            traceback.print_exc()
        message = " ".join(str(e).split()) or type(e).__name__
        print(f"stepgraph: error: {message}", file=sys.stderr)
        return 2


SIGPIPE_STATUS = 128 + 13  # the shell's status of a process ended by SIGPIPE (``cat``)


def closed_pipe() -> int:
    """Stdout's reader has gone (``stepgraph bench | head -1``): end quietly, as ``cat`` does.
    Stdout is pointed at /dev/null so that the interpreter's final flush fails no more."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # no real stdout (a test's capture): nothing left to flush
        pass
    return SIGPIPE_STATUS


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


def cpu_threads(text: str) -> int:
    """``--threads``: torch's CPU threads, 1 up to the cores of this machine (more only
    contend for them)."""
    value = positive_int(text)
    cores = os.cpu_count() or 1
    if value > cores:
        raise argparse.ArgumentTypeError(
            f"{value} threads is more than the {cores} cores of this machine; pass at most {cores}"
        )
    return value


def seed_int(text: str) -> int:
    """A seed for the weights, the mixes and sampling: an integer in ``[0, 2**64)``."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not 0 <= value <= SEED_MAX:
        raise argparse.ArgumentTypeError(
            f"must be in [0, 2**64 - 1] (a 64-bit seed), got {value}; pass a seed in that range"
        )
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


def resolve_device(device: str | None, fix: str = "or pass --device cpu") -> str:
    """``--device``, default cuda when a GPU is visible; cuda without one is a one-line error
    that ends in ``fix``."""
    import torch

    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError(
            "argument --device: cuda, but no CUDA GPU is visible; run on a machine with an "
            f"NVIDIA GPU, {fix}"
        )
    return device


def resolve_dtype(dtype: str | None, device: str) -> str:
    """``--dtype``, default bfloat16 on CUDA and float32 on the CPU."""
    return dtype or ("bfloat16" if device == "cuda" else "float32")


def check_threads(threads: int | None, device: str) -> None:
    """``--threads`` sets torch's CPU threads: refused on CUDA, where it would change nothing."""
    if device == "cuda" and threads is not None:
        raise UsageError(
            "--threads applies only with --device cpu (torch's CPU threads); drop --threads"
        )


def check_output_path(flag: str, path: str | None, image: bool = False) -> None:
    """A file to write later, checked now rather than after minutes of work: not a directory,
    in a directory that exists and can be written; ``image``: a format matplotlib writes."""
    if path is None:
        return
    file = Path(path)
    if file.is_dir():
        raise UsageError(f"argument {flag}: {path} is a directory; give a file name in it")
    parent = file.resolve().parent
    if not parent.is_dir():
        raise UsageError(f"argument {flag}: directory {file.parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise UsageError(f"argument {flag}: directory {file.parent} is not writable")
    if image:
        try:
            from matplotlib.backend_bases import FigureCanvasBase
        except ImportError as e:
            raise UsageError(f"argument {flag}: needs matplotlib; pip install matplotlib") from e
        formats = sorted(FigureCanvasBase.get_supported_filetypes())
        if file.suffix.lower().lstrip(".") not in formats:
            raise UsageError(
                f"argument {flag}: {path} is not an image file matplotlib writes; end the "
                f"name in .png (or {', '.join('.' + f for f in formats if f != 'png')})"
            )


def check_tp(tp: int, command: str) -> None:
    """``--tp N`` > 1 needs N processes that torchrun started; refuse it in a lone process
    (it would run unsharded) or under a torchrun of another size."""
    if tp <= 1:
        return
    from .model.distributed import torchrun_world_size

    world = torchrun_world_size()
    launch = f"`torchrun --nproc-per-node {tp} -m stepgraph {command} --tp {tp} ...`"
    if world is None:
        raise UsageError(
            f"argument --tp: {tp} ranks need {tp} processes, and this one was not started by "
            f"torchrun; launch it with {launch}, or drop --tp"
        )
    if world != tp:
        raise UsageError(
            f"argument --tp: {tp}, but torchrun started {world} processes; launch it with "
            f"{launch}, or pass --tp {world}"
        )


def choose_modes(
    text: str | None, known: tuple[str, ...], runnable: tuple[str, ...], why: str
) -> list[str] | None:
    """``--modes``: ``None`` (the default), else names of ``known``, each in ``runnable`` on
    this device (``why`` says why the others are not)."""
    if text is None:
        return None
    chosen = [m.strip() for m in text.split(",") if m.strip()]
    if not chosen:
        raise UsageError(
            f"argument --modes: {text!r} names no mode; give a comma list of "
            f"{','.join(known)}, or drop --modes for the default"
        )
    unknown = [m for m in chosen if m not in known]
    if unknown:
        raise UsageError(
            f"argument --modes: unknown {','.join(unknown)}; choose from {','.join(known)}"
        )
    other = [m for m in chosen if m not in runnable]
    if other:
        raise UsageError(
            f"argument --modes: {','.join(other)} cannot run here ({why}); choose from "
            f"{','.join(runnable)}"
        )
    return chosen


# -- shared flag groups: each flag is defined once, with its type, choices and check above ------

DEVICES = ("cuda", "cpu")
DTYPE_NAMES = ("bfloat16", "float16", "float32")
DECODE_MODES = ("eager", "graph", "exact")
KERNELS = ("fused", "reference")
MODEL_HELP = "preset name or local HF directory"
QUANTIZATIONS = ("fp8", "fp8-block")  # model/fp8_linear.QUANTIZATIONS (it imports torch)
QUANTIZATION_HELP = (
    "fp8: the projections' weights in FP8 (e4m3), quantized per channel on load; fp8-block: "
    "a scale per 128x128 block (an FP8 checkpoint loads in FP8 without it); default: the "
    "checkpoint's own weights"
)
DEVICE_HELP = "default: cuda when a GPU is seen"
DTYPE_HELP = "default: bfloat16 on CUDA, float32 on the CPU"
TP_HELP = "tensor-parallel ranks (launch with torchrun --nproc-per-node N)"
THREADS_HELP = "torch CPU threads, at most the cores (--device cpu; default 1, or OMP_NUM_THREADS)"


def add_device_args(
    p: argparse.ArgumentParser, *, device_help: str = DEVICE_HELP, dtype_help: str = DTYPE_HELP
) -> argparse._ArgumentGroup:
    """``--device`` (``resolve_device``) and ``--dtype`` (``resolve_dtype``), both default None:
    the command fills them in once it knows whether a GPU is visible."""
    g = p.add_argument_group("device")
    g.add_argument("--device", choices=DEVICES, default=None, help=device_help)
    g.add_argument("--dtype", choices=DTYPE_NAMES, default=None, help=dtype_help)
    return g


def add_model_args(
    p: argparse.ArgumentParser,
    *,
    model: str | None = None,
    required: bool = False,
    model_help: str = MODEL_HELP,
    mode_help: str | None = None,
    kernels_help: str | None = None,
    seed_help: str | None = None,
    tp_help: str | None = None,
    threads: bool = False,
    quantization_help: str | None = QUANTIZATION_HELP,
) -> argparse._ArgumentGroup:
    """The model and how its decode steps run: ``--model`` (``model_config``) always, and each
    of ``--quantization``, ``--mode``, ``--kernels``, ``--seed`` (``seed_int``), ``--tp``
    (``check_tp``) when its help is given, ``--threads`` (``cpu_threads``, ``check_threads``)
    when ``threads``."""
    g = p.add_argument_group("model")
    g.add_argument("--model", default=model, required=required, help=model_help)
    if quantization_help is not None:
        g.add_argument(
            "--quantization", default=None, choices=QUANTIZATIONS, help=quantization_help
        )
    if mode_help is not None:
        g.add_argument("--mode", default="graph", choices=DECODE_MODES, help=mode_help)
    if kernels_help is not None:
        g.add_argument("--kernels", default=None, choices=KERNELS, help=kernels_help)
    if seed_help is not None:
        g.add_argument("--seed", type=seed_int, default=0, help=seed_help)
    if tp_help is not None:
        g.add_argument("--tp", type=positive_int, default=1, help=tp_help)
    if threads:
        g.add_argument("--threads", type=cpu_threads, default=None, help=THREADS_HELP)
    return g


__all__ = [
    "DECODE_MODES",
    "DEVICES",
    "DTYPE_NAMES",
    "QUANTIZATIONS",
    "HelpFormatter",
    "KERNELS",
    "Parser",
    "SEED_MAX",
    "SIGPIPE_STATUS",
    "UsageError",
    "add_device_args",
    "add_model_args",
    "check_output_path",
    "check_threads",
    "closed_pipe",
    "cpu_threads",
    "check_prompts",
    "check_tp",
    "choose_modes",
    "int_list",
    "model_config",
    "nonneg_float",
    "positive_int",
    "resolve_device",
    "resolve_dtype",
    "run_main",
    "seed_int",
]
