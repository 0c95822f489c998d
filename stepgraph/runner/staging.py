"""Pinned staging of the packed input rows, with the host->device copy inside the graph.

Without it a replay launches one device copy of the packed rows from the host (13 us of host
time on the H200 VM, where every CUDA call costs 8-17 us). With
``RunnerConfig(pinned_staging=True)`` the host path makes no CUDA call but the graph launch: it
writes the rows into pinned memory (numpy), and each captured step begins by fetching them:

    host   [max_bs, 2, width] int64, pinned     two slots; replay k reads slot k % 2, on
                                                CUDA straight from here (``graph_inputs``:
                                                pinned memory is device-visible at its
                                                address, so no H2D memcpy node)
    device [max_bs, 2, width] int64             both slots' rows [:B], one memcpy node (the
                                                slots interleave, so rows [:B] are
                                                contiguous): the CPU stand-in, and CUDA with
                                                ``device_copy`` (``DecodeTuning.staging_copy``)
    parity [1] int64, device                    which slot this replay reads; flipped in-graph
    packed [max_bs, width]                      rows [:B] of slot ``parity`` (index_select)
    copied [1] int64, pinned host               replays whose copy has run: on CUDA written by
                                                ``graph_inputs``' launch itself (no memcpy
                                                node), on the CPU stand-in a copy

The rule (also in ``docs/design.md``): the host writes slot ``k % 2`` for replay ``k`` only once
``copied >= k - 1``, i.e. once replay ``k - 2``, the last one to read that slot, has copied it; so
it never overwrites rows whose copy has not run. It may write slot ``(k + 1) % 2`` while replay
``k`` runs: replay ``k`` reads only its own slot (where it copies both, a graph's addresses being
fixed, it discards the other). The counts start at 0 after capture and advance together: every
captured graph flips the parity and bumps ``copied`` once per replay, and nothing else touches
them. A graph replayed by hand (``graph.replay()``, as a benchmark of the bare launch does) counts
on the device only; the next ``stage`` sees ``copied`` ahead of its count, waits for the device and
counts from there (a hand replay still in flight then goes unseen: replay through the runner).
Reading ``copied`` is a load from pinned memory, not a CUDA call (an event record plus query cost
16 us there).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from ..batch import ForwardBatch
from ..errors import ReplayError
from .input_buffers import pack_fields

SLOTS = 2
WAIT_LIMIT_S = 60.0  # a replay's copy not run after this long: the stream is stuck


def _pause() -> None:
    time.sleep(0)  # let the GPU's DMA land; the host is two replays ahead


class PinnedStaging:
    """Two pinned slots of packed rows, their device mirror, the parity and the copy count."""

    def __init__(
        self, pad: torch.Tensor, max_bs: int, device: torch.device, device_copy: bool = False
    ) -> None:
        """``pad``: one packed padding row ``[width]`` int64 (``input_buffers.pad_row``);
        ``device_copy``: a captured step reads the slots from a device copy (one memcpy node)
        instead of from the pinned memory (``DecodeTuning.staging_copy``)."""
        self.device_copy = device_copy
        width = pad.shape[0]
        cuda = device.type == "cuda"
        self.pad = pad.cpu()  # [width] int64
        self.host = torch.empty(max_bs, SLOTS, width, dtype=torch.int64, pin_memory=cuda)
        self.host[:] = self.pad
        self.device_rows = torch.empty(max_bs, SLOTS, width, dtype=torch.int64, device=device)
        self.parity = torch.zeros(1, dtype=torch.int64, device=device)
        self.copies = torch.zeros(1, dtype=torch.int64, device=device)  # bumped in-graph
        self.ticket = torch.zeros(1, dtype=torch.int32, device=device)  # graph_inputs.py's
        self.copied = torch.zeros(1, dtype=torch.int64, pin_memory=cuda)  # its host mirror
        self._host_np, self._pad_np = self.host.numpy(), self.pad.numpy()
        self._copied_np = self.copied.numpy()
        self._copied_mv = memoryview(self._copied_np)  # [0]: a Python int, read live
        self._views: dict[tuple[int, int, int], np.ndarray] = {}  # (slot, bs, width) -> rows
        self._host_views: dict[tuple[int, int, int], torch.Tensor] = {}  # the same, as torch
        self.dirty = [0] * SLOTS  # rows [:dirty[s]] of slot s may hold live values
        self.count = 0  # replays staged since capture: replay k reads slot k % 2
        self.waits = 0  # slot writes that had to wait for a copy (a host ahead of the GPU)
        self.resyncs = 0  # times graphs replayed outside runner.replay were counted back in
        self.pause = _pause  # what the wait does between looks (tests replace it)

    # -- inside the captured step ------------------------------------------------------------

    def upload(self, bucket: int, packed: torch.Tensor) -> None:
        """Captured: both slots' rows ``[:bucket]`` to the device, the slot of this replay into
        ``packed[:bucket]``, the parity flipped and the copy counted (on the host too). On CUDA
        the runner does the middle part in one launch instead (``graph_inputs.py``)."""
        self.copy_slots(bucket)
        dst = packed[:bucket].unsqueeze(1)  # [bucket, 1, width]
        torch.index_select(self.device_rows[:bucket], 1, self.parity, out=dst)
        self.parity.bitwise_xor_(1)
        self.copies.add_(1)
        self.mirror()

    def copy_slots(self, bucket: int) -> None:
        """Captured: both slots' rows ``[:bucket]`` to the device (a graph's addresses are
        fixed, so both; the replay reads the one of its count), in one copy."""
        self.device_rows[:bucket].copy_(self.host[:bucket], non_blocking=True)

    def mirror(self) -> None:
        """Captured, last (the torch-op path): the copy count to pinned host memory, after the
        copies in stream order."""
        self.copied.copy_(self.copies, non_blocking=True)

    def reset(self) -> None:
        """After capture (the warm-ups ran the step): restart every count from 0. Capture
        synchronizes at its end, so no warm-up's copy into ``copied`` is still in flight."""
        self.parity.zero_()
        self.copies.zero_()
        self.ticket.zero_()
        self.copied.zero_()
        self.count = 0

    def rows(self, slot: int) -> torch.Tensor:
        """Slot ``slot``'s host rows ``[max_bs, width]`` (a view)."""
        return self.host[:, slot]

    # -- on the host, per replay -------------------------------------------------------------

    def stage(self, batch: ForwardBatch, bucket: int):
        """Write ``batch``'s packed rows into the slot of the next replay, re-padding rows
        ``[bs:bucket]`` that a larger batch left live. Waits first until the replay that read
        this slot last (two replays ago) has copied it. Returns the host rows as numpy (None for
        a device-only batch)."""
        src = batch.packed_cpu  # host rows the batch was packed from
        if src is not None:
            rows = src.numpy()  # [bs, <= width]: a narrower table's missing columns are unread
            self.stage_rows(rows, bucket)
            return rows
        slot = self._free_slot()  # device rows: a D2H copy, before the graph's on the stream
        src = batch.packed if batch.packed is not None else pack_fields(batch)  # one launch
        bs, width = src.shape
        dst = self._host_views.get((slot, bs, width))  # torch's slicing: host time per call
        if dst is None:
            dst = self._host_views[(slot, bs, width)] = self.host[:bs, slot, :width]
        dst.copy_(src, non_blocking=src.is_cuda)
        self._repad(slot, bs, bucket)
        return None

    def stage_rows(self, rows: np.ndarray, bucket: int) -> None:
        """``stage`` of host rows given as numpy ``[bs, <= width]`` int64 (the replay's path
        for a batch with ``packed_cpu``: one numpy write into a view kept per slot and shape,
        no torch call)."""
        slot = self._free_slot()
        bs, width = rows.shape
        dst = self._views.get((slot, bs, width))
        if dst is None:
            dst = self._views[(slot, bs, width)] = self._host_np[:bs, slot, :width]
        dst[...] = rows
        if self.dirty[slot] != bs:  # else nothing is stale and nothing changes
            self._repad(slot, bs, bucket)

    def _free_slot(self) -> int:
        """The slot of the next replay, once the replay that read it last has copied it."""
        count, copied = self.count, self._copied_mv[0]
        if copied > count:  # a graph replayed outside runner.replay
            self._resync()
            count = self.count
        elif copied < count - 1:  # the slot's last reader has not copied yet
            self._wait_for(count - 1)
        return count & 1

    def _repad(self, slot: int, bs: int, bucket: int) -> None:
        """Pad rows ``[bs:bucket]`` of ``slot`` that a larger batch left live."""
        stale = min(self.dirty[slot], bucket)
        if stale > bs:
            self._host_np[bs:stale, slot] = self._pad_np
        self.dirty[slot] = self.dirty[slot] if self.dirty[slot] > bucket else bs

    def replayed(self) -> None:
        """Right after the graph's replay was queued."""
        self.count += 1

    def _resync(self) -> None:
        """Bare ``graph.replay()`` calls flipped the parity without the host's count: wait for
        the device, then count from the replays that ran (each copied once)."""
        if self.host.is_pinned():
            torch.cuda.synchronize(self.device_rows.device)
        self.count = int(self._copied_np[0])
        self.resyncs += 1

    def _wait_for(self, copies: int) -> None:
        """Until at least ``copies`` replays have copied their inputs (a pinned-memory load)."""
        if self._copied_np[0] >= copies:
            return
        self.waits += 1
        deadline = time.monotonic() + WAIT_LIMIT_S
        while self._copied_np[0] < copies:
            if time.monotonic() > deadline:
                raise ReplayError(
                    f"pinned staging: replay {copies - 1} has not copied its inputs after "
                    f"{WAIT_LIMIT_S:.0f} s, so its slot cannot be rewritten; the stream is stuck "
                    "or a graph was replayed outside runner.replay. Synchronize and check the "
                    "device, or use RunnerConfig(pinned_staging=False)."
                )
            self.pause()


__all__ = ["PinnedStaging", "SLOTS"]
