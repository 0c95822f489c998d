"""The ASGI app of `stepgraph serve` (Starlette): ``POST /v1/completions``,
``POST /v1/chat/completions``, ``GET /v1/models``, ``GET /health`` and ``GET /metrics`` over
one ``EngineClient`` (``client.py``): ``ProcessWorker`` (the engine in its own process) or
``EngineWorker`` (a thread), the same engine loop behind either.

A handler checks its request (``protocol.py``; a 400 naming the field, nothing queued), refuses
it with 503 and ``Retry-After`` while more than ``max_waiting`` requests wait (or while the
engine is restarting, or the server stops), then hands it to the engine and awaits its tokens.
Streamed (``"stream": true``), each engine step's tokens are one server-sent event, sent as
soon as they land (merged only while the client reads slower than they come), ending in
``data: [DONE]``; a client that goes away aborts its request, before its first chunk as well as
mid-way, and so does one that leaves a non-streamed request before its answer. An engine fault
answers 500 (streamed: an error event) and the server carries on. With an API key, ``/v1/``
answers 401 without it (``auth.py``).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .auth import RequireKey
from .chat import parse_chat
from .client import EngineClient, Stream
from .errors import ApiError, RequestError, ServerBusy, error_body
from .protocol import DEFAULT_MAX_WAITING, Limits, parse_completion
from .responses import SSE_DONE, Shapes, TextStream, sse


def _error(err: ApiError) -> JSONResponse:
    headers = {"Retry-After": str(err.retry_after_s)} if isinstance(err, ServerBusy) else None
    return JSONResponse(error_body(err), status_code=err.status, headers=headers)


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


BEHIND_ITEMS = 16  # steps a stream's handler may lag before it catches up in one event


class _Pace:
    """Whether the client of one stream reads more slowly than its tokens come: its last event
    waited for the connection to drain (the transport's buffer was full)."""

    backed_up = False


class _Streamed(StreamingResponse):
    """A streamed answer that aborts its request however it ends: a client that goes away
    before the first chunk ends the response before its generator ever starts (and a generator
    that never started runs no ``finally``). Each send is watched: one that had to wait for the
    client marks ``pace.backed_up`` (a send that does not wait never gives the event loop a
    turn, so a callback queued before it has not run when it returns)."""

    def __init__(self, content: Any, on_end: Any, pace: _Pace) -> None:
        super().__init__(
            content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
        self._on_end, self._pace = on_end, pace

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        loop, pace = asyncio.get_running_loop(), self._pace

        async def watched(message: Any) -> None:
            turns: list[None] = []
            mark = loop.call_soon(turns.append, None)
            try:
                await send(message)
            finally:
                mark.cancel()
            pace.backed_up = bool(turns)

        try:
            await super().__call__(scope, receive, watched)
        finally:
            self._on_end()


def _merged(item: tuple, q: asyncio.Queue, merge: bool) -> tuple:
    """``item`` and, when ``merge``, the items queued behind it as one: a client that reads
    slower than the engine steps gets a chunk of several tokens, not a growing backlog of
    one-token chunks. Otherwise each engine step's tokens are an event of their own."""
    while merge and item[1] is None and item[2] is None and not q.empty():
        toks, reason, err = q.get_nowait()
        item = (item[0] + toks, reason, err)
    return item


async def _warm_streaming() -> None:
    """Import now what the first streamed answer would import on the event loop (anyio's task
    group, docs/serving.md): else every token that lands meanwhile waits for it, and the first
    client sees them all in one event."""
    import anyio

    async with anyio.create_task_group():
        pass


class Handlers:
    def __init__(
        self, worker: EngineClient, limits: Limits, tokenizer: Any, max_waiting: int
    ) -> None:
        self.worker, self.limits, self.tokenizer = worker, limits, tokenizer
        self.max_waiting = max_waiting

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def _generate(self, request: Request, chat: bool) -> Response:
        arrival = time.perf_counter()
        try:
            body = json.loads(await request.body())
        except ValueError as e:  # bad UTF-8 included
            return _error(RequestError(f"the request body is not valid JSON ({e}).", "body"))
        tok = self.tokenizer
        try:
            if chat:
                params = parse_chat(body, self.limits, tok.apply_template if tok else None)
            else:
                params = parse_completion(body, self.limits, tok.encode if tok else None)
            self._check_room()
        except ApiError as e:
            return _error(e)
        stream = self.worker.submit(params, asyncio.get_running_loop(), arrival)
        prefix = "chatcmpl" if chat else "cmpl"
        shapes = Shapes(
            f"{prefix}-{uuid.uuid4().hex}",
            int(time.time()),
            self.limits.model,
            chat,
            params.return_token_ids,
        )
        text = TextStream(tok.decode if tok else None, params.stop_texts)
        if params.stream:
            pace = _Pace()
            return _Streamed(
                self._events(stream, shapes, text, pace), lambda: self.worker.abort(stream), pace
            )
        answer = asyncio.ensure_future(self._collect(stream, shapes, text))
        gone = asyncio.ensure_future(_until_disconnect(request))
        try:
            await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not answer.done():  # the client left first: nobody will read the answer
                answer.cancel()
                self.worker.abort(stream)
        if answer.cancelled():
            return Response(status_code=499)  # nobody reads it; nginx's "client closed"
        return answer.result()

    def _check_room(self) -> None:
        w = self.worker
        why = w.refusal()
        if why is not None:
            raise ServerBusy(why)
        if w.waiting >= self.max_waiting:
            raise ServerBusy(
                f"{w.waiting} requests are waiting already, the most this server queues "
                f"(--max-waiting {self.max_waiting}); retry after a second."
            )

    def _take(self, stream: Stream, item: tuple, text: TextStream) -> tuple[str, str | None]:
        """The text of one item and the finish reason; a stop string ends the request."""
        toks, reason, _ = item
        piece = text.add(toks)
        if text.stopped and reason is None:
            reason = "stop"
            self.worker.abort(stream, "stop")  # the engine stops it; the text is cut already
        elif reason is not None:
            piece += text.flush()
        if reason is not None:
            stream.closed = True
        return piece, reason

    async def _collect(self, stream: Stream, shapes: Shapes, text: TextStream) -> Response:
        ids, pieces = [], []
        try:
            while True:
                item = await stream.queue.get()
                if item[2] is not None:
                    stream.closed = True
                    return _error(item[2])
                ids += item[0]
                piece, reason = self._take(stream, item, text)
                pieces.append(piece)
                if reason is not None:
                    n_prompt, cached = len(stream.params.prompt_ids), stream.cached_tokens
                    answer = shapes.final("".join(pieces), ids, reason, n_prompt, cached)
                    return JSONResponse(answer)
        finally:
            self.worker.abort(stream)  # no-op once it finished

    async def _events(self, stream: Stream, shapes: Shapes, text: TextStream, pace: _Pace):
        """One event per engine step that gave ``stream`` tokens, the first as soon as it
        lands; merged only while the client reads slower than they come (``pace``), or while
        this handler lags ``BEHIND_ITEMS`` steps behind the engine."""
        n_out, first, q = 0, True, stream.queue
        try:
            while True:
                item = _merged(await q.get(), q, pace.backed_up or q.qsize() >= BEHIND_ITEMS)
                if item[2] is not None:
                    stream.closed = True
                    yield sse(error_body(item[2]))
                    break
                n_out += len(item[0])
                piece, reason = self._take(stream, item, text)
                yield shapes.sse_chunk(piece, item[0], reason, first)
                first = False
                if reason is not None:
                    if stream.params.include_usage:
                        n_prompt, cached = len(stream.params.prompt_ids), stream.cached_tokens
                        yield sse(shapes.usage_chunk(n_prompt, n_out, cached))
                    break
            yield SSE_DONE
        finally:  # cancelled when the client disconnects: abort, and the pages go back
            self.worker.abort(stream)

    async def models(self, request: Request) -> Response:
        card = {
            "id": self.limits.model,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "stepgraph",
            "max_model_len": self.limits.max_context,
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def health(self, request: Request) -> Response:
        w = self.worker
        ok = w.alive and w.accepting
        body = {
            "status": "ok" if ok else "unavailable",
            "running": w.running,
            "waiting": w.waiting,
            "kv_pages_free": w.kv_pages_free,
            "kv_pages_total": w.kv_pages_total,
            "engine_pid": w.pid,
        }
        return JSONResponse(body, status_code=200 if ok else 503)

    async def metrics(self, request: Request) -> Response:
        if self.worker.metrics is None:
            return Response("no metrics\n", status_code=404, media_type="text/plain")
        text, content_type = self.worker.metrics.render()
        return Response(text, media_type=content_type)


def build_app(
    worker: EngineClient,
    limits: Limits,
    tokenizer: Any = None,
    max_waiting: int = DEFAULT_MAX_WAITING,
    stop_timeout: float = 30.0,
    api_key: str | None = None,
) -> Starlette:
    """The app over a started ``worker``; its shutdown stops the worker (every page freed).
    ``api_key``: ``/v1/`` then needs ``Authorization: Bearer <api_key>`` (``auth.py``)."""
    h = Handlers(worker, limits, tokenizer, max_waiting)

    @asynccontextmanager
    async def lifespan(app: Starlette):
        worker.attach(asyncio.get_running_loop())  # the engine's answers come on this loop
        await _warm_streaming()
        yield
        await asyncio.get_running_loop().run_in_executor(None, worker.stop, stop_timeout)

    async def on_error(request: Request, exc: Exception) -> Response:
        return _error(ApiError(f"internal error: {type(exc).__name__}: {exc}"))

    async def on_http(request: Request, exc: HTTPException) -> Response:  # 404, 405
        err = {
            "message": f"{exc.detail}: {request.method} {request.url.path}",
            "type": "invalid_request_error",
            "param": None,
            "code": None,
        }
        return JSONResponse({"error": err}, status_code=exc.status_code)

    routes = [
        Route("/v1/completions", h.completions, methods=["POST"]),
        Route("/v1/chat/completions", h.chat, methods=["POST"]),
        Route("/v1/models", h.models, methods=["GET"]),
        Route("/health", h.health, methods=["GET"]),
        Route("/metrics", h.metrics, methods=["GET"]),
    ]
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={Exception: on_error, HTTPException: on_http},
        middleware=[Middleware(RequireKey, key=api_key)] if api_key else None,
    )
    app.state.worker, app.state.limits, app.state.handlers = worker, limits, h
    return app


__all__ = ["Handlers", "build_app"]
