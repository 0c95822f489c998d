"""The feed's rows in pinned host memory, stored by the captured step itself.

An overlapped loop needs each step's sampled ids on the host one step later. Copying them with
a D2H memcpy puts a copy between two graphs on the stream, and every step pays its hand-over on
the device. Where the step writes its own sampled ids into the feed (the fused step's greedy
argmax into ``ModelRunner.greedy_tokens``), the graph's last launch can store them to pinned
host memory through its mapped address instead (as ``graph_inputs``' launch stores the staging
copy count), and the host reads them once an event after the replay has completed:

    host   [SLOTS, max_bs] int64, pinned   replay k (the staging count after it, 1-based)
                                           writes slot k % SLOTS; the host reads that slot's
                                           rows [:bs] once the replay's event has completed
    copies [1] int64, device               the staging count, bumped by the replay's first
                                           launch: the slot is picked on the device

``SLOTS`` is three: the overlapped loop reads step k's slot before it launches step k + 2, so
two would do; the third leaves a margin. Only runners that stage their inputs keep a count,
so only those mirror (``DecodeTuning.token_mirror``). On the CPU stand-in the same store runs
as torch ops; under the Triton interpreter the kernel is checked against them
(``tests/test_token_mirror.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SLOTS = 3
BLOCK = 128  # ids a loop iteration stores: one kernel variant for every bucket


@triton.jit(do_not_specialize=["n"])
def _mirror_kernel(
    feed_ptr, copies_ptr, host_ptr, n, host_stride, SLOTS: tl.constexpr, BLOCK: tl.constexpr
):
    slot = tl.load(copies_ptr) % SLOTS
    dst = host_ptr + slot * host_stride
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        m = offs < n
        tl.store(dst + offs, tl.load(feed_ptr + offs, mask=m), mask=m)


class TokenMirror:
    """``SLOTS`` pinned rows of the feed, one written by each replay in turn."""

    def __init__(self, max_bs: int, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.host = torch.zeros(SLOTS, max_bs, dtype=torch.int64, pin_memory=self.cuda)
        self._views: dict[tuple[int, int], torch.Tensor] = {}  # (slot, bs) -> host[slot, :bs]

    def store(self, feed: torch.Tensor, copies: torch.Tensor, bucket: int) -> None:
        """Captured, after the step wrote ``feed``: its rows ``[:bucket]`` into slot
        ``copies % SLOTS`` (``copies``: this replay's staging count, already bumped)."""
        if self.cuda:
            _mirror_kernel[(1,)](
                feed, copies, self.host, bucket, self.host.stride(0), SLOTS=SLOTS, BLOCK=BLOCK
            )
            return
        slot = torch.remainder(copies, SLOTS)  # [1], on the device: no host sync
        self.host[:, :bucket].index_copy_(0, slot, feed[:bucket].unsqueeze(0))

    def rows(self, count: int, bs: int) -> torch.Tensor:
        """The host rows ``[:bs]`` that the replay of staging count ``count`` writes (a view,
        kept per slot and ``bs``): valid once that replay has run."""
        key = (count % SLOTS, bs)
        view = self._views.get(key)
        if view is None:
            view = self._views[key] = self.host[key[0], :bs]
        return view


__all__ = ["SLOTS", "TokenMirror"]
