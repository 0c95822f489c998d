"""Triton's once-a-process work, started while the weights load.

The first kernel a process compiles, or loads from Triton's disk cache, first computes Triton's
own hash (``triton.runtime.cache.triton_key``: part of every compile-cache key). It hashes
Triton's sources and its ``libtriton`` library, about 500 MB, once a process: 0.36 s on this
project's CPU machine, paid inside the first capture's warm-ups. ``start_triton_key`` computes
it in a thread while the model's weights load (model runners on CUDA call it before building
their model; hashlib releases the GIL on large reads), so the first capture finds it cached
(docs/experiments.md#tritons-own-hash-while-the-weights-load).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

_started: threading.Thread | None = None


def _triton_key() -> Callable[[], Any] | None:
    """Triton's cached ``triton_key`` (None where this Triton has none by that name)."""
    try:
        from triton.runtime.cache import triton_key
    except ImportError:  # pragma: no cover - older Triton kept it in the compiler module
        try:
            from triton.compiler.compiler import triton_key
        except ImportError:
            return None
    return triton_key if hasattr(triton_key, "cache_info") else None


def start_triton_key() -> threading.Thread | None:
    """Compute Triton's own hash in a daemon thread, once a process; the thread (None where
    Triton has no cached ``triton_key``). Later calls return the first call's thread."""
    global _started
    if _started is not None:
        return _started
    key = _triton_key()
    if key is None:
        return None
    _started = threading.Thread(target=_quietly, args=(key,), name="triton-key", daemon=True)
    _started.start()
    return _started


def _quietly(key: Callable[[], Any]) -> None:
    try:
        key()
    except Exception:  # noqa: BLE001 - the first compile computes it again and reports
        pass


__all__ = ["start_triton_key"]
