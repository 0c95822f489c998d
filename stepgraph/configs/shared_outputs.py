"""One set of static outputs per piecewise region, sized once, with a view per capture shape.

A graph's outputs stay allocated in the pool for the runner's life, and with them the blocks
around them: 17 prefill regions x 16 shapes held gigabytes
(docs/experiments.md#one-output-buffer-per-region). So each captured step copies its outputs
into rows ``[:n]`` of one buffer per output name, allocated outside the pool by the first
(largest) shape's eager warm-up; the region's own outputs are then temporaries the next capture
reuses. ``n`` is the shape's request slots or tokens, whichever the output's first dim is
(``PrefillShapes`` keeps the two apart).

    per-token output   [max total_tokens, ...]   shape (bs, T) gets rows [:T]
    per-request output [max num_requests, ...]   shape (bs, T) gets rows [:num_requests]

An output whose trailing shape or dtype differs between shapes keeps its own per-shape tensor.
"""

from __future__ import annotations

import torch

from .piecewise import PiecewiseCaptureShape


class SharedRegionOutputs:
    """The shared output buffers of one region (one ``PiecewiseRunner``)."""

    def __init__(self, shapes: list[PiecewiseCaptureShape]) -> None:
        self.max_requests = max(s.num_requests for s in shapes)
        self.max_tokens = max(s.total_tokens for s in shapes)
        self.buffers: dict[tuple[str, str], torch.Tensor] = {}  # (name, "req"|"tok") -> buffer
        self.unshared: set[str] = set()  # names whose trailing shape or dtype varies

    def copy_in(
        self, outputs: dict[str, torch.Tensor], shape: PiecewiseCaptureShape
    ) -> dict[str, torch.Tensor]:
        """Copy each output into its shared rows; returns the views (an output that cannot be
        shared, or whose first dim is neither size, is returned as it is)."""
        views = {}
        for name, t in outputs.items():
            view = self._rows(name, t, shape)
            if view is None:
                views[name] = t
                continue
            view.copy_(t)
            views[name] = view
        return views

    def _rows(self, name: str, t: torch.Tensor, shape: PiecewiseCaptureShape):
        if name in self.unshared or t.dim() == 0:
            return None
        if t.shape[0] == shape.total_tokens:
            kind, cap = "tok", self.max_tokens
        elif t.shape[0] == shape.num_requests:
            kind, cap = "req", self.max_requests
        else:
            return None
        buf = self.buffers.get((name, kind))
        if buf is None:
            buf = self.buffers[(name, kind)] = t.new_empty((cap, *t.shape[1:]))
        elif buf.shape[1:] != t.shape[1:] or buf.dtype != t.dtype:
            self.unshared.add(name)  # varies by shape: each keeps its own (never reached so far)
            return None
        return buf[: t.shape[0]]

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())

    def release(self) -> None:
        self.buffers.clear()
        self.unshared.clear()


class PadTracker:
    """Rows of each static input that may hold a previous batch's live values, so padding
    rows are re-written only when dirty (as the decode runner does) instead of a ``fill_`` per
    input per replay.

    Tracked per storage, not per shape: static inputs may be leading-row views of one buffer
    shared by every shape and region (``PiecewisePrefill`` does that), and a view must see the
    rows any other view left live. The rule is the decode runner's: writing rows ``[:n]`` of a
    view of ``cap`` rows pads ``[n:min(dirty, cap)]``; ``dirty`` stays if it lies past ``cap``,
    else becomes ``n``. At first every row of the storage counts as dirty."""

    def __init__(self) -> None:
        self._dirty: dict[int, int] = {}  # storage address -> rows [:dirty] may be live

    def repad(self, static: torch.Tensor, rows: int, pad: int) -> None:
        """``static[:rows]`` was just written; pad the rows after it that may hold values."""
        if static.dim() == 0:
            return
        ptr, cap = static.data_ptr(), static.shape[0]
        dirty = self._dirty.get(ptr)
        if dirty is None:
            dirty = _storage_rows(static)
        stale = min(dirty, cap)
        if stale > rows:
            static[rows:stale].fill_(pad)
        self._dirty[ptr] = dirty if dirty > cap else rows

    def forget(self) -> None:
        """Every row counts as dirty again (after someone wrote the inputs behind our back)."""
        self._dirty.clear()


def _storage_rows(t: torch.Tensor) -> int:
    """Rows of ``t``'s storage from its first element on (its leading-row views included)."""
    row_bytes = max(t.stride(0), 1) * t.element_size()
    free = t.untyped_storage().nbytes() - t.storage_offset() * t.element_size()
    return max(t.shape[0], free // row_bytes)
