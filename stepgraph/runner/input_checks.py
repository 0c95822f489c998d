"""Value checks of a decode batch before the runner copies anything (``RunnerConfig.check_inputs``).

A replayed graph trusts its inputs: an ``out_cache_loc`` of -1 writes another request's K/V, a
``seq_len`` of 0 writes NaN into the cache, a position past the RoPE table wraps. So the
runner refuses such a batch with ``ReplayError`` before its single input copy, checking host
data that already exists (no device sync):

    seq_lens_cpu   [bs] int32   every KV length in [1, max_context_len]
    packed_cpu     [bs, PACKED.width(max_pages)] int64, the host rows the batch was packed
                   from before its one host->device copy (``ModelRunner.decode_batch`` keeps
                   them): token ids < vocab, positions in [0, max_context_len), seq_lens in
                   [1, max_context_len], out_cache_loc in the cache and outside scratch page 0,
                   block-table entries in [0, num_pages)

Levels: ``"host"`` (default) checks what is on the host; ``"full"`` also copies the device
tensors of a batch without host rows to the host (a sync per replay: for debugging); ``"off"``
checks nothing. Limits come from the model runner where it has them (``InputLimits.of``); a
limit it lacks is not checked. Cost: two numpy reductions over the host rows (see
``benchmarks/runner_overhead.py``, ``host_us_parts.value_checks``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..batch import PACKED, ForwardBatch
from ..errors import ReplayError

CHECK_LEVELS = ("host", "full", "off")
FIX = (
    "Build decode batches with the model runner's decode_batch, or fix these values; "
    "RunnerConfig(check_inputs='off') skips the checks."
)


@dataclass(frozen=True)
class InputLimits:
    """What valid values are bounded by; ``None``: unknown, not checked."""

    num_pages: int | None = None  # KV pages, scratch page 0 included
    page_size: int | None = None  # slots [0, page_size) are scratch page 0
    vocab_size: int | None = None
    max_context_len: int | None = None

    @classmethod
    def of(cls, model_runner: Any) -> InputLimits:
        """The limits a model runner exposes: ``kv_cache.num_pages`` or ``num_pages``,
        ``page_size``, ``config.vocab_size`` or ``vocab_size``, ``max_context_len``."""
        kv = getattr(model_runner, "kv_cache", None)
        config = getattr(model_runner, "config", None)
        return cls(
            num_pages=getattr(kv, "num_pages", None) or getattr(model_runner, "num_pages", None),
            page_size=getattr(model_runner, "page_size", None),
            vocab_size=getattr(config, "vocab_size", None)
            or getattr(model_runner, "vocab_size", None),
            max_context_len=getattr(model_runner, "max_context_len", None),
        )

    def column_ranges(self) -> dict[str, tuple[int, int | None, str]]:
        """Packed column -> (lowest, one past the highest or None, why)."""
        ctx = self.max_context_len
        slots = None if self.num_pages is None else self.num_pages * (self.page_size or 1)
        return {
            "input_ids": (0, self.vocab_size, "a token id indexes the embedding"),
            "positions": (0, ctx, "a position indexes the RoPE table of max_context_len"),
            "seq_lens": (1, None if ctx is None else ctx + 1, "the KV length counts this token"),
            "out_cache_loc": (
                self.page_size or 0,
                slots,
                "the new K/V slot must be in the cache and outside scratch page 0, or it "
                "overwrites another request's page",
            ),
        }


def check_values(batch: ForwardBatch, limits: InputLimits, level: str) -> None:
    """``ReplayError`` naming the first bad value of ``batch``; nothing when all are valid."""
    if level == "off":
        return
    ctx = limits.max_context_len
    _check_range(
        "seq_lens_cpu", batch.seq_lens_cpu.numpy(), 1, None if ctx is None else ctx + 1,
        "the KV length counts this token",
    )  # fmt: skip
    rows = batch.packed_cpu
    if rows is None and level == "full":  # device-only batch: copy it back (a sync)
        rows = (batch.packed if batch.packed is not None else PACKED.pack(batch)).cpu()
    if rows is not None:
        check_rows(rows.numpy(), limits)


def check_rows(rows: np.ndarray, limits: InputLimits) -> None:
    """Check packed host rows ``[bs, PACKED.width(max_pages)]`` int64 against ``limits``."""
    if rows.shape[0] == 0:
        return
    lo, hi = rows.min(axis=0), rows.max(axis=0)  # [width] each: one pass per bound
    for name, (low, high, why) in limits.column_ranges().items():
        i = PACKED.fields.index(name)
        if lo[i] < low or (high is not None and hi[i] >= high):
            _check_range(name, rows[:, i], low, high, why)
    t = PACKED.table_col
    if rows.shape[1] > t:
        pages = limits.num_pages
        if lo[t:].min() < 0 or (pages is not None and hi[t:].max() >= pages):
            row, col = np.argwhere((rows[:, t:] < 0) | (rows[:, t:] >= (pages or 2**62)))[0]
            raise ReplayError(
                f"block_table[{row}, {col}] = {rows[row, t + col]} is outside [0, {pages}): a "
                f"page id indexes the KV cache's {pages} pages. {FIX}"
            )


def _check_range(name: str, values: np.ndarray, low: int, high: int | None, why: str) -> None:
    bad = values < low if high is None else (values < low) | (values >= high)
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        span = f"outside [{low}, {high})" if high is not None else f"below {low}"
        raise ReplayError(f"{name}[{row}] = {values[row]} is {span}: {why}. {FIX}")


__all__ = ["CHECK_LEVELS", "InputLimits", "check_rows", "check_values"]
