"""Dependencies between the programs of one persistent launch (``mlp_block``): a work queue,
counters that a finished tile bumps and a dependent tile waits on, and the reset that leaves
every counter at zero for the next launch (a captured graph replays the same buffers).

The items of a launch are numbered in dependency order: an item waits only on items with
smaller numbers. Two schedules hand them out:

- **queue** (``STRIDE`` off): each program takes the next number from an atomic counter. An item
  is taken only by a running program, and everything it waits on was taken earlier, by running
  programs, so the launch cannot deadlock for any grid, resident or not. The interpreter, which
  runs programs one after another, needs this: its first program takes every item in order.
- **stride** (``STRIDE`` on): program ``p`` takes ``p, p + P, p + 2P, ...``, no atomic a fetch.
  Deadlock-free only while all ``P`` programs are resident at once: compiled launches only, with
  ``P`` at most the SM count (``mlp_block`` checks it); the interpreter would wait forever.

Memory order: a tile's writer stores, fences at gpu scope and between the generic and the async
proxy (every thread), syncs the CTA, then one thread bumps the counter with release semantics
(``signal``). A waiter polls with volatile
loads (L2, no RMW traffic on the line), then fences at gpu scope (acquire) and, before TMA reads
of what other programs wrote, fences between the generic and the async proxy (``wait_count``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .gemv_tiles import FENCE, gpu_fence

# int32 slots at the start of a launch's sync area: the queue, the exit count, then counters
SLOTS = 3  # before the counters
QUEUE = tl.constexpr(0)
EXITS = tl.constexpr(1)
FAULT = 2  # the interpreter's: set where an item found its inputs not done (see wait_count)
_FAULT = tl.constexpr(FAULT)  # the same slot, as kernels read it
COUNTERS = tl.constexpr(SLOTS)


@triton.jit
def proxy_fence():
    """``fence.proxy.async.global``: what this thread's generic loads and stores (and what its
    acquire made visible) are ordered before its later TMA loads (compiled only)."""
    if FENCE:
        tl.inline_asm_elementwise(
            "fence.proxy.async.global; mov.u32 $0, $1;", "=r,r", [tl.program_id(0)],
            dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip


@triton.jit
def first_item(sync_ptr, STRIDE: tl.constexpr):
    # -> this program's first item number
    if STRIDE:
        item = tl.program_id(0)
    else:
        item = tl.atomic_add(sync_ptr + QUEUE, 1, sem="relaxed", scope="gpu")
    return item


@triton.jit
def next_item(sync_ptr, item, STRIDE: tl.constexpr):
    # -> the item after ``item`` for this program
    if STRIDE:
        nxt = item + tl.num_programs(0)
    else:
        nxt = tl.atomic_add(sync_ptr + QUEUE, 1, sem="relaxed", scope="gpu")
    return nxt


@triton.jit
def wait_count(counter_ptr, target, sync_ptr, TMA_AFTER: tl.constexpr):
    """Block until ``*counter_ptr >= target``; then what the signalling programs wrote is visible
    to this thread's loads (and, ``TMA_AFTER``, to its TMA loads). Under the interpreter, which
    runs programs in turn, what is not done at the first look never will be: the item marks
    the sync area's ``FAULT`` slot and goes on, and the launcher raises (``check_fault``)."""
    seen = tl.load(counter_ptr, volatile=True)
    if FENCE:
        while seen < target:
            seen = tl.load(counter_ptr, volatile=True)
    else:
        tl.store(sync_ptr + _FAULT, 1, mask=seen < target)
    gpu_fence()
    if TMA_AFTER:
        proxy_fence()


@triton.jit
def signal(counter_ptr, rows):
    """Bump ``*counter_ptr`` once for this CTA when ``rows > 0`` (the program that finished the
    tile: ``gemv_tiles.splitk_reduce``'s last one), after every thread's stores (fenced for the
    async proxy too: dependents may read them by TMA)."""
    gpu_fence()
    proxy_fence()
    tl.debug_barrier()
    tl.atomic_add(counter_ptr, 1, mask=rows > 0, sem="release", scope="gpu")


@triton.jit
def exit_and_reset(sync_ptr, N_COUNTERS: tl.constexpr, BLOCK_C: tl.constexpr):
    """Count this program out; the last one zeroes the queue, the exit count and the
    ``N_COUNTERS`` counters (every other program has taken its last item by then; ``FAULT``
    is the launcher's to clear)."""
    tl.debug_barrier()
    n = tl.atomic_add(sync_ptr + EXITS, 1, sem="acq_rel", scope="gpu")
    upto = tl.where(n == tl.num_programs(0) - 1, COUNTERS + N_COUNTERS, 0)
    offs = tl.arange(0, BLOCK_C)
    mask = (offs < upto) & (offs != _FAULT)  # FAULT stays for the launcher to read
    tl.atomic_xchg(sync_ptr + offs, 0, mask=mask, sem="relaxed", scope="gpu")


def check_fault(sync, what: str) -> None:
    """After an interpreted launch: raise if an item waited on one that came after it (a
    launch that would hang on the GPU), and clear the mark."""
    if int(sync[FAULT]):
        sync[FAULT] = 0
        raise RuntimeError(f"{what}: an item waited on a later item (the GPU would hang)")


def sync_slots(counters: int) -> int:
    """int32 slots of a sync area with ``counters`` counters."""
    return SLOTS + counters


def reset_block(counters: int) -> int:
    """``BLOCK_C`` of ``exit_and_reset``: the slots as a power of two."""
    return triton.next_power_of_2(sync_slots(counters))


__all__ = [
    "COUNTERS",
    "EXITS",
    "FAULT",
    "QUEUE",
    "SLOTS",
    "check_fault",
    "exit_and_reset",
    "first_item",
    "next_item",
    "proxy_fence",
    "reset_block",
    "signal",
    "sync_slots",
    "wait_count",
]
