"""The padding rule of packed layouts, shared by the whole-forward and the piecewise configs.

A packed key ``(bs, total_tokens)`` is captured with ``bs + 1`` request slots: ``bs`` for live
requests and one SPARE slot at the end that absorbs whatever tokens the live batch leaves over.
So every batch of at most ``bs`` requests and at most ``total_tokens`` tokens fits the key:

    key (bs=4, total=16), live [5, 2, 1]  ->  [5, 2, 1] + padded [1] + spare [7]
    key (bs=4, total=8),  live [2, 2, 2, 1] -> [2, 2, 2, 1] + spare [1]

Padded requests hold ``PAD_SEQ_LEN`` (1) token each while leftover tokens last, else 0; the
spare takes the rest (possibly 0). Padding tokens never join a live request, so they cannot
change a live output. A packed forward must accept empty requests (repeated ``cu_seqlens``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# One request's inputs: name -> tensor. Packed: first dim is that request's tokens.
# Batched: the per-request tensor [tokens_per_request, ...].
NodeInputs = dict[str, torch.Tensor]

CU_SEQLENS = "cu_seqlens"  # packed layouts: cumulative request offsets, [slots + 1] int32
PAD_SEQ_LEN = 1  # tokens a padded request holds while leftover tokens last
SPARE_SLOTS = 1  # request slots a packed key holds beyond its batch size


def fits_packed(num_tokens: int, real_bs: int, bs: int, total_tokens: int) -> bool:
    """Whether a live packed batch fits the key ``(bs, total_tokens)``."""
    return 1 <= real_bs <= bs and num_tokens <= total_tokens


def pad_lengths(num_real_tokens: int, real_bs: int, bs: int, total_tokens: int) -> list[int] | None:
    """Token counts of the ``bs - real_bs`` padded requests plus the spare, which together fill
    the key ``(bs, total_tokens)`` exactly; ``None`` when the batch does not fit the key.

    >>> pad_lengths(8, 3, 4, 16)
    [1, 7]
    >>> pad_lengths(8, 3, 4, 8)
    [0, 0]
    """
    if not fits_packed(num_real_tokens, real_bs, bs, total_tokens):
        return None
    left = total_tokens - num_real_tokens
    padded = [min(PAD_SEQ_LEN, max(0, left - PAD_SEQ_LEN * i)) for i in range(bs - real_bs)]
    return padded + [left - sum(padded)]


def cu_seqlens(lengths: Sequence[int]) -> torch.Tensor:
    """[len(lengths) + 1] int32 on the host: 0, l0, l0 + l1, ..."""
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    out[1:] = torch.tensor(list(lengths), dtype=torch.int64).cumsum(0)
    return out


def rows_of(request: NodeInputs, n: int) -> NodeInputs:
    """A request of ``n`` tokens made of ``request``'s rows, cycled (``n`` may be 0)."""
    out = {}
    for name, t in request.items():
        idx = torch.arange(n, device=t.device) % max(t.shape[0], 1)
        out[name] = t[idx]
    return out
