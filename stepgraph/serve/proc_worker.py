"""``ProcessWorker``: the HTTP process's side of `stepgraph serve --engine process` (the
default). The engine runs in a process of its own (``engine_proc.py``, started with the spawn
context), as vLLM and SGLang run theirs, so that the event loop's Python (parsing, SSE,
detokenizing, metrics) and the engine's never wait on one GIL.

It has ``EngineWorker``'s face (``submit``, ``abort``, ``stop``, ``waiting``, ``refusal``,
...), so the app does not know which it drives. Everything runs on the event loop's thread:
requests go to the engine through a non-blocking pipe (``EngineProcess.send``: a full pipe or a
hung engine never blocks the loop), and the engine's one message per step is read there too
(``loop.add_reader`` on the pipe: no thread, no polling), which hands each request's tokens to
its ``Stream`` and stamps TTFT and TPOT.

If the engine process dies (its pipe ends, or its sentinel fires), every request in flight
fails with a 500, and the process is started again (at most ``max_restarts`` times); until it
is ready, requests get 503. ``stop`` tells it to abort what is left and exit, waits for it,
then terminates it if it has not: no orphan. The engine process also leaves by itself when
this process goes away (end of file on its pipe)."""

from __future__ import annotations

import asyncio
import atexit
import itertools
import logging
import multiprocessing
import time
from types import SimpleNamespace
from typing import Any

from ..errors import StepGraphError
from .engine_proc import (
    ABORT,
    FAILED,
    FAULT,
    READY,
    REJECT,
    STEP,
    STOP,
    SUBMIT,
    EngineProcess,
    EngineSpec,
    submit_fields,
)
from .errors import ApiError, EngineFault, RequestError, ServerBusy
from .protocol import GenParams, Limits
from .worker import Stream

log = logging.getLogger("stepgraph.serve")
MAX_RESTARTS = 3


class ProcessWorker:
    """``spec``: the engine to build in the process. ``metrics``: a ``ServeMetrics`` or None."""

    def __init__(self, spec: EngineSpec, metrics: Any = None, max_restarts: int = MAX_RESTARTS):
        self.spec, self.metrics, self.max_restarts = spec, metrics, max_restarts
        self._ctx = multiprocessing.get_context("spawn")
        self._child: EngineProcess | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[int, Stream] = {}  # requests in flight, by their id here
        self._ids = itertools.count()
        self.info: dict = {}
        self.accepting = self.stopping = self.restarting = False
        self.error: str | None = None  # the engine cannot be started (again)
        self.restarts = 0
        self.running = self.engine_waiting = self.kv_pages_free = self.kv_pages_total = 0
        self.stats = SimpleNamespace(graph_steps=0, eager_steps=0, prefill_steps=0)
        if metrics is not None:
            metrics.watch(self)  # reads self.stats at each scrape

    # -- starting and stopping ---------------------------------------------------------------

    def start(self, timeout: float | None = None) -> ProcessWorker:
        """Start the engine process and wait until it is built (raise why it was not)."""
        atexit.register(self._at_exit)
        ch = self._child = EngineProcess(self._ctx, self.spec)
        msg = None
        try:
            if ch.from_r.poll(timeout):
                msg = ch.from_r.recv()
        except (EOFError, OSError):
            ch.proc.join(5)
        if msg is None or msg[0] != READY:
            why = msg[1] if msg else (
                f"it exited with status {ch.proc.exitcode}" if not ch.proc.is_alive()
                else f"it was not built within {timeout} s")  # fmt: skip
            self.stop(5)
            raise StepGraphError(f"the engine process did not start: {why}")
        self._ready(msg[1])
        return self

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Read the engine's messages on ``loop`` (the server's, at its startup)."""
        self._loop = loop
        if self._child is not None and not self._child.dead:
            self._watch(self._child)

    def _watch(self, ch: EngineProcess) -> None:
        ch.attach(self._loop)
        self._loop.add_reader(ch.from_r.fileno(), self._readable, ch)
        self._loop.add_reader(ch.proc.sentinel, self._exited, ch)

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

    def _on_loop(self, fn: Any, *args: Any) -> None:
        """``fn(*args)`` on the event loop's thread, which owns the pipes (``stop`` runs in
        the app's executor), or here when no loop runs."""
        loop = self._loop
        try:
            inside = asyncio.get_running_loop() is loop
        except RuntimeError:
            inside = False
        if loop is not None and loop.is_running() and not inside:
            loop.call_soon_threadsafe(fn, *args)
        else:
            fn(*args)

    def _at_exit(self) -> None:
        if self._child is not None and self._child.proc.is_alive():
            self._child.proc.kill()

    # -- the handlers' side ------------------------------------------------------------------

    def limits(self, model: str, can_tokenize: bool, chat: bool) -> Limits:
        return Limits(model, self.info["vocab"], self.info["room"], can_tokenize, chat)

    @property
    def pid(self) -> int | None:
        return self.info.get("pid")

    @property
    def alive(self) -> bool:
        ch = self._child
        return ch is not None and not ch.dead and not self.restarting and self.error is None

    @property
    def waiting(self) -> int:
        """Requests handed over and not yet running: in the pipe, or waiting in the engine.
        Both counts belong to one engine process, so a new one starts them both at 0."""
        ch = self._child
        return (ch.sent - ch.taken if ch is not None else 0) + self.engine_waiting

    def refusal(self) -> str | None:
        """Why a new request gets a 503 now, or None."""
        if self.stopping:
            return "the server is shutting down; send it to another one."
        if self.error is not None:
            return f"the engine is down ({self.error}); this server serves nothing more."
        if self.restarting or not self.accepting:
            return "the engine process is restarting after it exited; retry in a few seconds."
        return None

    def submit(self, params: GenParams, loop: asyncio.AbstractEventLoop, arrival: float) -> Stream:
        if self._loop is None:
            self.attach(loop)
        stream = Stream(params, loop, arrival)
        stream._rid = fid = next(self._ids)
        self._streams[fid] = stream
        self._child.sent += 1
        self._child.send((SUBMIT, fid, submit_fields(params)))
        if self.metrics is not None:
            self.metrics.prompt_tokens.inc(len(params.prompt_ids))
        return stream

    def abort(self, stream: Stream, reason: str = "abort") -> None:
        """Drop ``stream``'s request (its client went away; ``"stop"``: a stop string ended
        it); the engine frees its pages."""
        if stream.closed:
            return
        stream.closed, stream._end = True, reason
        if self._streams.pop(stream._rid, None) is not None:
            self._count(reason)
            self._child.send((ABORT, stream._rid))

    # -- the engine's messages, on the event loop --------------------------------------------

    def _readable(self, ch: EngineProcess) -> None:
        try:
            while not ch.dead and ch.from_r.poll():
                self._handle(ch.from_r.recv())
        except (EOFError, OSError):  # it exited (or was killed mid-message)
            self._exited(ch)

    def _handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == STEP:
            self._deliver(msg[1])
            self._state(msg[2])
        elif kind == FAULT:
            err = EngineFault(f"the engine step failed ({msg[2]}); this request was dropped and "
                              "its KV pages freed. The server is up: send it again.")  # fmt: skip
            self._fail([self._streams.pop(i) for i in msg[1] if i in self._streams], err)
            self._state(msg[3])
        elif kind == REJECT:
            if (s := self._streams.pop(msg[1], None)) is not None:
                self._fail([s], RequestError(msg[2], param="prompt"))
        elif kind == READY:
            self._ready(msg[1])
        elif kind == FAILED:
            log.error("the engine process could not be built again: %s", msg[1])
            self.error, self.restarting = msg[1], False

    def _ready(self, info: dict) -> None:
        self.info, self.kv_pages_total = info, info["kv_pages_total"]
        self.kv_pages_free = self.kv_pages_total
        self.running = self.engine_waiting = 0
        self.restarting, self.accepting = False, not self.stopping

    def _deliver(self, items: list) -> None:
        now, m, n = time.perf_counter(), self.metrics, 0
        for fid, toks, reason in items:
            n += len(toks)
            s = self._streams.get(fid)
            if s is None:  # aborted meanwhile
                continue
            if s._first is None:
                s._first = now
                if m is not None:
                    m.ttft.observe(now - s.arrival)
            s._tokens += len(toks)
            if reason is not None:
                del self._streams[fid]
                self._count(reason)
                if m is not None and s._tokens > 1:
                    m.tpot.observe((now - s._first) / (s._tokens - 1))
            s.queue.put_nowait((toks, reason, None))
        if m is not None and n:
            m.add_tokens(n, now)

    def _state(self, state: tuple) -> None:
        self.running, self.engine_waiting, self.kv_pages_free, taken = state[:4]
        if self._child is not None:  # the process that sent it: a new one is made after
            self._child.taken = taken
        s = self.stats
        s.graph_steps, s.eager_steps, s.prefill_steps = state[4:]
        if self.metrics is not None:
            self.metrics.publish(self.running, self.waiting, self.kv_pages_free,
                                 self.kv_pages_total)  # fmt: skip

    def _exited(self, ch: EngineProcess) -> None:
        """The engine process ``ch`` is gone: fail what it held; start it again."""
        if ch.dead:
            return
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(ch.from_r.fileno())
            self._loop.remove_reader(ch.proc.sentinel)
        try:  # the steps it sent before it went
            while ch.from_r.poll():
                self._handle(ch.from_r.recv())
        except (EOFError, OSError):
            pass
        ch.close()
        left, self._streams = list(self._streams.values()), {}
        self.running = self.engine_waiting = 0
        if self.stopping:  # stop() waits for the process
            self._fail(left, ServerBusy("the server is shutting down; send it again."), "abort")
            return
        status = ch.end(5.0)
        again = self.restarts < self.max_restarts
        log.error("the engine process exited (status %s) with %d requests in flight%s", status,
                  len(left), "; starting it again" if again else "")  # fmt: skip
        self._fail(left, EngineFault(
            f"the engine process exited (status {status}) with this request in flight; it was "
            "dropped. " + ("The server starts the engine again: retry in a few seconds."
                           if again else "The server serves nothing more.")))  # fmt: skip
        self.accepting = False
        if not again:
            self.error = f"the engine process exited {self.restarts + 1} times, last {status}"
            return
        self.restarts += 1
        self.restarting = True
        self._child = EngineProcess(self._ctx, self.spec)
        if self._loop is not None:
            self._watch(self._child)

    def _fail(self, streams: list[Stream], err: ApiError, label: str = "error") -> None:
        for s in streams:
            self._count(label)
            s.closed = True
            s.queue.put_nowait(([], None, err))

    def _count(self, label: str) -> None:
        if self.metrics is not None:
            self.metrics.finished.labels(label).inc()


__all__ = ["MAX_RESTARTS", "ProcessWorker"]
