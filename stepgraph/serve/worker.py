"""The engine thread of `stepgraph serve`: one thread builds the ``Engine`` and is the only one
that ever calls it (the thread rule, ``check_same_thread``), running the overlapped step loop.

HTTP handlers (on the asyncio loop) hand it requests through a thread-safe queue, ``submit`` and
``abort``, and read their tokens from a ``Stream``: an ``asyncio.Queue`` per request, filled on
the loop's own thread through ``loop.call_soon_threadsafe``, one call per engine step for every
request that got tokens in it. Nobody polls: the engine thread blocks on its queue when it has
nothing to run, and a handler awaits its stream.

An engine step that raises fails every request in flight (``EngineFault``, HTTP 500); the
engine has already dropped them and freed their pages (``Engine.step``), so the thread carries
on with the next request. ``stop`` aborts what is left, frees every page and ends the thread.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from ..engine import Sampling
from ..errors import StepGraphError
from .engine_proc import engine_info, finish_reason
from .errors import ApiError, EngineFault, RequestError, ServerBusy
from .protocol import GenParams, Limits

log = logging.getLogger("stepgraph.serve")
_SUBMIT, _ABORT, _STOP = "submit", "abort", "stop"
SWITCH_INTERVAL_S = 0.0002  # the GIL's hand-off interval while a server runs (default 0.005)


class Stream:
    """One request as its handler sees it. ``queue`` yields ``(token ids, finish reason or
    None, error or None)``; the last item has a reason or an error. The ``_`` fields belong to
    the engine thread."""

    def __init__(self, params: GenParams, loop: asyncio.AbstractEventLoop, arrival: float):
        self.params, self.loop, self.arrival = params, loop, arrival
        self.queue: asyncio.Queue = asyncio.Queue()
        self.closed = False  # the handler saw the last item, or gave up on the request
        self._rid: int | None = None
        self._first: float | None = None  # when its first token reached the host
        self._tokens = 0
        self._end = "abort"  # the reason counted when the handler aborts it


def engine_limits(engine: Any, model: str, can_tokenize: bool, chat: bool) -> Limits:
    """The requests ``engine`` can hold, as the protocol checks them (``engine_info``)."""
    info = engine_info(engine)
    return Limits(model, info["vocab"], info["room"], can_tokenize, chat)


class EngineWorker:
    """``build()`` runs on the engine thread and returns the ``Engine``; ``start`` waits for it
    (and raises its error). ``metrics``: a ``ServeMetrics`` or None."""

    def __init__(self, build: Callable[[], Any], metrics: Any = None) -> None:
        self._build, self.metrics = build, metrics
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._main, name="stepgraph-engine", daemon=True)
        self._ready = threading.Event()
        self.engine: Any = None
        self.error: BaseException | None = None
        self.accepting = False
        self._submitted = 0  # written by the loop's thread only
        self._taken = 0  # written by the engine thread only
        self.engine_waiting = self.running = self.kv_pages_free = self.kv_pages_total = 0

    # -- the handlers' side ------------------------------------------------------------------

    def start(self, timeout: float | None = None) -> EngineWorker:
        # The engine thread's host work per step (~0.1-0.5 ms) must not wait out the HTTP
        # thread's turn on the GIL: at Python's default 5 ms switch interval, a busy event loop
        # holds it for whole GPU steps and the device idles (concurrency 64 ran at a quarter of
        # the offline tokens/s).
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
        self._thread.start()
        if not self._ready.wait(timeout):
            raise StepGraphError(f"the engine was not built within {timeout} s.")
        if self.error is not None:
            raise self.error
        self.accepting = True
        return self

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def refusal(self) -> str | None:
        """Why a new request gets a 503 now, or None."""
        return None if self.accepting else "the server is shutting down; send it to another one."

    def limits(self, model: str, can_tokenize: bool, chat: bool) -> Limits:
        return engine_limits(self.engine, model, can_tokenize, chat)

    @property
    def waiting(self) -> int:
        """Requests handed over and not yet running: in the queue, or waiting in the engine."""
        return self._submitted - self._taken + self.engine_waiting

    def submit(self, params: GenParams, loop: asyncio.AbstractEventLoop, arrival: float) -> Stream:
        stream = Stream(params, loop, arrival)
        self._submitted += 1
        self._inbox.put((_SUBMIT, stream))
        return stream

    def abort(self, stream: Stream, reason: str = "abort") -> None:
        """Drop ``stream``'s request (a client that went away; ``reason="stop"``: a stop
        string ended it); its pages go back."""
        if not stream.closed:
            stream.closed = True
            stream._end = reason
            self._inbox.put((_ABORT, stream))

    def stop(self, timeout: float | None = None) -> None:
        """Abort every request left, free every page, release the engine, end the thread."""
        self.accepting = False
        if self._thread.is_alive():
            self._inbox.put((_STOP, None))
            self._thread.join(timeout)

    # -- the engine thread -------------------------------------------------------------------

    def _main(self) -> None:
        try:
            self.engine = self._build()
            kv = self.engine.model_runner.kv_cache
            self.kv_pages_total = kv.num_pages - 1
            if self.metrics is not None:
                self.metrics.watch(self.engine)
        except BaseException as e:  # noqa: BLE001 - handed to start(), which raises it
            self.error = e
            self._ready.set()
            return
        self._ready.set()
        try:
            self._loop(self.engine)
        except BaseException as e:  # a bug here, not in a step: say so, fail what is left
            log.exception("the engine thread stopped")
            self.error, self.accepting = e, False
        finally:
            self.engine.shutdown()

    def _loop(self, engine: Any) -> None:
        streams: dict[int, Stream] = {}
        while True:
            cmds = []
            if not engine.has_unfinished:
                engine.drain()  # pages of the last step back before sleeping
                self._publish(engine)
                cmds.append(self._inbox.get())  # idle: block until a request comes
            while True:
                try:
                    cmds.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            for kind, stream in cmds:
                if kind == _STOP:
                    self._stop(engine, streams)
                    return
                if kind == _SUBMIT:
                    self._taken += 1
                    self._add(engine, stream, streams)
                elif stream._rid in streams:
                    engine.abort(stream._rid)
                    del streams[stream._rid]
                    self._count(stream._end)
            if not engine.has_unfinished:
                continue
            try:
                pairs = engine.step()
            except Exception as e:  # the engine freed every page already (Engine.step)
                log.exception("engine step failed; failing %d requests in flight", len(streams))
                fault = EngineFault(
                    f"the engine step failed ({type(e).__name__}: {e}); this request was dropped "
                    "and its KV pages freed. The server is up: send it again."
                )
                self._fail(list(streams.values()), fault, "error")
                streams.clear()
                continue
            self._deliver(engine, streams, pairs)
            self._publish(engine)

    def _add(self, engine: Any, stream: Stream, streams: dict[int, Stream]) -> None:
        p = stream.params
        try:
            rid = engine.add_request(
                p.prompt_ids, p.max_tokens, stop_ids=p.stop_ids, ignore_eos=p.ignore_eos,
                min_tokens=p.min_tokens, seed=p.seed,
                sampling=Sampling(p.temperature, p.top_k) if p.temperature > 0 else None,
            )  # fmt: skip
        except StepGraphError as e:  # the protocol's checks should have caught it
            self._fail([stream], RequestError(str(e), param="prompt"), "error")
            return
        stream._rid = rid
        streams[rid] = stream
        if self.metrics is not None:
            self.metrics.prompt_tokens.inc(len(p.prompt_ids))

    def _deliver(self, engine: Any, streams: dict[int, Stream], pairs: list) -> None:
        now = time.perf_counter()
        new: dict[int, list[int]] = {}
        for rid, tok in pairs:
            new.setdefault(rid, []).append(tok)
        items = []
        for rid, toks in new.items():
            stream = streams.get(rid)
            req = engine.finished.pop(rid, None)
            if stream is None:
                continue
            if stream._first is None:
                stream._first = now
                if self.metrics is not None:
                    self.metrics.ttft.observe(now - stream.arrival)
            stream._tokens += len(toks)
            reason = None
            if req is not None:
                reason = finish_reason(req)
                del streams[rid]
                self._count(reason)
                if self.metrics is not None and stream._tokens > 1:
                    self.metrics.tpot.observe((now - stream._first) / (stream._tokens - 1))
            items.append((stream, (toks, reason, None)))
        if self.metrics is not None:
            self.metrics.add_tokens(len(pairs), now)
        _post(items)

    def _fail(self, streams: list[Stream], err: ApiError, label: str) -> None:
        for _ in streams:
            self._count(label)
        _post([(s, ([], None, err)) for s in streams])

    def _stop(self, engine: Any, streams: dict[int, Stream]) -> None:
        engine.abort_all()  # every page back once the device is idle
        left = list(streams.values())
        while True:  # handed over after stop began: refused too
            try:
                kind, stream = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == _SUBMIT:
                left.append(stream)
        self._fail(
            left, ServerBusy("the server is shutting down; send the request again."), "abort"
        )
        self._publish(engine)

    def _publish(self, engine: Any) -> None:
        self.engine_waiting, self.running = len(engine.waiting), len(engine.running)
        self.kv_pages_free = engine.model_runner.kv_cache.allocator.num_free
        if self.metrics is not None:
            self.metrics.publish(
                self.running, self.waiting, self.kv_pages_free, self.kv_pages_total
            )

    def _count(self, label: str) -> None:
        if self.metrics is not None:
            self.metrics.finished.labels(label).inc()


def _post(items: list[tuple[Stream, tuple]]) -> None:
    """Hand each stream its item on its loop's thread: one wake-up per loop and step."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
    for stream, item in items:
        by_loop.setdefault(stream.loop, []).append((stream.queue, item))
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, batch)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


def _put_all(batch: list) -> None:
    for q, item in batch:
        q.put_nowait(item)


__all__ = ["EngineWorker", "Stream", "engine_limits", "finish_reason"]
