"""Declarative capture configs (seed 004): what to capture, at which sizes, with which layout.

Two families:

- ``CudaGraphConfig`` describes a whole ``forward_batched``-style method the engine drives
  (``config_runner.ConfigGraphRunner``). ``BatchedCudaGraphConfig`` lays requests out as
  ``[bs, tokens_per_request, ...]``; ``PackedCudaGraphConfig`` packs them as
  ``[total_tokens, ...]`` plus ``cu_seqlens [bs + 1] int32``.
- ``PiecewiseCudaGraphConfig`` describes one sub-region a submodule invokes itself while its
  preamble stays eager (``piecewise.PiecewiseRunner``).

Each config type owns its buffer layout and its padding rule; the runners only copy and replay.
The defaulted fields of ``CudaGraphConfig`` are keyword-only so that subclasses can add their
required fields in the seed's positional order (``BatchedCudaGraphConfig(walk, inputs)``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, field
from enum import Enum
from typing import Any

import torch

from .buckets import DEFAULT_MAX_BS, default_capture_sizes, distribute_tokens, validate_buckets
from .errors import ConfigError

# One request's inputs: name -> tensor. Packed: first dim is that request's tokens.
# Batched: the per-request tensor [tokens_per_request, ...].
NodeInputs = dict[str, torch.Tensor]

CU_SEQLENS = "cu_seqlens"  # packed layouts: cumulative request offsets, [bs + 1] int32
PAD_SEQ_LEN = 1  # the length a padded request declares: the minimum, never 0

__all__ = [
    "BatchedCudaGraphConfig",
    "CU_SEQLENS",
    "CudaGraphConfig",
    "CudaGraphConfigType",
    "NodeInputs",
    "PAD_SEQ_LEN",
    "PackedCudaGraphConfig",
    "PiecewiseBatchedConfig",
    "PiecewiseCallInputs",
    "PiecewiseCaptureShape",
    "PiecewiseConfigType",
    "PiecewiseCudaGraphConfig",
    "PiecewisePackedConfig",
    "distribute_tokens",
    "pad_lengths",
]


class CudaGraphConfigType(Enum):
    BASIC_BATCHED = "basic_batched"
    FLASH_INFER_PACKED = "flash_infer_packed"


class PiecewiseConfigType(Enum):
    BATCHED = "batched"
    PACKED = "packed"


def pad_lengths(num_real_tokens: int, real_bs: int, bs: int, total_tokens: int) -> list[int] | None:
    """Lengths of the ``bs - real_bs`` padded requests that fill a packed bucket exactly.

    Each padded request gets ``PAD_SEQ_LEN`` (1) token; the leftover tokens of the bucket go onto
    the LAST padded request. Padding tokens never join a real request, so they cannot change a
    real output. ``None`` when no such plan exists: leftover tokens but no padded request to hold
    them, or fewer leftover tokens than padded requests.

    >>> pad_lengths(7, 2, 4, 12)
    [1, 4]
    """
    pad_bs, pad_tokens = bs - real_bs, total_tokens - num_real_tokens
    if pad_bs < 0 or pad_tokens < 0:
        return None
    if pad_bs == 0:
        return [] if pad_tokens == 0 else None
    if pad_tokens < pad_bs * PAD_SEQ_LEN:
        return None
    return [PAD_SEQ_LEN] * (pad_bs - 1) + [pad_tokens - PAD_SEQ_LEN * (pad_bs - 1)]


def _cu_seqlens(lengths: Sequence[int]) -> torch.Tensor:
    """[len(lengths) + 1] int32 on the host: 0, l0, l0 + l1, ..."""
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    out[1:] = torch.tensor(list(lengths), dtype=torch.int64).cumsum(0)
    return out


# --------------------------------------------------------------------------------------------
# Whole-forward configs


@dataclass(frozen=True)
class CudaGraphConfig(ABC):
    """One forward method (walk) of a model, captured per ``(walk, bs, total_tokens, key info)``.

    ``capture_graph_walk`` is the walk captured; walks in ``replay_graph_walks`` replay the same
    graphs. ``additional_key_info`` extends the graph key. ``caps_eager_batch_size``: a batch
    above the largest bucket runs eagerly in chunks no larger than it (``False``: eagerly whole).
    """

    capture_graph_walk: str
    _: KW_ONLY
    replay_graph_walks: list[str] | None = None
    additional_key_info: Any | None = None
    compile: bool = True
    capture_batch_sizes: list[int] | None = None
    capture_forward_method: str = "forward_batched"
    caps_eager_batch_size: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.capture_graph_walk, str) or not self.capture_graph_walk:
            raise ConfigError(
                "capture_graph_walk must be a non-empty walk name, "
                f"got {self.capture_graph_walk!r}."
            )
        if self.capture_batch_sizes is not None:
            validate_buckets(self.capture_batch_sizes, "capture_batch_sizes")

    @property
    def walks(self) -> list[str]:
        """Every walk these graphs serve: the captured one first."""
        return [self.capture_graph_walk, *(self.replay_graph_walks or [])]

    def batch_sizes(self) -> list[int]:
        """``capture_batch_sizes``, or ``default_capture_sizes`` up to ``DEFAULT_MAX_BS``."""
        if self.capture_batch_sizes is not None:
            return list(self.capture_batch_sizes)
        return default_capture_sizes(DEFAULT_MAX_BS)

    @abstractmethod
    def get_config_type(self) -> CudaGraphConfigType: ...

    @abstractmethod
    def get_node_inputs(self, bs: int, num_tokens: int) -> list[NodeInputs]:
        """``bs`` requests holding ``num_tokens`` tokens in all: the capture-time batch."""

    @abstractmethod
    def get_total_tokens(self, bs: int) -> list[int]:
        """The token buckets captured for ``bs`` requests (one graph each)."""

    @abstractmethod
    def model_inputs(
        self, requests: Sequence[NodeInputs], out: dict[str, torch.Tensor] | None = None
    ) -> dict[str, torch.Tensor]:
        """Lay ``requests`` out as the model's ``inputs``, into ``out``'s tensors when given."""

    @abstractmethod
    def padding_requests(self, real_lens: Sequence[int], bs: int, total: int) -> list[NodeInputs]:
        """Requests that pad a live batch with lengths ``real_lens`` to the key ``(bs, total)``;
        raises ``ConfigError`` when the key cannot hold the batch."""

    @abstractmethod
    def num_tokens(self, request: NodeInputs) -> int:
        """The tokens one request contributes to ``total_tokens``."""

    def template(self) -> NodeInputs:
        """One request's inputs: the names, trailing shapes, dtypes live requests must match."""
        return self.get_node_inputs(1, self.get_total_tokens(1)[0])[0]


def _check_names(inputs: Mapping[str, torch.Tensor], what: str) -> None:
    if not inputs:
        raise ConfigError(f"{what} is empty; give at least one named input tensor.")
    if CU_SEQLENS in inputs:
        raise ConfigError(f"{what} uses the reserved name {CU_SEQLENS!r}; rename that input.")
    for name, t in inputs.items():
        if not isinstance(t, torch.Tensor):
            raise ConfigError(f"{what}[{name!r}] is a {type(t).__name__}, expected a tensor.")


@dataclass(frozen=True)
class BatchedCudaGraphConfig(CudaGraphConfig):
    """Requests of equal shape: each input is stacked to ``[bs, tokens_per_request, ...]``.

    ``single_request_inputs`` is one request, repeated per request at capture and for padded
    requests at replay. ``total_tokens_multiplier`` is tokens per request: ``bs`` requests make
    ``bs * total_tokens_multiplier`` tokens (1 for decode, k + 1 for k-token speculation).
    """

    single_request_inputs: NodeInputs
    total_tokens_multiplier: int = field(default=1, kw_only=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_names(self.single_request_inputs, "single_request_inputs")
        if not isinstance(self.total_tokens_multiplier, int) or self.total_tokens_multiplier < 1:
            raise ConfigError(
                f"total_tokens_multiplier must be an int >= 1 (tokens per request), "
                f"got {self.total_tokens_multiplier!r}."
            )

    def get_config_type(self) -> CudaGraphConfigType:
        return CudaGraphConfigType.BASIC_BATCHED

    def get_total_tokens(self, bs: int) -> list[int]:
        return [bs * self.total_tokens_multiplier]

    def get_node_inputs(self, bs: int, num_tokens: int) -> list[NodeInputs]:
        if num_tokens != bs * self.total_tokens_multiplier:
            raise ConfigError(
                f"a batched key of {bs} requests holds {bs * self.total_tokens_multiplier} "
                f"tokens, got num_tokens={num_tokens}; use get_total_tokens(bs)."
            )
        return [dict(self.single_request_inputs) for _ in range(bs)]

    def num_tokens(self, request: NodeInputs) -> int:
        return self.total_tokens_multiplier

    def padding_requests(self, real_lens: Sequence[int], bs: int, total: int) -> list[NodeInputs]:
        if len(real_lens) > bs:
            raise ConfigError(f"{len(real_lens)} requests do not fit a key of {bs} requests.")
        return [self.single_request_inputs] * (bs - len(real_lens))

    def model_inputs(
        self, requests: Sequence[NodeInputs], out: dict[str, torch.Tensor] | None = None
    ) -> dict[str, torch.Tensor]:
        # name -> [bs, *per_request_shape]
        return {
            name: torch.stack([r[name] for r in requests], out=None if out is None else out[name])
            for name in self.single_request_inputs
        }


@dataclass(frozen=True)
class PackedCudaGraphConfig(CudaGraphConfig):
    """Variable-length requests packed end to end: ``[total_tokens, ...]`` per input, plus
    ``cu_seqlens [bs + 1] int32``. ``capture_token_lengths`` are the token buckets;
    ``make_node_input(n)`` builds one request of ``n`` tokens (used at capture and for padding).
    A key needs ``total_tokens >= bs`` (every request holds at least one token).
    """

    capture_token_lengths: list[int]
    make_node_input: Callable[[int], NodeInputs]

    def __post_init__(self) -> None:
        super().__post_init__()
        validate_buckets(self.capture_token_lengths, "capture_token_lengths")
        if not callable(self.make_node_input):
            raise ConfigError("make_node_input must be a callable n -> NodeInputs of n tokens.")

    def get_config_type(self) -> CudaGraphConfigType:
        return CudaGraphConfigType.FLASH_INFER_PACKED

    def batch_sizes(self) -> list[int]:
        if self.capture_batch_sizes is not None:
            return list(self.capture_batch_sizes)
        return default_capture_sizes(min(DEFAULT_MAX_BS, self.capture_token_lengths[-1]))

    def get_total_tokens(self, bs: int) -> list[int]:
        return [t for t in self.capture_token_lengths if t >= bs]

    def get_node_inputs(self, bs: int, num_tokens: int) -> list[NodeInputs]:
        return [self.make_node_input(n) for n in distribute_tokens(num_tokens, bs)]

    def num_tokens(self, request: NodeInputs) -> int:
        return next(iter(request.values())).shape[0]

    def padding_requests(self, real_lens: Sequence[int], bs: int, total: int) -> list[NodeInputs]:
        lens = pad_lengths(sum(real_lens), len(real_lens), bs, total)
        if lens is None:
            raise ConfigError(
                f"{len(real_lens)} requests of {sum(real_lens)} tokens cannot be padded to "
                f"{bs} requests of {total} tokens (padding tokens need padded requests)."
            )
        return [self.make_node_input(n) for n in lens]

    def model_inputs(
        self, requests: Sequence[NodeInputs], out: dict[str, torch.Tensor] | None = None
    ) -> dict[str, torch.Tensor]:
        # name -> [total_tokens, ...]; cu_seqlens -> [bs + 1] int32
        names = list(requests[0])
        inputs = {
            n: torch.cat([r[n] for r in requests], out=None if out is None else out[n])
            for n in names
        }
        cu = _cu_seqlens([self.num_tokens(r) for r in requests])
        if out is None:
            inputs[CU_SEQLENS] = cu.to(inputs[names[0]].device)
        else:
            inputs[CU_SEQLENS] = out[CU_SEQLENS].copy_(cu, non_blocking=True)
        return inputs


# The piecewise family lives in its own module; re-exported here, as the seed has one module.
from .piecewise_configs import (  # noqa: E402
    PiecewiseBatchedConfig,
    PiecewiseCallInputs,
    PiecewiseCaptureShape,
    PiecewiseCudaGraphConfig,
    PiecewisePackedConfig,
)
