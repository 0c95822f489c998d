"""What the config runner and the piecewise runner share at replay: live inputs checked against
the static ones before anything is copied, and the smallest captured key that holds a batch."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TypeVar

import torch

from ..errors import ReplayError
from .padding import fits_packed

K = TypeVar("K")


def check_inputs(
    live: Mapping[str, torch.Tensor],
    static: Mapping[str, torch.Tensor],
    *,
    label: str,
    full_shape: bool = False,
    subset_ok: bool = False,
) -> int:
    """Check ``live`` tensors against ``static`` ones: names (all of them, or a non-empty subset
    with ``subset_ok``), trailing dims (the whole shape with ``full_shape``), one row count
    shared by every input, dtype and device. Returns the row count; raises ``ReplayError``
    naming ``label``, the input and both shapes."""
    names, wanted = set(live), set(static)
    if not names or not names <= wanted or (not subset_ok and names != wanted):
        raise ReplayError(
            f"{label} has inputs {sorted(names)}, the static inputs are {sorted(wanted)}; "
            + ("pass a non-empty subset of them." if subset_ok else "pass exactly those.")
        )
    rows = {t.shape[0] if t.dim() else -1 for t in live.values()}
    for name, t in live.items():
        st = static[name]
        if full_shape:  # one batched request: exactly the static request's shape
            bad, want = t.shape != st.shape, str(list(st.shape))
        else:  # packed rows: any row count, shared by every input; trailing dims match
            bad = t.dim() == 0 or t.shape[1:] != st.shape[1:] or len(rows) != 1
            want = f"[n, {', '.join(map(str, st.shape[1:]))}] with one n for every input"
        if bad:
            raise ReplayError(
                f"input {name!r} of {label} has shape {tuple(t.shape)}; the static input has "
                f"shape {tuple(st.shape)}, so it must be {want}. Fix the input, or run it "
                "eagerly."
            )
        if t.dtype != st.dtype or t.device != st.device:
            raise ReplayError(
                f"input {name!r} of {label} is {t.dtype} on {t.device}; the static input is "
                f"{st.dtype} on {st.device}. Convert it first."
            )
    if full_shape:
        return 1
    (n,) = rows
    if n < 1:
        raise ReplayError(f"{label} has no rows; drop it from the batch.")
    return n


def smallest_fit(
    keys: Iterable[K], key_shape, num_requests: int, num_tokens: int, packed: bool
) -> K | None:
    """The first of ``keys`` (sorted ascending by (tokens, bs)) that holds ``num_requests``
    requests of ``num_tokens`` tokens in all; ``key_shape(key) -> (bs, total_tokens)``.
    Batched keys need only ``bs`` slots; packed ones also the tokens (``padding.py``)."""
    for key in keys:
        bs, total = key_shape(key)
        if packed and fits_packed(num_tokens, num_requests, bs, total):
            return key
        if not packed and num_requests <= bs:
            return key
    return None
