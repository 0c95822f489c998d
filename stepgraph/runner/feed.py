"""The device token feed: input ids that a replay reads from a device tensor, inside the graph.

An overlapped loop launches step N+1 before step N's sampled ids reach the host. With
``CudaGraphRunner(model_runner, config, feed=tokens)``, a batch row whose input id is ``-1 - j``
(``feed_id(j)``) takes ``tokens[j]`` instead, gathered on the device as the captured step's
first op, after the static inputs are filled:

    feed       [F] int64 on the model's device, at a fixed address for the runner's life
               (e.g. the buffer the last step's sampler writes, or ``ModelRunner.greedy_tokens``)
    input id   >= 0: the token itself;  -1 - j, 0 <= j < F: ``feed[j]``

So the host builds the whole batch, ids included, without waiting for step N: row ``i`` of
step N+1 names the row ``j`` of step N's output it continues. The batch's rows can then come
entirely from host memory (pinned staging, ``staging.py``), and a replay launches nothing but
the graph. The value checks accept ids in ``[-F, vocab)``; an eager forward does not know the
feed, so ``resolve_feed`` must run before one (``ModelRunner.decode_batch(tokens_from=...)``
does the same gather outside a graph).
"""

from __future__ import annotations

import torch

from ..errors import ConfigError


def feed_id(row: int) -> int:
    """The input id that makes a batch row read ``feed[row]``."""
    return -1 - row


def resolve_feed(ids: torch.Tensor, feed: torch.Tensor) -> None:
    """In place: every ``ids[i] < 0`` becomes ``feed[-1 - ids[i]]`` (device ops, no host sync;
    an index past the feed is clamped into it, so a bad id cannot read outside it)."""
    rows = (-1 - ids).clamp_(0, feed.shape[0] - 1)  # [n]: the feed row of each id
    torch.where(ids < 0, feed[rows], ids, out=ids)


def check_feed(feed: object, device: torch.device) -> torch.Tensor | None:
    """``feed`` as given, or ``ConfigError`` naming what is wrong with it."""
    if feed is None:
        return None
    if not isinstance(feed, torch.Tensor):
        raise ConfigError(f"feed must be a torch.Tensor, got {type(feed).__name__}.")
    if feed.dtype is not torch.int64 or feed.dim() != 1 or feed.shape[0] < 1:
        raise ConfigError(
            f"feed must be a 1-D int64 tensor of at least one row, got {feed.dtype} of shape "
            f"{tuple(feed.shape)}; e.g. torch.zeros(max_bs, dtype=torch.int64, device=...)."
        )
    if feed.device != device:
        raise ConfigError(f"feed is on {feed.device}; the graphs run on {device}: move it there.")
    if not feed.is_contiguous():
        raise ConfigError("feed must be contiguous (the graphs read it at a fixed address).")
    return feed


__all__ = ["check_feed", "feed_id", "resolve_feed"]
