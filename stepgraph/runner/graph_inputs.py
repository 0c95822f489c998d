"""The captured step's first op on CUDA: the packed rows into the static inputs, in one launch.

A captured decode step begins by turning the packed rows ``[B, width]`` int64 (``PACKED``) into
the per-field static buffers the model reads; with pinned staging it first picks this
replay's slot of the two copied from the host, and with a feed it replaces ids ``-1 - j`` by
``feed[j]``. As torch ops that is up to 14 small kernels (a slot ``index_select``, the parity
flip and the copy count, five field copies, five for the feed), a tenth of a one-row step's
launches (docs/experiments.md#packed-inputs). ``fill_inputs`` runs it as one Triton launch,
one program per row:

    slot       staged: ``copies & 1`` (``staging.py``: replay k reads slot k % 2), read
               from the host's pinned slots through their mapped address: no H2D memcpy
               node (``PinnedStaging.device_copy``, from ``DecodeTuning.staging_copy``, read
               at capture: both slots copied to the device first)
    fields     input_ids (feed resolved), positions, out_cache_loc int64; seq_lens int32
    table      block_table int32, in chunks of ``BLOCK_P`` pages
    count      staged: the last program to finish (an atomic ticket) bumps ``copies``, sets
               ``parity = copies & 1``, writes the count to the host's pinned ``copied`` (a
               store through its mapped address: no D2H memcpy node) and resets the ticket,
               after every program read ``copies`` (each reads it before taking its ticket)

Elsewhere (the CPU stand-in) the torch ops run, as before; ``tests/test_graph_inputs.py``
checks the kernel against them under the Triton interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..batch import PACKED
from .feed import resolve_feed

BLOCK_P = 128  # block-table pages per inner iteration


@triton.jit
def _fill_inputs_kernel(
    src_ptr,  # int64 rows: [B, W] (packed) or [max_bs, 2, W] (staged slots, host or device)
    row_stride,  # elements between two rows
    slot_stride,  # elements between the two staged slots
    copies_ptr,  # int64 [1]: replays that copied (staged)
    parity_ptr,  # int64 [1]: copies & 1 (staged)
    ticket_ptr,  # int32 [1]: programs done this replay (staged), 0 between replays
    copied_ptr,  # int64 [1], pinned host memory: the count's mirror (staged)
    feed_ptr,  # int64 [F]
    feed_n,
    ids_ptr,
    pos_ptr,
    loc_ptr,
    seq_ptr,  # int32
    table_ptr,  # int32 [*, table_stride]
    table_stride,
    pages,
    STAGED: tl.constexpr,
    FEED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    src = src_ptr + row.to(tl.int64) * row_stride
    if STAGED:
        k = tl.load(copies_ptr)
        src += (k & 1) * slot_stride
    tok = tl.load(src)
    if FEED:
        j = tl.minimum(tl.maximum(-1 - tok, 0), feed_n - 1)
        tok = tl.where(tok < 0, tl.load(feed_ptr + j), tok)
    tl.store(ids_ptr + row, tok)
    tl.store(pos_ptr + row, tl.load(src + 1))
    tl.store(loc_ptr + row, tl.load(src + 2))
    tl.store(seq_ptr + row, tl.load(src + 3).to(tl.int32))
    dst = table_ptr + row.to(tl.int64) * table_stride
    for p0 in range(0, pages, BLOCK):
        offs = p0 + tl.arange(0, BLOCK)
        m = offs < pages
        tl.store(dst + offs, tl.load(src + 4 + offs, mask=m).to(tl.int32), mask=m)
    if STAGED:
        done = tl.atomic_add(ticket_ptr, 1)  # acq_rel: after this program's read of copies
        if done == tl.num_programs(0) - 1:  # the last: every program has read ``copies``
            tl.store(ticket_ptr, 0)
            tl.store(copies_ptr, k + 1)
            tl.store(parity_ptr, (k + 1) & 1)
            tl.store(copied_ptr, k + 1)  # to the host, after this replay's copy (stream order)


def captured_inputs(buffers, bucket: int, staging, feed, unpack: bool, kernel: bool) -> None:
    """Captured: the live batch into ``buffers``' static fields. ``kernel`` (CUDA, packed
    inputs): one ``fill_inputs`` launch, which reads the staged slot from pinned host memory
    and mirrors the copy count to the host (with ``staging.device_copy``: the slots' copy to
    the device first, read there); else the torch ops (the staged slot selected, the
    packed rows unpacked, the feed resolved)."""
    if kernel:
        copy = staging is not None and staging.device_copy
        if copy:
            staging.copy_slots(bucket)
        fill_inputs(buffers, bucket, staging, feed, from_host=not copy)
        return
    if staging is not None:
        staging.upload(bucket, buffers.packed)
    if unpack:
        buffers.unpack(bucket)
    if feed is not None:
        resolve_feed(buffers.input_ids[:bucket], feed)


def fill_inputs(
    buffers, bucket: int, staging=None, feed: torch.Tensor | None = None, from_host: bool = True
) -> None:
    """Captured: rows ``[:bucket]`` of the packed inputs (``staging``'s slot of this replay, or
    ``buffers.packed``) into ``buffers``' fields, ids read from ``feed`` where they ask.
    ``from_host``: the slot is read from ``staging.host`` (pinned: device-visible at the same
    address under unified addressing), else from its device copy ``staging.device_rows``."""
    assert PACKED.fields == ("input_ids", "positions", "out_cache_loc", "seq_lens")
    if staging is not None:
        src = staging.host if from_host else staging.device_rows  # the same [max_bs, 2, W]
        slot_stride = src.stride(1)
        copies, parity, ticket = staging.copies, staging.parity, staging.ticket
        copied = staging.copied  # pinned: the kernel writes it through its mapped address
    else:
        src, slot_stride = buffers.packed, 0
        copies = parity = copied = buffers.packed  # unread: STAGED is off
        ticket = buffers.seq_lens
    table = buffers.block_table
    _fill_inputs_kernel[(bucket,)](
        src,
        src.stride(0),
        slot_stride,
        copies,
        parity,
        ticket,
        copied,
        feed if feed is not None else buffers.input_ids,
        0 if feed is None else feed.shape[0],
        buffers.input_ids,
        buffers.positions,
        buffers.out_cache_loc,
        buffers.seq_lens,
        table,
        table.stride(0),
        src.shape[-1] - PACKED.table_col,
        STAGED=staging is not None,
        FEED=feed is not None,
        BLOCK=BLOCK_P,
    )


__all__ = ["BLOCK_P", "captured_inputs", "fill_inputs"]
