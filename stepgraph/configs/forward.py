"""Whole-forward capture configs (mstar's ``cuda_graph_config`` API): which forward method (walk) of
a model is captured, at which keys ``(walk, bs, total_tokens, additional_key_info)``, and with which
input layout.

- ``BatchedCudaGraphConfig`` stacks equal requests as ``[bs, tokens_per_request, ...]``.
- ``PackedCudaGraphConfig`` packs variable-length requests as ``[total_tokens, ...]`` plus
  ``cu_seqlens [bs + 2] int32`` (``bs`` request slots and one spare: ``padding.py``).

A subclass needs only mstar's three abstract methods (``get_config_type``,
``get_node_inputs``, ``get_total_tokens``); the layout, the padding and the token counts follow
from the config type. Arguments keep mstar's positional order.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from enum import Enum
from typing import Any

import torch

from ..buckets import DEFAULT_MAX_BS, default_capture_sizes, distribute_tokens, validate_buckets
from ..errors import ConfigError, check_flags
from .padding import CU_SEQLENS, SPARE_SLOTS, NodeInputs, cu_seqlens, pad_lengths, rows_of


class CudaGraphConfigType(Enum):
    BASIC_BATCHED = "basic_batched"
    FLASH_INFER_PACKED = "flash_infer_packed"


class CudaGraphConfig(ABC):
    """One forward method (walk) of a model, captured per ``(walk, bs, total_tokens, key info)``.

    ``capture_graph_walk`` is the walk captured; walks in ``replay_graph_walks`` replay the same
    graphs. ``additional_key_info`` extends the graph key. ``caps_eager_batch_size``: a batch
    above the largest key runs eagerly in chunks no larger than the largest key (``False``: it
    runs eagerly whole, in one call).
    """

    def __init__(
        self,
        capture_graph_walk: str,
        replay_graph_walks: list[str] | None = None,
        additional_key_info: Any | None = None,
        compile: bool = True,
        capture_batch_sizes: list[int] | None = None,
        capture_forward_method: str = "forward_batched",
        caps_eager_batch_size: bool = True,
    ) -> None:
        if not isinstance(capture_graph_walk, str) or not capture_graph_walk:
            raise ConfigError(
                f"capture_graph_walk must be a non-empty walk name, got {capture_graph_walk!r}."
            )
        walks = replay_graph_walks
        if walks is not None and (
            isinstance(walks, str)
            or not isinstance(walks, (list, tuple))
            or not all(isinstance(w, str) and w for w in walks)
        ):
            raise ConfigError(
                f"replay_graph_walks must be a list of walk names or None, got {walks!r}; "
                f"e.g. [{walks!r}] for one walk."
            )
        if not isinstance(capture_forward_method, str) or not capture_forward_method:
            raise ConfigError(
                "capture_forward_method must be the name of the model's method to capture, "
                f"got {capture_forward_method!r}."
            )
        check_flags(compile=compile, caps_eager_batch_size=caps_eager_batch_size)
        if capture_batch_sizes is not None:
            validate_buckets(capture_batch_sizes, "capture_batch_sizes")
        self.capture_graph_walk = capture_graph_walk
        self.replay_graph_walks = replay_graph_walks
        self.additional_key_info = additional_key_info
        self.compile = compile
        self.capture_batch_sizes = capture_batch_sizes
        self.capture_forward_method = capture_forward_method
        self.caps_eager_batch_size = caps_eager_batch_size

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.capture_graph_walk!r})"

    # -- mstar's three abstract methods ---------------------------------------------------------

    @abstractmethod
    def get_config_type(self) -> CudaGraphConfigType: ...

    @abstractmethod
    def get_node_inputs(self, bs: int, num_tokens: int) -> list[NodeInputs]:
        """``bs`` requests holding ``num_tokens`` tokens in all: the capture-time batch."""

    @abstractmethod
    def get_total_tokens(self, bs: int) -> list[int]:
        """The token buckets captured for ``bs`` requests (one graph each)."""

    # -- derived from the config type ---------------------------------------------------------

    @property
    def packed(self) -> bool:
        return self.get_config_type() is CudaGraphConfigType.FLASH_INFER_PACKED

    @property
    def walks(self) -> list[str]:
        """Every walk these graphs serve: the captured one first."""
        return [self.capture_graph_walk, *(self.replay_graph_walks or [])]

    def batch_sizes(self) -> list[int]:
        """``capture_batch_sizes``, or ``default_capture_sizes`` up to ``DEFAULT_MAX_BS``."""
        if self.capture_batch_sizes is not None:
            return list(self.capture_batch_sizes)
        return default_capture_sizes(DEFAULT_MAX_BS)

    def template(self) -> NodeInputs:
        """One request's inputs: the names, trailing shapes, dtypes live requests must match."""
        return self.get_node_inputs(1, self.get_total_tokens(1)[0])[0]

    def num_tokens(self, request: NodeInputs) -> int:
        """The tokens one request contributes to ``total_tokens``."""
        if self.packed:
            return int(next(iter(request.values())).shape[0])
        return self.get_total_tokens(1)[0]

    def padding_request(self, n: int) -> NodeInputs:
        """One padded request (``n`` tokens when packed): rows of the capture-time request."""
        return rows_of(self.template(), n) if self.packed else self.template()

    def capture_requests(self, bs: int, total_tokens: int) -> list[NodeInputs]:
        """The capture-time batch of a key: ``get_node_inputs``, plus the empty spare slot of a
        packed key."""
        reqs = self.get_node_inputs(bs, total_tokens)
        return reqs + [self.padding_request(0)] * SPARE_SLOTS if self.packed else reqs

    def padding_requests(self, real_lens: Sequence[int], bs: int, total: int) -> list[NodeInputs]:
        """Requests that pad a live batch with lengths ``real_lens`` to the key ``(bs, total)``
        (packed: the padded requests and the spare); ``ConfigError`` when it does not fit."""
        if not self.packed:
            if len(real_lens) > bs:
                raise ConfigError(f"{len(real_lens)} requests do not fit a key of {bs} requests.")
            return [self.padding_request(1)] * (bs - len(real_lens))
        lens = pad_lengths(sum(real_lens), len(real_lens), bs, total)
        if lens is None:
            raise ConfigError(
                f"{len(real_lens)} requests of {sum(real_lens)} tokens do not fit the key of "
                f"{bs} requests and {total} tokens."
            )
        return [self.padding_request(n) for n in lens]

    def model_inputs(
        self, requests: Sequence[NodeInputs], out: Mapping[str, torch.Tensor] | None = None
    ) -> dict[str, torch.Tensor]:
        """Lay ``requests`` out as the model's ``inputs``, into ``out``'s tensors when given.
        Batched: ``name -> [bs, *per_request_shape]``. Packed: ``name -> [total_tokens, ...]``
        and ``cu_seqlens -> [len(requests) + 1] int32``."""
        names = list(requests[0])
        dst = (lambda n: None) if out is None else (lambda n: out[n])  # noqa: E731
        if not self.packed:
            return {n: torch.stack([r[n] for r in requests], out=dst(n)) for n in names}
        inputs = {n: torch.cat([r[n] for r in requests], out=dst(n)) for n in names}
        cu = cu_seqlens([self.num_tokens(r) for r in requests])
        if out is None:
            inputs[CU_SEQLENS] = cu.to(inputs[names[0]].device)
        else:
            inputs[CU_SEQLENS] = out[CU_SEQLENS].copy_(cu, non_blocking=True)
        return inputs


def check_input_names(inputs: Mapping[str, torch.Tensor], what: str) -> None:
    if not isinstance(inputs, Mapping):
        raise ConfigError(
            f"{what} must be a dict of input name -> tensor, got {type(inputs).__name__}."
        )
    if not inputs:
        raise ConfigError(f"{what} is empty; give at least one named input tensor.")
    if CU_SEQLENS in inputs:
        raise ConfigError(f"{what} uses the reserved name {CU_SEQLENS!r}; rename that input.")
    for name, t in inputs.items():
        if not isinstance(t, torch.Tensor):
            raise ConfigError(f"{what}[{name!r}] is a {type(t).__name__}, expected a tensor.")


class BatchedCudaGraphConfig(CudaGraphConfig):
    """Requests of equal shape: each input is stacked to ``[bs, tokens_per_request, ...]``.

    ``single_request_inputs`` is one request, repeated per request at capture and for padded
    requests at replay. ``total_tokens_multiplier`` is tokens per request: ``bs`` requests make
    ``bs * total_tokens_multiplier`` tokens (1 for decode, k + 1 for k-token speculation).
    """

    def __init__(
        self,
        capture_graph_walk: str,
        single_request_inputs: NodeInputs,
        replay_graph_walks: list[str] | None = None,
        additional_key_info: Any | None = None,
        compile: bool = True,
        capture_batch_sizes: list[int] | None = None,
        capture_forward_method: str = "forward_batched",
        caps_eager_batch_size: bool = True,
        total_tokens_multiplier: int = 1,
    ) -> None:
        super().__init__(
            capture_graph_walk,
            replay_graph_walks,
            additional_key_info,
            compile,
            capture_batch_sizes,
            capture_forward_method,
            caps_eager_batch_size,
        )
        check_input_names(single_request_inputs, "single_request_inputs")
        if not isinstance(total_tokens_multiplier, int) or total_tokens_multiplier < 1:
            raise ConfigError(
                f"total_tokens_multiplier must be an int >= 1 (tokens per request), "
                f"got {total_tokens_multiplier!r}."
            )
        self.single_request_inputs = single_request_inputs
        self.total_tokens_multiplier = total_tokens_multiplier

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


class PackedCudaGraphConfig(CudaGraphConfig):
    """Variable-length requests packed end to end: ``[total_tokens, ...]`` per input, plus
    ``cu_seqlens``. ``capture_token_lengths`` are the token buckets; ``make_node_input(n)``
    builds one request of ``n`` tokens (at capture and for padding; ``n`` may be 0 for the spare
    slot). A key needs ``total_tokens >= bs`` (every request holds at least one token).
    """

    def __init__(
        self,
        capture_graph_walk: str,
        capture_token_lengths: list[int],
        make_node_input: Callable[[int], NodeInputs],
        replay_graph_walks: list[str] | None = None,
        additional_key_info: Any | None = None,
        compile: bool = True,
        capture_batch_sizes: list[int] | None = None,
        capture_forward_method: str = "forward_batched",
        caps_eager_batch_size: bool = True,
    ) -> None:
        super().__init__(
            capture_graph_walk,
            replay_graph_walks,
            additional_key_info,
            compile,
            capture_batch_sizes,
            capture_forward_method,
            caps_eager_batch_size,
        )
        validate_buckets(capture_token_lengths, "capture_token_lengths")
        if not callable(make_node_input):
            raise ConfigError("make_node_input must be a callable n -> NodeInputs of n tokens.")
        self.capture_token_lengths = list(capture_token_lengths)
        self.make_node_input = make_node_input

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

    def padding_request(self, n: int) -> NodeInputs:
        return self.make_node_input(n)
