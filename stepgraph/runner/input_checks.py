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
tensors of a batch without host rows to the host (a sync per replay: for debugging) and checks
that each slot lies in the page the row's own block table maps its position to; ``"off"``
checks nothing. Limits come from the model runner where it has them (``InputLimits.of``); a
limit it lacks is not checked. Cost (``benchmarks/runner_overhead.py``,
``host_us_parts.value_checks``): the KV lengths' least and longest through builtins over a list
(up to ``_FEW_ROWS`` rows; numpy past it), then one vectorised compare of the host rows against
per-column bounds cached per row width, counted with ``count_nonzero`` (no reduction call);
only a bad batch pays for finding and naming the value. A staged replay of host rows checks
them alone (``check_rows_fast``: about 1.5 us on the CPU at bs 1): the KV lengths it reads are
the rows' column, so ``seq_lens_cpu`` is not read there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..batch import BATCH_DTYPES, PACKED, ForwardBatch
from ..errors import ReplayError

_DEVICE_FIELDS = tuple((n, d) for n, d in BATCH_DTYPES.items() if n != "seq_lens_cpu")

CHECK_LEVELS = ("host", "full", "off")
_FEW_ROWS = 64  # up to this batch size the KV lengths are read as a list (builtins' max, min)
_count_nonzero, _subtract, _U64 = np.count_nonzero, np.subtract, np.uint64  # no lookups per call
_greater_equal = np.greater_equal
try:  # numpy's C count_nonzero, without the Python wrapper's argument handling (0.2 us a call)
    from numpy._core.multiarray import count_nonzero as _count_nonzero_c
except ImportError:  # numpy 1.x
    _count_nonzero_c = np.count_nonzero
SEQ_COL = PACKED.fields.index("seq_lens")  # the KV lengths' column of a packed row
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
    feed_size: int = 0  # ids in [-feed_size, 0) read the runner's device feed (``feed.py``)
    # packed row width -> (lowest, span) arrays; None -> seq_lens_cpu's [low, high)
    _bounds: dict = field(default_factory=dict, compare=False, repr=False)

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
        fed = f"; -1 - j reads row j of the {self.feed_size}-row feed" if self.feed_size else ""
        return {
            "input_ids": (
                -self.feed_size,
                self.vocab_size,
                "a token id indexes the embedding" + fed,
            ),
            "positions": (0, ctx, "a position indexes the RoPE table of max_context_len"),
            "seq_lens": (1, None if ctx is None else ctx + 1, "the KV length counts this token"),
            "out_cache_loc": (
                self.page_size or 0,
                slots,
                "the new K/V slot must be in the cache and outside scratch page 0, or it "
                "overwrites another request's page",
            ),
        }


def check_values(batch: ForwardBatch, limits: InputLimits, level: str) -> int | None:
    """``ReplayError`` naming the first bad value of ``batch``; nothing when all are valid, or
    when its builder checked them (``ForwardBatch.values_checked``). Returns the longest of its
    ``seq_lens_cpu`` where it read them (None where it checked nothing): the replay's KV length
    then costs no second pass."""
    if level == "off" or batch.values_checked:
        return None
    bounds = limits._bounds
    lens = batch.seq_lens_cpu  # [bs] int32
    if lens.shape[0] <= _FEW_ROWS:  # builtins over a short list: no numpy call overhead
        seq = lens.tolist()
        longest, least = (max(seq), min(seq)) if seq else (None, None)
    else:
        seq = lens.numpy()  # zero-copy
        longest, least = int(seq.max()), int(seq.min())
    if longest is not None:
        low, high = bounds.get(None) or _seq_bounds(limits)
        if least < low or longest >= high:
            _check_range("seq_lens_cpu", lens.numpy(), *limits.column_ranges()["seq_lens"])
    rows = batch.packed_cpu
    if rows is None:
        if level != "full":
            return longest
        rows = (batch.packed if batch.packed is not None else PACKED.pack(batch)).cpu()  # sync
    values = rows.numpy()
    width = values.shape[1]
    low, span = bounds.get(width) or _bounds(limits, width)
    if _count_nonzero(_subtract(values, low).view(_U64) >= span):  # one pass, every column
        check_rows(values, limits)  # finds and names the value
    if level == "full" and limits.page_size:
        check_slot_pages(values, limits.page_size)
    return longest


def check_rows_fast(rows: np.ndarray, unsigned: np.ndarray, limits: InputLimits) -> None:
    """``check_rows`` of host rows ``[bs, <= width]`` int64 (``unsigned``: the same as uint64)
    at the least host cost: one vectorised compare of every column against its cached bounds
    (``v - low`` as unsigned below the column's count of valid values), counted in C; only a
    bad batch pays for finding and naming the value. The KV lengths are checked in their
    column (a staged replay reads them there, not from ``seq_lens_cpu``)."""
    width = rows.shape[1]
    cached = limits._bounds.get(-width)
    if cached is None:
        low, span = _bounds(limits, width)
        cached = limits._bounds[-width] = (low.view(_U64), span)
    if _count_nonzero_c(_greater_equal(_subtract(unsigned, cached[0]), cached[1])):
        check_rows(rows, limits)  # finds and names the value


def batch_problem(
    batch: ForwardBatch,
    buffers: Any,
    device: Any,
    packed_inputs: bool,
    staged: bool,
    bs: int | None = None,
) -> str | None:
    """What keeps the runner from copying ``batch`` (of ``bs`` rows, when the caller knows) into
    ``buffers`` (dtypes, devices, shapes: only what the replay reads); ``None`` when nothing
    does. A staged runner reads only the host rows when the batch has them."""
    bs = batch.batch_size if bs is None else bs
    lens = batch.seq_lens_cpu  # ``is_cpu``: a fraction of ``device.type``'s cost
    if not lens.is_cpu or lens.shape[0] != bs:
        return f"seq_lens_cpu must be a host tensor of {bs} rows"
    width = buffers.packed.shape[1]
    rows = batch.packed_cpu
    if staged and rows is not None:  # staging.py reads these and nothing else
        if rows.dtype is not torch.int64 or not rows.is_cpu:
            return f"packed_cpu is {rows.dtype} on {rows.device}, expected int64 on the host"
        shape = rows.shape
        if len(shape) != 2 or shape[0] != bs or shape[1] > width:
            return f"packed_cpu has shape {tuple(shape)}, expected [{bs}, <= {width}]"
        return None
    packed = batch.packed
    if packed is not None and packed_inputs:  # the only tensor that is copied
        if packed.dtype is not torch.int64 or packed.device != device:
            return f"packed is {packed.dtype} on {packed.device}, expected int64 on {device}"
        if packed.dim() != 2 or packed.shape[0] != bs or packed.shape[1] > width:
            return f"packed has shape {tuple(packed.shape)}, expected [{bs}, <= {width}]"
        return None
    for name, dtype in _DEVICE_FIELDS:
        t = getattr(batch, name)
        if t.dtype is not dtype:
            return f"{name} has dtype {t.dtype}, expected {dtype}"
        if t.device != device:
            return f"{name} is on {t.device}, expected {device}"
        if t.dim() == 0 or t.shape[0] != bs:
            return f"{name} has shape {tuple(t.shape)}, expected {bs} rows (the batch size)"
        if t.dim() != 1 and name != "block_table":
            return f"{name} has shape {tuple(t.shape)}, expected [{bs}]"
    table, pages = batch.block_table, buffers.block_table.shape[1]
    if table.dim() != 2 or table.shape[1] > pages:
        return f"block_table has shape {tuple(table.shape)}, expected [{bs}, <= {pages}]"
    return None


def check_slot_pages(rows: np.ndarray, page_size: int) -> None:
    """Each row's K/V slot lies in the page its own block table maps its position to, so the
    write never lands in another request's page (``"full"`` only: a gather per replay)."""
    f = PACKED.fields.index
    pos, slot = rows[:, f("positions")], rows[:, f("out_cache_loc")]
    col = PACKED.table_col + pos // page_size  # [bs]; positions were checked in range
    if col.size and col.max() >= rows.shape[1]:
        row = int(np.flatnonzero(col >= rows.shape[1])[0])
        raise ReplayError(f"positions[{row}] = {pos[row]} is past its block-table row. {FIX}")
    page = rows[np.arange(rows.shape[0]), col]
    bad = np.flatnonzero(page != slot // page_size)
    if bad.size:
        row = int(bad[0])
        raise ReplayError(
            f"out_cache_loc[{row}] = {slot[row]} is in page {slot[row] // page_size}, but the "
            f"row's block table maps position {pos[row]} to page {page[row]}: the K/V write "
            f"would land in another request's page. {FIX}"
        )


def check_rows(rows: np.ndarray, limits: InputLimits) -> None:
    """Check packed host rows ``[bs, PACKED.width(max_pages)]`` int64 against ``limits``."""
    low, span = _bounds(limits, rows.shape[1])
    if not np.count_nonzero(_outside(rows, low, span)):  # one pass, no Python per column
        return
    for name, (lo, hi, why) in limits.column_ranges().items():
        _check_range(name, rows[:, PACKED.fields.index(name)], lo, hi, why)
    t, pages = PACKED.table_col, limits.num_pages
    row, col = np.argwhere(_outside(rows[:, t:], low[t:], span[t:]))[0]
    raise ReplayError(
        f"block_table[{row}, {col}] = {rows[row, t + col]} is outside [0, {pages}): a page id "
        f"indexes the KV cache's {pages} pages. {FIX}"
    )


def _outside(values: np.ndarray, low: np.ndarray, span: np.ndarray) -> np.ndarray:
    # v in [low, low + span) <=> (v - low) as unsigned < span: one compare covers both ends
    return (values - low).view(span.dtype) >= span


def _bounds(limits: InputLimits, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Per packed column of a ``width``-column row: the lowest valid value and the count of
    valid values (uint64), unknown limits spanning everything (cached)."""
    cached = limits._bounds.get(width)
    if cached is None:
        cached = limits._bounds[width] = _make_bounds(limits, width)
    return cached


def _seq_bounds(limits: InputLimits) -> tuple[int, int | float]:
    """``seq_lens_cpu``'s valid values ``[low, high)`` as Python numbers (cached)."""
    cached = limits._bounds.get(None)
    if cached is None:
        lo, hi, _ = limits.column_ranges()["seq_lens"]
        cached = limits._bounds[None] = (lo, math.inf if hi is None else hi)
    return cached


def _make_bounds(limits: InputLimits, width: int) -> tuple[np.ndarray, np.ndarray]:
    ranges = limits.column_ranges()
    cols = [ranges[f][:2] for f in PACKED.fields]
    cols += [(0, limits.num_pages)] * (width - PACKED.table_col)
    low = np.array([lo for lo, _ in cols], np.int64)
    return low, np.array([_span(lo, hi, 2**63) for lo, hi in cols], np.uint64)


def _span(lo: int, hi: int | None, unknown: int) -> int:
    return unknown if hi is None else max(hi - lo, 0)


def _check_range(name: str, values: np.ndarray, low: int, high: int | None, why: str) -> None:
    bad = values < low if high is None else (values < low) | (values >= high)
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        span = f"outside [{low}, {high})" if high is not None else f"below {low}"
        raise ReplayError(f"{name}[{row}] = {values[row]} is {span}: {why}. {FIX}")


__all__ = [
    "CHECK_LEVELS",
    "InputLimits",
    "batch_problem",
    "check_rows",
    "check_rows_fast",
    "check_slot_pages",
    "check_values",
]
