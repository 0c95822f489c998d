"""What the app asks of the engine (``EngineClient``), and the event loop's side of the one engine
loop (``FrontEnd``), shared by both transports: the engine on a thread (``EngineWorker``) or in
a process of its own (``ProcessWorker``).

A handler ``submit``s a request and reads its tokens from a ``Stream``: an ``asyncio.Queue``
filled on the event loop's thread, one item per engine step that gave the request tokens. The
front end numbers the requests, sends ``(SUBMIT, id, fields)`` and ``(ABORT, id)`` to the
``EngineLoop`` (``loop.py``) and handles its answers on the event loop (``FrontEnd._handle``):
each request's new tokens go to its stream, TTFT and TPOT are stamped, the loop's state (running,
waiting, KV pages free, steps) is published, and a fault fails what it names with a 500.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from types import SimpleNamespace
from typing import Any, Protocol, runtime_checkable

from .errors import ApiError, EngineFault, RequestError, ServerBusy
from .loop import ABORT, FAILED, FAULT, READY, REJECT, STEP, SUBMIT, engine_info, submit_fields
from .protocol import GenParams, Limits

STOPPING = "the server is shutting down; send it to another one."


class Stream:
    """One request as its handler sees it. ``queue`` yields ``(token ids, finish reason or
    None, error or None)``; the last item has a reason or an error. The ``_`` fields belong to
    the front end."""

    def __init__(self, params: GenParams, loop: asyncio.AbstractEventLoop, arrival: float):
        self.params, self.loop, self.arrival = params, loop, arrival
        self.queue: asyncio.Queue = asyncio.Queue()
        self.closed = False  # the handler saw the last item, or gave up on the request
        self._rid: int | None = None  # the front end's id of it
        self._first: float | None = None  # when its first token reached the front end
        self._tokens = 0
        self.cached_tokens = 0  # its prompt tokens served from the prefix cache (usage)


@runtime_checkable
class EngineClient(Protocol):
    """The engine as the app drives it (``build_app``), whatever carries its messages."""

    metrics: Any  # a ServeMetrics, or None
    accepting: bool  # started and not stopping
    running: int  # requests decoding or prefilling, as the engine said last
    kv_pages_free: int
    kv_pages_total: int

    @property
    def alive(self) -> bool: ...  # the engine can serve (not dead, not restarting)

    @property
    def waiting(self) -> int: ...  # handed over and not yet running

    @property
    def pid(self) -> int | None: ...  # the engine process's id; None on a thread

    def start(self, timeout: float | None = None) -> EngineClient: ...

    def attach(self, loop: asyncio.AbstractEventLoop) -> None: ...  # the server's event loop

    def refusal(self) -> str | None: ...  # why a new request gets a 503 now, or None

    def limits(self, model: str, can_tokenize: bool, chat: bool) -> Limits: ...

    def submit(
        self, params: GenParams, loop: asyncio.AbstractEventLoop, arrival: float
    ) -> Stream: ...

    def abort(self, stream: Stream, reason: str = "abort") -> None: ...

    def stop(self, timeout: float | None = None) -> None: ...


def engine_limits(engine: Any, model: str, can_tokenize: bool, chat: bool) -> Limits:
    """The requests ``engine`` can hold, as the protocol checks them (``engine_info``)."""
    info = engine_info(engine)
    return Limits(model, info["vocab"], info["room"], can_tokenize, chat)


class FrontEnd:
    """The event loop's side of an ``EngineLoop``. A transport subclasses it: it starts and
    stops the loop, carries ``_send``'s commands to it, and calls ``_handle`` with each of its
    answers on the event loop's thread. ``metrics``: a ``ServeMetrics`` or None."""

    def __init__(self, metrics: Any = None) -> None:
        self.metrics = metrics
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[int, Stream] = {}  # requests in flight, by their id here
        self._ids = itertools.count()
        self.info: dict = {}  # engine_info, once the engine is built
        self.accepting = self.stopping = False
        self.sent = 0  # submissions handed to this engine loop
        self.taken = 0  # of those, the ones it has read (its last state says)
        self.running = self.engine_waiting = self.kv_pages_free = self.kv_pages_total = 0
        self.counts = SimpleNamespace(graph_steps=0, eager_steps=0, prefill_steps=0)
        self._cache_seen = (0, 0)  # the engine's prefix cache queries and hits, last state
        if metrics is not None:
            metrics.watch(self)  # reads self.stats at each scrape

    def _send(self, msg: tuple) -> None:
        raise NotImplementedError

    @property
    def stats(self) -> Any:
        """The engine's step counts (graph, eager, prefill), as its last state said."""
        return self.counts

    @property
    def pid(self) -> int | None:
        return None

    @property
    def waiting(self) -> int:
        """Requests handed over and not yet running: on their way, or waiting in the engine."""
        return self.sent - self.taken + self.engine_waiting

    def limits(self, model: str, can_tokenize: bool, chat: bool) -> Limits:
        return Limits(model, self.info["vocab"], self.info["room"], can_tokenize, chat)

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Handle the engine's answers on ``loop`` (the server's, at its startup)."""
        self._loop = loop

    def submit(self, params: GenParams, loop: asyncio.AbstractEventLoop, arrival: float) -> Stream:
        if self._loop is None or self._loop.is_closed():  # a server started anew: its loop
            self.attach(loop)
        stream = Stream(params, loop, arrival)
        stream._rid = fid = next(self._ids)
        self._streams[fid] = stream
        self.sent += 1
        self._send((SUBMIT, fid, submit_fields(params)))
        if self.metrics is not None:
            self.metrics.prompt_tokens.inc(len(params.prompt_ids))
        return stream

    def abort(self, stream: Stream, reason: str = "abort") -> None:
        """Drop ``stream``'s request (its client went away; ``"stop"``: a stop string ended
        it); the engine frees its pages."""
        if stream.closed:
            return
        stream.closed = True
        if self._streams.pop(stream._rid, None) is not None:
            self._count(reason)
            self._send((ABORT, stream._rid))

    def _on_loop(self, fn: Any, *args: Any) -> None:
        """``fn(*args)`` on the event loop's thread, which owns the streams (``stop`` runs in
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

    # -- the engine loop's answers, on the event loop ----------------------------------------

    def _handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == STEP:
            self._deliver(msg[1])
            self._state(msg[2])
        elif kind == FAULT:
            err = EngineFault(
                f"the engine step failed ({msg[2]}); this request was dropped and its KV pages "
                "freed. The server is up: send it again."
            )
            self._fail([self._streams.pop(i) for i in msg[1] if i in self._streams], err)
            self._state(msg[3])
        elif kind == REJECT:
            if (s := self._streams.pop(msg[1], None)) is not None:
                self._fail([s], RequestError(msg[2], param="prompt"))
        elif kind == READY:
            self._ready(msg[1])
        elif kind == FAILED:
            self._failed(msg[1])

    def _ready(self, info: dict) -> None:
        self.info, self.kv_pages_total = info, info["kv_pages_total"]
        self.kv_pages_free = self.kv_pages_total
        self.running = self.engine_waiting = 0
        self._cache_seen = (0, 0)  # a new engine counts from 0
        self.accepting = not self.stopping

    def _failed(self, why: str) -> None:
        """The engine could not be built (again)."""

    def _deliver(self, items: list) -> None:
        now, m, n = time.perf_counter(), self.metrics, 0
        for fid, toks, reason, cached in items:
            n += len(toks)
            s = self._streams.get(fid)
            if s is None:  # aborted meanwhile
                continue
            if cached is not None:
                s.cached_tokens = cached
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
        self.running, self.engine_waiting, self.kv_pages_free, self.taken = state[:4]
        c = self.counts
        c.graph_steps, c.eager_steps, c.prefill_steps = state[4:7]
        seen, self._cache_seen = self._cache_seen, state[7:9]
        if self.metrics is not None:
            self.metrics.publish(
                self.running, self.waiting, self.kv_pages_free, self.kv_pages_total
            )
            self.metrics.add_cache(state[7] - seen[0], state[8] - seen[1])

    def _fail(self, streams: list[Stream], err: ApiError, label: str = "error") -> None:
        for s in streams:
            self._count(label)
            s.closed = True
            s.queue.put_nowait(([], None, err))

    def _fail_left(self, why: str = "the server is shutting down; send it again.") -> None:
        """Refuse every request still in flight (503): the engine loop has stopped."""
        left, self._streams = list(self._streams.values()), {}
        self._fail(left, ServerBusy(why), "abort")

    def _count(self, label: str) -> None:
        if self.metrics is not None:
            self.metrics.finished.labels(label).inc()


__all__ = ["STOPPING", "EngineClient", "FrontEnd", "Stream", "engine_limits"]
