"""``EngineWorker``: the thread transport of `stepgraph serve --engine thread`. One thread builds
the ``Engine`` and runs the ``EngineLoop`` (``loop.py``), the only caller of the engine (the
thread rule, ``check_same_thread``).

Commands reach the loop through a thread-safe queue; its answers, one message per engine step,
reach the event loop through ``loop.call_soon_threadsafe``, where the ``FrontEnd`` hands each
request's tokens to its ``Stream``. Nobody polls: the engine thread blocks on its queue when it
has nothing to run, and a handler awaits its stream.

An engine step that raises fails every request in flight (``EngineFault``, HTTP 500); the
engine has already dropped them and freed their pages (``Engine.step``), so the loop carries on
with the next request. ``stop`` aborts what is left, frees every page and ends the thread.
"""

from __future__ import annotations

import logging
import queue
import sys
import threading
from collections.abc import Callable
from typing import Any

from ..errors import StepGraphError
from .client import STOPPING, FrontEnd, Stream, engine_limits
from .loop import STOP, EngineLoop, engine_info, finish_reason

log = logging.getLogger("stepgraph.serve")
SWITCH_INTERVAL_S = 0.0002  # the GIL's hand-off interval while a server runs (default 0.005)


class _QueueInbox:
    """The loop's inbox on a thread: a queue the event loop's thread puts commands in."""

    def __init__(self) -> None:
        self._q: queue.SimpleQueue = queue.SimpleQueue()

    def put(self, msg: tuple) -> None:
        self._q.put(msg)

    def recv(self) -> tuple:
        return self._q.get()

    def poll(self) -> bool:
        return not self._q.empty()


class _LoopOutbox:
    """The loop's outbox on a thread: each answer handled on the front end's event loop (or
    here, before any request attached one: only state comes then)."""

    def __init__(self, front: FrontEnd) -> None:
        self.front = front

    def send(self, msg: tuple) -> None:
        loop = self.front._loop
        if loop is None:
            self.front._handle(msg)
            return
        try:
            loop.call_soon_threadsafe(self.front._handle, msg)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


class EngineWorker(FrontEnd):
    """``build()`` runs on the engine thread and returns the ``Engine``; ``start`` waits for it
    (and raises its error). ``metrics``: a ``ServeMetrics`` or None."""

    def __init__(self, build: Callable[[], Any], metrics: Any = None) -> None:
        super().__init__(metrics)
        self._build = build
        self._inbox = _QueueInbox()
        self._thread = threading.Thread(target=self._main, name="stepgraph-engine", daemon=True)
        self._ready_event = threading.Event()
        self.engine: Any = None
        self.error: BaseException | None = None

    @property
    def stats(self) -> Any:
        """The engine's own counts, read at each scrape (plain ints)."""
        return self.counts if self.engine is None else self.engine.stats

    def start(self, timeout: float | None = None) -> EngineWorker:
        # a busy event loop must not hold the GIL for whole engine steps (docs/serving.md)
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
        self._thread.start()
        if not self._ready_event.wait(timeout):
            raise StepGraphError(f"the engine was not built within {timeout} s.")
        if self.error is not None:
            raise self.error
        return self

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def refusal(self) -> str | None:
        """Why a new request gets a 503 now, or None."""
        return None if self.accepting else STOPPING

    def _send(self, msg: tuple) -> None:
        self._inbox.put(msg)

    def stop(self, timeout: float | None = None) -> None:
        """Abort every request left, free every page, release the engine, end the thread."""
        self.accepting, self.stopping = False, True
        if self._thread.is_alive():
            self._inbox.put((STOP,))
            self._thread.join(timeout)
        self._on_loop(self._fail_left, "the server is shutting down; send the request again.")

    def _main(self) -> None:
        try:
            self.engine = self._build()
            self._ready(engine_info(self.engine))  # before the loop's first state
        except BaseException as e:  # noqa: BLE001 - handed to start(), which raises it
            self.error = e
            self._ready_event.set()
            return
        self._ready_event.set()
        try:
            EngineLoop(self.engine, self._inbox, _LoopOutbox(self)).run()
        except BaseException as e:  # a bug here, not in a step: say so, fail what is left
            log.exception("the engine thread stopped")
            self.error, self.accepting = e, False
        finally:
            self.engine.shutdown()


__all__ = ["SWITCH_INTERVAL_S", "EngineWorker", "Stream", "engine_limits", "finish_reason"]
