"""What the engine's build says on stderr (``phase``: a line as each part begins, one with its
seconds as it ends), and ``local_bar_lock``: the engine process's progress bars share a thread
lock, not a named semaphore."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterator


@contextlib.contextmanager
def phase(what: str) -> Iterator[None]:
    """One line on stderr as a phase of the build begins, one with its seconds as it ends: a
    large model takes minutes on the CPU, and the server says what it is doing meanwhile."""
    print(f"stepgraph serve: {what} ...", file=sys.stderr, flush=True)
    t = time.perf_counter()
    yield
    took = time.perf_counter() - t
    print(f"stepgraph serve: {what}: done in {took:.1f} s", file=sys.stderr, flush=True)


def local_bar_lock() -> None:
    """Progress bars (capture, prefill) in this process share a thread lock, not tqdm's
    default cross-process lock: that one is a named semaphore registered with the front end's
    resource tracker, and an engine process that is killed never unregisters it, so the front
    end warned of a "leaked semaphore" when it stopped after a restart. Nothing else in this
    process writes to its bars' stream."""
    with contextlib.suppress(ImportError):
        from tqdm import tqdm

        tqdm.set_lock(threading.RLock())


__all__ = ["local_bar_lock", "phase"]
