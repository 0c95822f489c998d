"""``RunnerConfig``: how a ``CudaGraphRunner`` captures, as one frozen object."""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any

from ..buckets import DEFAULT_MAX_BS, default_capture_sizes, validate_buckets
from ..errors import ConfigError, check_flags
from .input_checks import CHECK_LEVELS

MODES = ("graph", "exact")


@dataclass(frozen=True)
class RunnerConfig:
    """How a ``CudaGraphRunner`` captures.

    ``capture_bs`` defaults to ``[1, 2, 4, 8] + 16..max_bs step 16``; when given, ``max_bs`` is
    its largest entry. ``mode="exact"`` retunes split-KV attention nodes to the live KV length
    before each replay (needs ``stepgraph.graph_update`` and flash-decode kernels in the step).
    ``enable_torch_compile`` compiles the forward of every bucket up to ``torch_compile_max_bs``
    before capturing it (``compile_bs``); larger buckets capture the forward as it is.
    """

    max_bs: int = DEFAULT_MAX_BS
    capture_bs: tuple[int, ...] | None = None
    mode: str = "graph"
    enable_torch_compile: bool = False
    torch_compile_max_bs: int = 32
    torch_compile_mode: str = "max-autotune-no-cudagraphs"  # the graph runner owns the graphs
    # Eager runs of each bucket before its capture, at most. With ``warmup_until_settled``, a
    # run after the first follows only a run that used a Triton kernel variant for the first
    # time (``capture_step``): the second run of a bucket whose kernels were all loaded already
    # bought nothing (docs/experiments.md#warm-ups-until-nothing-new-loads). Set it False for a
    # model with lazy state of its own that needs every run.
    warmup_iters: int = 2
    warmup_until_settled: bool = True
    backend: str = "auto"  # "cuda", "cpu" (stand-in) or "auto" (by device)
    show_progress: bool = True
    freeze_gc: bool = True
    # Fill static inputs with one copy of a packed batch and unpack inside the graph (a few
    # device copies) instead of one host launch per field. See ``stepgraph.batch.pack_batch``.
    packed_inputs: bool = True
    # Write the packed rows into one of two pinned host slots and copy them to the device
    # inside the graph (``runner/staging.py``): no device copy launched per replay. ``None``
    # (default): on where it wins, CUDA graphs of packed inputs (``stages``).
    pinned_staging: bool | None = None
    # Value checks before each replay (``runner/input_checks.py``): "host" checks host copies
    # (no sync), "full" also device-only tensors (a sync: debugging), "off" nothing.
    check_inputs: str = "host"

    def __post_init__(self) -> None:
        for name in ("max_bs", "warmup_iters", "torch_compile_max_bs"):
            value = getattr(self, name)  # bool is an int in Python: refused by name too
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise ConfigError(
                    f"{name} must be an int, got {value!r} ({type(value).__name__}); pass a "
                    f"whole number, e.g. {name}={type(self).__dataclass_fields__[name].default}."
                )
        check_flags(
            enable_torch_compile=self.enable_torch_compile,
            warmup_until_settled=self.warmup_until_settled,
            show_progress=self.show_progress,
            freeze_gc=self.freeze_gc,
            packed_inputs=self.packed_inputs,
        )
        if self.torch_compile_max_bs < 0:
            raise ConfigError(
                f"torch_compile_max_bs must be >= 0 (0: no bucket compiled), got "
                f"{self.torch_compile_max_bs}."
            )
        if self.mode not in MODES:
            raise ConfigError(f"mode must be one of {MODES}, got {self.mode!r}.")
        if self.check_inputs not in CHECK_LEVELS:
            raise ConfigError(
                f"check_inputs must be one of {CHECK_LEVELS}, got {self.check_inputs!r}."
            )
        if not (self.pinned_staging is None or isinstance(self.pinned_staging, bool)):
            raise ConfigError(
                f"pinned_staging must be True, False or None (auto), got {self.pinned_staging!r}."
            )
        if self.pinned_staging is True and not self.packed_inputs:
            raise ConfigError(
                "pinned_staging stages the packed rows; set packed_inputs=True with it, or "
                "pinned_staging=False."
            )
        if self.warmup_iters < 1:
            raise ConfigError(
                "warmup_iters must be >= 1: capture needs one eager warm-up "
                "to compile kernels and settle lazy buffers."
            )
        if self.capture_bs is not None:
            validate_buckets(self.capture_bs)
        elif self.max_bs < 1:
            raise ConfigError(f"max_bs must be >= 1, got {self.max_bs}.")

    def stages(self, backend_is_cuda: bool) -> bool:
        """Whether replays stage the packed rows in pinned memory: as set, or by default on
        CUDA graphs of packed inputs (a replay then launches nothing but the graph; measured
        in ``benchmarks/runner_overhead.py``). The CPU stand-in stages only when asked."""
        if self.pinned_staging is None:
            return backend_is_cuda and self.packed_inputs
        return self.pinned_staging

    def buckets(self) -> list[int]:
        if self.capture_bs is not None:
            return list(self.capture_bs)
        return default_capture_sizes(self.max_bs)

    def compile_buckets(self) -> list[int]:
        """The buckets whose forward is compiled before capture (empty without compile)."""
        if not self.enable_torch_compile:
            return []
        return [bs for bs in self.buckets() if bs <= self.torch_compile_max_bs]


def model_rows(model_runner: Any) -> int | None:
    """The most rows ``model_runner``'s static buffers hold (its ``max_bs``), or None where it
    does not say (a model runner of your own without ``max_bs``: no limit)."""
    rows = getattr(model_runner, "max_bs", None)
    return rows if isinstance(rows, int) and not isinstance(rows, bool) else None


def config_for(model_runner: Any, config: RunnerConfig | None, **defaults: Any) -> RunnerConfig:
    """``config``, or by default ``RunnerConfig(max_bs=model_runner.max_bs, **defaults)``;
    ``ConfigError`` naming both numbers when ``config``'s largest bucket is above
    ``model_runner.max_bs`` (a capture of that bucket would overrun its row buffers)."""
    rows = model_rows(model_runner)
    if config is None:
        return RunnerConfig(**defaults) if rows is None else RunnerConfig(max_bs=rows, **defaults)
    largest = max(config.buckets())
    if rows is not None and largest > rows:
        raise ConfigError(
            f"the runner config captures batches of up to {largest} rows, but the model runner "
            f"was built for max_bs={rows}; pass RunnerConfig(max_bs={rows}) (or capture_bs up "
            f"to {rows}), or build the model runner with max_bs={largest}."
        )
    return config
