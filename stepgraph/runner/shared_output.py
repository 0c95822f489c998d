"""One output buffer for every bucket of a runner, and the forwards that write straight into it.

Each graph's own output would stay allocated in the pool for the runner's life (36 buckets of
float32 logits over a 128k vocabulary held 4.2 GiB). So every bucket's output is rows ``[:bs]``
of one ``[max_bs, ...]`` buffer, allocated outside the pool by the first (largest) bucket's
eager warm-up. A forward that takes ``out=`` writes its logits there itself; otherwise its
result is a pool temporary copied in, which the next capture reuses. At bs 512 that temporary
is 250 MiB of float32 logits plus 125 MiB of bf16 ones: most of the decode pool.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch

from ..errors import CaptureError


def takes_out(forward: Callable) -> bool:
    """Whether ``forward(batch, out=...)`` is accepted (a keyword parameter named ``out``)."""
    try:
        params = inspect.signature(forward).parameters
    except (TypeError, ValueError):  # builtins, some compiled callables
        return False
    p = params.get("out")
    return p is not None and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)


class SharedOutput:
    """``[max_bs, ...]`` rows shared by every bucket; ``rows(bs)`` hands out views."""

    def __init__(self, max_bs: int) -> None:
        self.max_bs = max_bs
        self.buffer: torch.Tensor | None = None

    def rows(self, bs: int) -> torch.Tensor | None:
        """Rows ``[:bs]`` (``None`` until the first output sized the buffer)."""
        return None if self.buffer is None else self.buffer[:bs]

    def copy_in(self, out: torch.Tensor, bs: int) -> torch.Tensor:
        """Copy ``out`` ``[bs, ...]`` into rows ``[:bs]`` (sizing the buffer on first use)."""
        if self.buffer is None:
            self.buffer = out.new_empty((self.max_bs, *out.shape[1:]))
        elif self.buffer.shape[1:] != out.shape[1:] or self.buffer.dtype != out.dtype:
            raise CaptureError(
                f"the forward for batch size {bs} returned {tuple(out.shape)} {out.dtype}, but "
                f"other buckets returned [bs, {', '.join(map(str, self.buffer.shape[1:]))}] "
                f"{self.buffer.dtype}; forward must return [bs, ...] with the same trailing "
                "shape and dtype for every batch size."
            )
        dst = self.buffer[:bs]
        dst.copy_(out)
        return dst

    def nbytes(self) -> int:
        b = self.buffer
        return 0 if b is None else b.numel() * b.element_size()

    def release(self) -> None:
        self.buffer = None
