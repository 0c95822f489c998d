"""``ProcessWorker``: the process transport of `stepgraph serve --engine process` (the default).
The engine runs in a process of its own (``engine_proc.py``, started with the spawn context), as
vLLM and SGLang run theirs, so that the event loop's Python (parsing, SSE, detokenizing,
metrics) and the engine's never wait on one GIL. The loop inside is the same ``EngineLoop`` an
engine thread runs; the ``FrontEnd`` here is the same as ``EngineWorker``'s.

Everything runs on the event loop's thread: commands go to the engine through a non-blocking
pipe (``EngineProcess.send``: a full pipe or a hung engine never blocks the loop), and the
engine's one message per step is read there too (``loop.add_reader`` on the pipe: no thread,
no polling).

If the engine process dies (its pipe ends, or its sentinel fires), every request in flight
fails with a 500, and the process is started again (at most ``max_restarts`` times); until it
is ready, requests get 503. ``stop`` tells it to abort what is left and exit, waits for it,
then terminates it if it has not: no orphan. The engine process also leaves by itself when
this process goes away (end of file on its pipe)."""

from __future__ import annotations

import asyncio
import atexit
import logging
import multiprocessing
from typing import Any

from ..errors import StepGraphError
from .client import STOPPING, FrontEnd
from .engine_proc import EngineProcess, EngineSpec
from .errors import EngineFault
from .loop import READY, STOP

log = logging.getLogger("stepgraph.serve")
MAX_RESTARTS = 3


class ProcessWorker(FrontEnd):
    """``spec``: the engine to build in the process. ``metrics``: a ``ServeMetrics`` or None."""

    def __init__(self, spec: EngineSpec, metrics: Any = None, max_restarts: int = MAX_RESTARTS):
        super().__init__(metrics)
        self.spec, self.max_restarts = spec, max_restarts
        self._ctx = multiprocessing.get_context("spawn")
        self._child: EngineProcess | None = None
        self.restarting = False
        self.error: str | None = None  # the engine cannot be started (again)
        self.restarts = 0

    # -- starting and stopping ---------------------------------------------------------------

    def start(self, timeout: float | None = None) -> ProcessWorker:
        """Start the engine process and wait until it is built (raise why it was not)."""
        atexit.register(self._at_exit)
        ch = self._child = self._spawn()
        msg = None
        try:
            msg = self._first(ch, timeout)
        except (EOFError, OSError):
            ch.proc.join(5)
        if msg is None or msg[0] != READY:
            if msg:
                why = msg[1]
            elif not ch.proc.is_alive():
                why = f"it exited with status {ch.proc.exitcode}"
            else:
                why = f"it was not built within {timeout} s"
            self.stop(5)
            raise StepGraphError(f"the engine process did not start: {why}")
        self._ready(msg[1])
        return self

    def _spawn(self) -> EngineProcess:
        """A new engine process (the tensor-parallel worker starts a rank group instead)."""
        return EngineProcess(self._ctx, self.spec)

    def _first(self, ch: EngineProcess, timeout: float | None) -> tuple | None:
        """The engine's first message, ``(READY, info)`` or ``(FAILED, text)``; None when none
        came within ``timeout`` s."""
        return ch.from_r.recv() if ch.from_r.poll(timeout) else None

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Read the engine's messages on ``loop`` (the server's, at its startup)."""
        self._loop = loop
        if self._child is not None and not self._child.dead:
            self._watch(self._child)

    def _watch(self, ch: EngineProcess) -> None:
        ch.attach(self._loop)
        self._loop.add_reader(ch.from_r.fileno(), self._readable, ch)
        self._loop.add_reader(ch.proc.sentinel, self._exited, ch)

    def _unwatch(self, ch: EngineProcess) -> None:
        self._loop.remove_reader(ch.from_r.fileno())
        self._loop.remove_reader(ch.proc.sentinel)

    def stop(self, timeout: float | None = None) -> None:
        """Tell the engine to abort what is left and exit; wait ``timeout`` s, then end it."""
        self.accepting, self.stopping = False, True
        ch = self._child
        if ch is None or ch.dead:
            return
        if ch.proc.is_alive():
            self._on_loop(ch.send, (STOP,))
        ch.end(30.0 if timeout is None else timeout)
        self._on_loop(self._exited, ch)

    def _at_exit(self) -> None:
        if self._child is not None and self._child.proc.is_alive():
            self._child.proc.kill()

    # -- the handlers' side ------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        return self.info.get("pid")

    @property
    def alive(self) -> bool:
        ch = self._child
        return ch is not None and not ch.dead and not self.restarting and self.error is None

    def refusal(self) -> str | None:
        """Why a new request gets a 503 now, or None."""
        if self.stopping:
            return STOPPING
        if self.error is not None:
            return f"the engine is down ({self.error}); this server serves nothing more."
        if self.restarting or not self.accepting:
            return "the engine process is restarting after it exited; retry in a few seconds."
        return None

    def _send(self, msg: tuple) -> None:
        self._child.send(msg)

    # -- the engine's messages, on the event loop --------------------------------------------

    def _readable(self, ch: EngineProcess) -> None:
        try:
            while not ch.dead and ch.from_r.poll():
                self._handle(ch.from_r.recv())
        except (EOFError, OSError):  # it exited (or was killed mid-message)
            self._exited(ch)

    def _ready(self, info: dict) -> None:
        super()._ready(info)
        self.restarting = False

    def _failed(self, why: str) -> None:
        log.error("the engine process could not be built again: %s", why)
        self.error, self.restarting = why, False

    def _exited(self, ch: EngineProcess) -> None:
        """The engine process ``ch`` is gone: fail what it held; start it again."""
        if ch.dead:
            return
        if self._loop is not None and not self._loop.is_closed():
            self._unwatch(ch)
        try:  # the steps it sent before it went
            while ch.from_r.poll():
                self._handle(ch.from_r.recv())
        except (EOFError, OSError):
            pass
        ch.close()
        self.running = self.engine_waiting = 0
        if self.stopping:  # stop() waits for the process
            self._fail_left()
            return
        left, self._streams = list(self._streams.values()), {}
        status = ch.end(5.0)
        again = self.restarts < self.max_restarts
        log.error(
            "the engine process exited (status %s) with %d requests in flight%s",
            status,
            len(left),
            "; starting it again" if again else "",
        )
        then = (
            "The server starts the engine again: retry in a few seconds."
            if again
            else "The server serves nothing more."
        )
        self._fail(
            left,
            EngineFault(
                f"the engine process exited (status {status}) with this request in flight; "
                f"it was dropped. {then}"
            ),
        )
        self.accepting = False
        if not again:
            self.error = f"the engine process exited {self.restarts + 1} times, last {status}"
            return
        self.restarts += 1
        self.restarting = True
        self.sent = self.taken = 0  # the counts of the process that is gone
        self._child = self._spawn()
        if self._loop is not None:
            self._watch(self._child)


__all__ = ["MAX_RESTARTS", "ProcessWorker"]
