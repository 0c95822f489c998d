"""Pinned staging of the packed input rows, with the host->device copy inside the graph.

Without it a replay launches one device copy of the packed rows from the host (10-17 us of host
time on the H200 VM). With ``RunnerConfig(pinned_staging=True)`` the host only writes the rows
into pinned memory (a CPU copy), and each captured step begins by copying them to the device:

    host   [2, max_bs, width] int64, pinned     two slots; replay k reads slot k % 2
    device [2, max_bs, width] int64             both slots' rows [:B], two memcpy nodes
    parity [1] int64, device                    which slot this replay reads; flipped in-graph
    packed [max_bs, width]                      rows [:B] of slot ``parity`` (index_select)

The rule (also in ``docs/design.md``): the host writes slot ``k % 2`` for replay ``k`` only
after the event recorded behind replay ``k - 2`` has completed, so it never overwrites rows
whose copy has not run. It may write slot ``(k + 1) % 2`` while replay ``k`` runs: replay ``k``
copies that slot too (one copy per slot keeps the graph's addresses fixed) but discards it.
The device parity and the host's replay count start at 0 after capture and advance together:
every captured graph flips the parity once per replay, and nothing else touches it.
"""

from __future__ import annotations

import torch

from ..batch import ForwardBatch, pack_batch

SLOTS = 2


class _NoEvent:
    """The CPU stand-in's event: replays there are synchronous, so a slot is always free."""

    def record(self) -> None:
        return None

    def synchronize(self) -> None:
        return None


class PinnedStaging:
    """Two pinned slots of packed rows, their device mirror, the parity and the two events."""

    def __init__(self, pad: torch.Tensor, max_bs: int, device: torch.device) -> None:
        """``pad``: one packed padding row ``[width]`` int64 (``input_buffers.pad_row``)."""
        width = pad.shape[0]
        cuda = device.type == "cuda"
        self.pad = pad.cpu()  # [width] int64
        self.host = torch.empty(SLOTS, max_bs, width, dtype=torch.int64, pin_memory=cuda)
        self.host[:] = self.pad
        self.device_rows = torch.empty(SLOTS, max_bs, width, dtype=torch.int64, device=device)
        self.parity = torch.zeros(1, dtype=torch.int64, device=device)
        self.events = [torch.cuda.Event() if cuda else _NoEvent() for _ in range(SLOTS)]
        self.dirty = [0] * SLOTS  # rows [:dirty[s]] of slot s may hold live values
        self.count = 0  # replays staged since capture: replay k reads slot k % 2
        self.waits = 0  # slot writes that had to wait for their event (a host ahead of the GPU)

    # -- inside the captured step ------------------------------------------------------------

    def upload(self, bucket: int, packed: torch.Tensor) -> None:
        """Captured: both slots' rows ``[:bucket]`` to the device, the slot of this replay into
        ``packed[:bucket]``, then flip the parity for the next replay."""
        for s in range(SLOTS):
            self.device_rows[s, :bucket].copy_(self.host[s, :bucket], non_blocking=True)
        dst = packed[:bucket].unsqueeze(0)  # [1, bucket, width]
        torch.index_select(self.device_rows[:, :bucket], 0, self.parity, out=dst)
        self.parity.bitwise_xor_(1)

    def reset(self) -> None:
        """After capture: warm-ups flipped the parity; start both counts from slot 0."""
        self.parity.zero_()
        self.count = 0

    # -- on the host, per replay -------------------------------------------------------------

    def stage(self, batch: ForwardBatch, bucket: int) -> None:
        """Write ``batch``'s packed rows into the slot of the next replay, re-padding rows
        ``[bs:bucket]`` that a larger batch left live. Waits first until the replay that read
        this slot last (two replays ago) has run."""
        slot = self.count & 1
        ev = self.events[slot]
        if not _done(ev):
            self.waits += 1
            ev.synchronize()
        bs = batch.batch_size
        rows = self.host[slot, :bs]  # [bs, width], contiguous, pinned
        src = getattr(batch, "packed_cpu", None)  # host rows the batch was packed from
        if src is None:  # device rows: a D2H copy, ordered before the graph's H2D on the stream
            src = batch.packed if batch.packed is not None else pack_batch(batch)
        if src.shape[1] == rows.shape[1]:
            rows.copy_(src, non_blocking=src.is_cuda)
        else:  # a narrower table: columns past it are never read (seq_len bounds the pages)
            rows[:, : src.shape[1]].copy_(src, non_blocking=src.is_cuda)
        stale = min(self.dirty[slot], bucket)
        if stale > bs:
            self.host[slot, bs:stale] = self.pad
        self.dirty[slot] = self.dirty[slot] if self.dirty[slot] > bucket else bs

    def replayed(self) -> None:
        """Right after the graph's replay was queued: mark the slot it reads as busy."""
        self.events[self.count & 1].record()
        self.count += 1


def _done(ev) -> bool:
    return isinstance(ev, _NoEvent) or ev.query()


__all__ = ["PinnedStaging", "SLOTS"]
