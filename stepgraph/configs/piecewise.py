"""Piecewise capture configs (mstar's ``cuda_graph_config`` API): one sub-region of a submodule's
forward, captured per shape while the surrounding preamble stays eager (run by
``piecewise_runner.PiecewiseRunner``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch

from ..buckets import distribute_tokens, validate_buckets
from ..errors import ConfigError, check_flags
from .padding import PAD_SEQ_LEN, SPARE_SLOTS, pad_lengths


class PiecewiseConfigType(Enum):
    BATCHED = "batched"
    PACKED = "packed"


@dataclass(frozen=True)
class PiecewiseCaptureShape:
    """One piecewise capture bucket. Handed to the static-input factory and the step
    declaration so both generalize across config types."""

    bs: int
    seq_lens: list[int]  # per request slot; packed shapes add the spare slot (padding.py)
    total_tokens: int

    @property
    def num_requests(self) -> int:
        """Request slots: ``bs``, plus the spare slot of a packed shape."""
        return len(self.seq_lens)


@dataclass(frozen=True)
class PiecewiseCallInputs:
    """Everything a captured region is handed, at capture and at replay alike.

    Both calls go through here so a region can't accidentally read something that only exists
    on one of the two paths. ``step`` is what ``declare_step`` returned (``None`` without one).
    """

    static_inputs: dict[str, torch.Tensor]
    engine_inputs: Any
    kwargs: dict[str, Any] = field(default_factory=dict)
    step: Any = None

    @property
    def resources(self) -> dict[str, Any]:
        """The declared step's resources as a dict: the step itself if it is a mapping, else its
        ``resources`` attribute; ``{}`` when no step was declared."""
        step = self.step
        if step is None:
            return {}
        if isinstance(step, Mapping):
            return dict(step)
        res = getattr(step, "resources", None)
        if isinstance(res, Mapping):
            return dict(res)
        raise ConfigError(
            f"declare_step returned a {type(step).__name__}, which is neither a mapping nor has "
            "a 'resources' mapping; return a dict of resources (or None)."
        )


@dataclass(frozen=True, kw_only=True)
class PiecewiseCudaGraphConfig(ABC):
    """One inner callable of a submodule's forward, captured on its own.

    Unlike ``CudaGraphConfig``, which describes a whole ``forward_batched`` the engine drives,
    this describes a SUB-REGION the submodule invokes itself while the surrounding preamble stays
    eager. kw_only so subclasses can add required fields (e.g. ``seq_len``) without colliding
    with the defaulted ones here.
    """

    capture_fn: Callable[[PiecewiseCallInputs], dict[str, torch.Tensor]]
    make_static_inputs: Callable[[PiecewiseCaptureShape], dict[str, torch.Tensor]]
    declare_step: Callable[[list[str], list[int]], Any] | None = None
    lease_before_step: bool = False
    forward_kwargs: dict[str, Any] = field(default_factory=dict)
    capture_batch_sizes: list[int] | None = None
    compile: bool = False

    def __post_init__(self) -> None:
        if not callable(self.capture_fn) or not callable(self.make_static_inputs):
            raise ConfigError("capture_fn and make_static_inputs must be callables.")
        if self.declare_step is not None and not callable(self.declare_step):
            raise ConfigError(
                f"declare_step must be a callable (names, seq_lens) -> step or None, got "
                f"{type(self.declare_step).__name__}."
            )
        check_flags(lease_before_step=self.lease_before_step, compile=self.compile)
        if not isinstance(self.forward_kwargs, Mapping):
            raise ConfigError(
                f"forward_kwargs must be a dict of keyword arguments, got "
                f"{type(self.forward_kwargs).__name__}."
            )
        if self.capture_batch_sizes is not None:
            validate_buckets(self.capture_batch_sizes, "capture_batch_sizes")

    @abstractmethod
    def get_config_type(self) -> PiecewiseConfigType: ...

    @abstractmethod
    def get_capture_shapes(self, batch_sizes: list[int]) -> list[PiecewiseCaptureShape]:
        """The (bs, seq_lens, total_tokens) buckets to capture.

        ``batch_sizes`` is the resolved list the runner iterates (``capture_batch_sizes`` or the
        runner default)."""

    @abstractmethod
    def replay_seq_lens(
        self, shape: PiecewiseCaptureShape, seq_lens: list[int] | None, real_bs: int
    ) -> list[int]:
        """Per-request lengths to declare at replay, padded to ``shape.bs``."""

    def _check_real_bs(self, shape: PiecewiseCaptureShape, real_bs: int) -> None:
        if not 1 <= real_bs <= shape.bs:
            raise ConfigError(f"real_bs must be in 1..{shape.bs} for this shape, got {real_bs}.")


@dataclass(frozen=True, kw_only=True)
class PiecewiseBatchedConfig(PiecewiseCudaGraphConfig):
    """Equal-length batched capture: static input ``[bs, seq_len, D]``."""

    seq_len: int

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.seq_len, int) or isinstance(self.seq_len, bool) or self.seq_len < 1:
            raise ConfigError(f"seq_len must be an int >= 1, got {self.seq_len!r}.")

    def get_config_type(self) -> PiecewiseConfigType:
        return PiecewiseConfigType.BATCHED

    def get_capture_shapes(self, batch_sizes: list[int]) -> list[PiecewiseCaptureShape]:
        sizes = validate_buckets(batch_sizes, "batch_sizes")
        return [PiecewiseCaptureShape(bs, [self.seq_len] * bs, bs * self.seq_len) for bs in sizes]

    def replay_seq_lens(
        self, shape: PiecewiseCaptureShape, seq_lens: list[int] | None, real_bs: int
    ) -> list[int]:
        """Real lengths (``seq_len`` each when ``seq_lens`` is ``None``; each in 1..seq_len, the
        rest of its row is padding the region must mask), then ``PAD_SEQ_LEN`` (1) for each of
        the ``shape.bs - real_bs`` padded rows. Padded rows are whole rows of their own, so they
        never change a real row's output.

        Example: shape (bs=4), seq_len=4, real [3, 4] -> [3, 4, 1, 1].
        """
        self._check_real_bs(shape, real_bs)
        lens = [self.seq_len] * real_bs if seq_lens is None else list(seq_lens)
        if len(lens) != real_bs or any(not 1 <= n <= self.seq_len for n in lens):
            raise ConfigError(
                f"seq_lens must hold {real_bs} lengths in 1..{self.seq_len}, got {seq_lens}."
            )
        return lens + [PAD_SEQ_LEN] * (shape.bs - real_bs)


@dataclass(frozen=True, kw_only=True)
class PiecewisePackedConfig(PiecewiseCudaGraphConfig):
    """Packed variable-length capture: static input ``[total_tokens, D]``.

    One graph per (bs, token bucket). Each bucket is partitioned across bs requests for the
    capture-time plan (``distribute_tokens``) plus an empty spare slot; real per-request lengths
    arrive at replay. Any batch of at most ``bs`` requests and ``total_tokens`` tokens fits the
    shape (``padding.py``). Shapes with ``total_tokens < bs`` are skipped.
    """

    total_tokens: list[int]

    def __post_init__(self) -> None:
        super().__post_init__()
        validate_buckets(self.total_tokens, "total_tokens")

    def get_config_type(self) -> PiecewiseConfigType:
        return PiecewiseConfigType.PACKED

    def get_capture_shapes(self, batch_sizes: list[int]) -> list[PiecewiseCaptureShape]:
        sizes = validate_buckets(batch_sizes, "batch_sizes")
        return [
            PiecewiseCaptureShape(bs, distribute_tokens(t, bs) + [0] * SPARE_SLOTS, t)
            for bs in sizes
            for t in self.total_tokens
            if t >= bs
        ]

    def replay_seq_lens(
        self, shape: PiecewiseCaptureShape, seq_lens: list[int] | None, real_bs: int
    ) -> list[int]:
        """Real lengths first, unchanged; then the ``shape.bs - real_bs`` padded requests and
        the spare slot (``padding.pad_lengths``), so the lengths sum to ``shape.total_tokens``.
        Padding tokens never join a real request, so they cannot change a real output.

        Example: shape (bs=4, total=12), real [5, 2] -> [5, 2, 1, 1, 3].
        """
        self._check_real_bs(shape, real_bs)
        if seq_lens is None or len(seq_lens) != real_bs or any(n < 1 for n in seq_lens):
            raise ConfigError(
                f"a packed replay needs seq_lens: {real_bs} lengths >= 1, got {seq_lens}."
            )
        pad = pad_lengths(sum(seq_lens), real_bs, shape.bs, shape.total_tokens)
        if pad is None:
            raise ConfigError(
                f"{real_bs} requests of {sum(seq_lens)} tokens do not fit shape "
                f"(bs={shape.bs}, total_tokens={shape.total_tokens}); pick a larger shape."
            )
        return list(seq_lens) + pad
