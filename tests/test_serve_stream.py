"""Streamed answers of `stepgraph serve` as a client reads them: one server-sent event per
engine step that gave the request tokens (one per token at one request), the first as soon as
it lands, also on a fresh server's first request, with the engine on a thread and in its own
process; events merge only while the client reads more slowly than tokens come (a send that had
to wait for the connection), or while the handler lags many steps behind the engine."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
httpx = pytest.importorskip("httpx")

from stepgraph.serve import app as app_mod  # noqa: E402
from stepgraph.serve.app import Handlers, _Pace, _Streamed, build_app  # noqa: E402
from stepgraph.serve.engine_proc import EngineSpec  # noqa: E402
from stepgraph.serve.metrics import ServeMetrics  # noqa: E402
from stepgraph.serve.proc_worker import ProcessWorker  # noqa: E402
from stepgraph.serve.protocol import Limits  # noqa: E402
from stepgraph.serve.responses import Shapes, TextStream  # noqa: E402
from stepgraph.serve.server import ServerThread  # noqa: E402
from stepgraph.serve.worker import EngineWorker  # noqa: E402

SPEC = EngineSpec("tiny", "cpu", "float32", "graph", 4, 256, warmup=False)


def _events(url: str, n: int, prompt: list[int]) -> list[list[int]]:
    """The token ids of each event of a streamed completion of ``n`` tokens."""
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": n,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    out = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                out.append(json.loads(line[6:])["choices"][0]["token_ids"])
    return out


@pytest.mark.parametrize("kind", ["thread", "process"])
def test_one_event_per_token_from_a_fresh_servers_first_request(kind):
    worker = (EngineWorker if kind == "thread" else ProcessWorker)(SPEC, ServeMetrics())
    try:
        worker.start(timeout=120)
        app = build_app(worker, worker.limits("tiny", False, False), None, 64, stop_timeout=20)
        with ServerThread(app) as url:
            for n, prompt in [(6, [1, 2, 3]), (6, [4, 5]), (12, [6, 7, 8, 9])]:
                events = _events(url, n, prompt)
                assert [len(e) for e in events] == [1] * n, (kind, n, events)
    finally:
        worker.stop(30)


class _Worker:
    """What ``Handlers._events`` asks of a worker."""

    def abort(self, stream, reason="abort"):
        stream.closed = True


def _drain(items: list[tuple], backed_up: bool) -> list[list[int]]:
    """The token ids of each event ``_events`` makes of ``items``, all queued before it reads."""

    async def go():
        q: asyncio.Queue = asyncio.Queue()
        for item in items:
            q.put_nowait(item)
        params = SimpleNamespace(prompt_ids=[1], include_usage=False)
        stream = SimpleNamespace(queue=q, params=params, closed=False)
        h = Handlers(_Worker(), Limits("tiny", 512, 64, False, False), None, 64)
        shapes = Shapes("cmpl-1", 0, "tiny", False, True)
        pace = _Pace()
        pace.backed_up = backed_up
        out = []
        async for raw in h._events(stream, shapes, TextStream(None, []), pace):
            if raw.startswith(b"data: {"):
                out.append(json.loads(raw[6:])["choices"][0]["token_ids"])
        return out

    return asyncio.run(go())


def test_queued_steps_stay_events_of_their_own_unless_the_client_lags():
    items = [([1], None, None), ([2], None, None), ([3], None, None), ([4], "length", None)]
    assert _drain(items, backed_up=False) == [[1], [2], [3], [4]]
    assert _drain(items, backed_up=True) == [[1, 2, 3, 4]]


def test_a_handler_that_lags_the_engine_catches_up_at_the_limit_not_before():
    n = app_mod.BEHIND_ITEMS
    at = [([i], None, None) for i in range(n)] + [([n], "length", None)]  # n behind the first
    assert _drain(at, backed_up=False) == [list(range(n + 1))]
    below = at[1:]  # n - 1 behind the first
    assert _drain(below, backed_up=False) == [[i] for i in range(1, n + 1)]


def _watch(send) -> bool:
    """``pace.backed_up`` after ``_Streamed`` sent one message through ``send``."""
    pace = _Pace()

    async def body():
        yield b"x"

    async def receive():
        await asyncio.sleep(3600)

    streamed = _Streamed(body(), lambda: None, pace)
    scope = {"type": "http", "asgi": {"spec_version": "2.4"}}
    asyncio.run(streamed(scope, receive, send))
    return pace.backed_up


def test_a_send_that_waits_for_the_client_marks_the_stream_backed_up():
    async def at_once(message):  # the transport took it: no turn of the event loop
        pass

    async def drains(message):  # the transport's buffer was full: it waited for the client
        await asyncio.sleep(0)

    assert _watch(at_once) is False
    assert _watch(drains) is True


def test_the_engine_build_says_each_phase_as_it_begins_and_ends(capsys):
    """A large model builds for minutes on the CPU: the server says what it is doing."""
    engine = EngineSpec("tiny", "cpu", "float32", "graph", 2, 64)()
    try:
        err = capsys.readouterr().err
    finally:
        engine.shutdown()
    lines = [x for x in err.splitlines() if x.startswith("stepgraph serve: ")]
    for what in (
        "building random (seed 0) weights of tiny on cpu (float32)",
        "building the engine (graph, capturing its decode and prefill graphs)",
        "warming up every prompt-length class",
    ):
        begin = next(i for i, x in enumerate(lines) if what in x and x.endswith("..."))
        end = next(i for i, x in enumerate(lines) if what in x and ": done in " in x)
        assert begin < end, lines
