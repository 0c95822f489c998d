"""The pieces of a piecewise runner that hold a region's buffers: leases of a shape's static
inputs, the adapter that turns a dict-returning region into a capturable step, and the layout of
a declared step's resources (what a graph baked in at capture)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CaptureError
from ..runner.capture import storage_ptrs
from .piecewise import PiecewiseCaptureShape

Key = tuple[int, int]  # (bs, total_tokens)


def key_of(shape: PiecewiseCaptureShape) -> Key:
    return shape.bs, shape.total_tokens


@dataclass
class BufferLease:
    """A shape's static inputs, marked in use until ``release()``."""

    shape: PiecewiseCaptureShape
    buffers: dict[str, torch.Tensor]
    _leases: dict[Key, BufferLease]

    def release(self) -> None:
        self._leases.pop(key_of(self.shape), None)


class DictRegion:
    """Adapts a ``dict[str, Tensor]``-returning region to the backend's tensor-returning capture.

    Warm-up calls are kept alive (so a fresh allocation can't reuse their addresses) and only
    type-checked. ``seal()`` after capture makes the capture call's dict the static outputs; a
    later call (the CPU stand-in's replay re-runs the region) copies its results into them."""

    def __init__(self, fn: Callable[[], Any], what: str) -> None:
        self._fn, self.what = fn, what
        self.calls: list[dict[str, torch.Tensor]] = []
        self.outputs: dict[str, torch.Tensor] | None = None

    def __call__(self) -> torch.Tensor:
        out = self._fn()
        if self.outputs is not None:
            for name, t in out.items():
                self.outputs[name].copy_(t)
            return next(iter(self.outputs.values()))
        if not isinstance(out, dict) or not out:
            raise CaptureError(
                f"{self.what}: capture_fn returned {type(out).__name__}; it must return a "
                "non-empty dict[str, Tensor] of outputs it allocates."
            )
        for name, t in out.items():
            if not isinstance(t, torch.Tensor):
                raise CaptureError(
                    f"{self.what}: capture_fn output {name!r} is a {type(t).__name__}; "
                    "return tensors only."
                )
        self.calls.append(out)
        return next(iter(out.values()))

    def seal(self, preexisting: set[int]) -> dict[str, torch.Tensor]:
        *warmups, captured = self.calls
        old = preexisting | storage_ptrs(t for w in warmups for t in w.values())
        for name, t in captured.items():
            if storage_ptrs([t]) & old:
                raise CaptureError(
                    f"{self.what}: output {name!r} was not allocated by the captured call (it "
                    "shares storage with a static input, a resource, a kwarg, an earlier output "
                    "or a tensor from before capture); return a new tensor, e.g. x.clone()."
                )
        self.outputs, self.calls = captured, []
        return captured


def resource_layout(resources: dict[str, Any]) -> dict[str, tuple[int, tuple[int, ...]]]:
    """(address, shape) of each tensor resource: what a graph baked in at capture."""
    return {
        n: (t.data_ptr(), tuple(t.shape))
        for n, t in resources.items()
        if isinstance(t, torch.Tensor)
    }
