"""`stepgraph serve` with the engine in its own process (``ProcessWorker``, the default), through
the real ``openai`` client against a server this module starts on a free 127.0.0.1 port and
stops: greedy tokens equal to `stepgraph generate`; concurrent streams while some clients
leave; clients that leave before their first byte are aborted too (in both worker kinds); an
engine fault fails what is in flight and the next request is served; an engine process that
dies fails what is in flight, is started again, and serves; every KV page free after each
test; the front end killed, the engine process leaves by itself."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import struct
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from stepgraph.cli import main as cli_main  # noqa: E402
from stepgraph.serve import engine_proc  # noqa: E402
from stepgraph.serve.app import build_app  # noqa: E402
from stepgraph.serve.engine_proc import EngineSpec  # noqa: E402
from stepgraph.serve.metrics import ServeMetrics  # noqa: E402
from stepgraph.serve.proc_worker import ProcessWorker  # noqa: E402
from stepgraph.serve.server import ServerThread  # noqa: E402
from stepgraph.serve.worker import EngineWorker  # noqa: E402
from tests.serve_hooks import DIE, FAULT, HANG, SLOW, STALL  # noqa: E402
from tests.test_serve_api import IDS, _health, _ids, _metric, _wait_idle  # noqa: E402
from tests.test_serve_cli import Served, gone  # noqa: E402

MAX_RUNNING, CONTEXT = 16, 256
SPEC = EngineSpec(
    "tiny",
    "cpu",
    "float32",
    "graph",
    MAX_RUNNING,
    CONTEXT,
    warmup=False,
    setup="tests.serve_hooks:arm",
)


def _serve(worker):
    worker.start(timeout=120)
    app = build_app(worker, worker.limits("tiny", False, False), None, 64, stop_timeout=20)
    return app, ServerThread(app)


@pytest.fixture(scope="module")
def server():
    worker = ProcessWorker(SPEC, ServeMetrics())
    try:
        with pytest.MonkeyPatch.context() as mp:  # pipes of one page: a full pipe every test
            mp.setattr(engine_proc, "PIPE_BYTES", 4096)
            app, thread = _serve(worker)
            with thread as url:
                client = openai.OpenAI(
                    base_url=url + "/v1", api_key="none", max_retries=0, timeout=30
                )
                yield SimpleNamespace(url=url, worker=worker, app=app, client=client)
    finally:
        worker.stop(30)
    assert not worker._child.proc.is_alive()  # stopped with the server: no orphan


@pytest.fixture(autouse=True)
def every_page_free_after(server):
    yield
    h = _wait_idle(server.url)
    assert h["running"] == h["waiting"] == 0 and h["status"] == "ok", h
    assert h["kv_pages_free"] == h["kv_pages_total"] > 0, h


def _prompts(seed: int, n: int, lo: int = 3, hi: int = 30) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 500) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _generate(capsys, prompts: list[list[int]], n: int) -> list[list[int]]:
    """`stepgraph generate`, greedy, eos ignored: the reference outputs."""
    ids = ";".join(",".join(map(str, p)) for p in prompts)
    argv = [
        "generate",
        "--model",
        "tiny",
        "--device",
        "cpu",
        "--max-new-tokens",
        str(n),
        "--ignore-eos",
        "--json",
        "--prompt-ids",
        ids,
    ]
    assert cli_main(argv) == 0
    return json.loads(capsys.readouterr().out)["outputs"]


def _finished(url: str, reason: str) -> float:
    return _metric(url, f'stepgraph_requests_finished_total{{reason="{reason}"}}')


def test_greedy_tokens_equal_stepgraph_generate_plain_and_streamed(server, capsys):
    prompts, n = _prompts(21, 3), 20
    want = _generate(capsys, prompts, n)
    for p, w in zip(prompts, want):
        kw = dict(model="tiny", prompt=p, max_tokens=n, temperature=0, extra_body=IDS)
        r = server.client.completions.create(**kw)
        assert _ids(r.choices[0]) == w and r.choices[0].finish_reason == "length"
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(p), n)
        chunks = list(server.client.completions.create(**kw, stream=True))
        assert [t for c in chunks for t in _ids(c.choices[0])] == w
        assert chunks[-1].choices[0].finish_reason == "length"
    assert _health(server.url)["engine_pid"] not in (None, os.getpid())
    text = httpx.get(server.url + "/metrics").text  # kept by the front end from the messages
    for name in (
        "stepgraph_requests_running",
        "stepgraph_requests_waiting",
        "stepgraph_kv_pages_free",
        "stepgraph_generation_tokens_per_second",
        "stepgraph_time_to_first_token_seconds_bucket",
        "stepgraph_time_per_output_token_seconds_bucket",
    ):
        assert name in text, name
    assert _metric(server.url, "stepgraph_time_to_first_token_seconds_count") >= 6
    assert _metric(server.url, "stepgraph_generation_tokens_total") >= 6 * n
    assert _metric(server.url, 'stepgraph_engine_steps{kind="graph"}') >= n
    assert _metric(server.url, "stepgraph_kv_pages_total") == server.worker.kv_pages_total > 0


def test_bad_requests_are_400s_with_nothing_sent_and_past_max_waiting_a_503(server):
    sent = server.worker.sent
    for body, field in [
        ({"model": "tiny", "prompt": [1, 512]}, "prompt"),
        ({"model": "tiny", "prompt": [1], "max_tokens": -1}, "max_tokens"),
    ]:
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == field
    assert server.worker.sent == sent  # nothing reached the engine
    handlers = server.app.state.handlers

    async def crowd():
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as c:
            body = {
                "model": "tiny",
                "prompt": [SLOW, 1],
                "max_tokens": 4,
                "stream": True,
                "ignore_eos": True,
            }
            async with c.stream("POST", "/v1/completions", json=body) as slow:
                lines = slow.aiter_lines()
                while not (await lines.__anext__()).startswith("data: "):
                    pass  # it runs: the engine is inside a 0.5 s step, not reading its pipe
                two = [
                    asyncio.ensure_future(
                        c.post(
                            "/v1/completions",
                            json={"model": "tiny", "prompt": [2, i], "max_tokens": 2},
                        )
                    )
                    for i in (3, 4)
                ]
                await asyncio.sleep(0.05)  # both handed over: waiting in the pipe
                third = await c.post("/v1/completions", json={"model": "tiny", "prompt": [7]})
                async for _ in lines:
                    pass
            return third, [await t for t in two]

    handlers.max_waiting = 2
    try:
        third, two = asyncio.run(crowd())
    finally:
        handlers.max_waiting = 64
    assert third.status_code == 503 and third.headers["Retry-After"] == "1"
    assert third.json()["error"]["code"] == "server_overloaded"
    assert [r.status_code for r in two] == [200, 200]


def test_concurrent_streams_while_some_clients_leave(server, capsys):
    rng = random.Random(22)
    prompts = _prompts(22, 20, lo=60, hi=150)  # 20 submissions: ~10 pages through the pipe
    quits = {i: rng.randint(1, 6) for i in rng.sample(range(20), 5)}  # tokens read, then gone
    lens = [CONTEXT - len(p) if i in quits else rng.randint(4, 60) for i, p in enumerate(prompts)]
    want = _generate(capsys, prompts, 60)
    aborts, lengths = _finished(server.url, "abort"), _finished(server.url, "length")

    async def one(client, i):
        stream = await client.completions.create(
            model="tiny",
            prompt=prompts[i],
            max_tokens=lens[i],
            temperature=0,
            stream=True,
            extra_body=IDS,
        )
        ids = []
        async for chunk in stream:
            ids += _ids(chunk.choices[0])
            if i in quits and len(ids) >= quits[i]:
                await stream.close()
                break
        return ids

    async def run_all():
        async with openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=30
        ) as c:
            return await asyncio.gather(*(one(c, i) for i in range(20)))

    got = asyncio.run(run_all())
    for i in range(20):
        if i in quits:
            assert got[i] == want[i][: len(got[i])] and len(got[i]) >= quits[i]
        else:
            assert got[i] == want[i][: lens[i]], i
    _wait_idle(server.url)
    assert _finished(server.url, "abort") - aborts == 5
    assert _finished(server.url, "length") - lengths == 15


def test_a_full_pipe_holds_the_requests_back_in_order(server, capsys, monkeypatch):
    """40 submissions while the engine sleeps in a step: the page-sized pipe fills, the rest
    waits on the event loop (``add_writer``), and every request is answered as generate's."""
    pending = []
    flush = engine_proc.EngineProcess._flush

    def counted(self):
        flush(self)
        pending.append(len(self._out))

    monkeypatch.setattr(engine_proc.EngineProcess, "_flush", counted)
    prompts = _prompts(27, 40, lo=100, hi=120)
    want = _generate(capsys, prompts, 4)

    async def run_all():
        async with openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=30
        ) as c:
            slow = await c.completions.create(
                model="tiny", prompt=[STALL, 1], max_tokens=200, temperature=0, stream=True
            )
            await slow.__anext__()  # it runs: every step sleeps now
            outs = await asyncio.gather(
                *(
                    c.completions.create(
                        model="tiny", prompt=p, max_tokens=4, temperature=0, extra_body=IDS
                    )
                    for p in prompts
                )
            )
            await slow.close()
            return [_ids(r.choices[0]) for r in outs]

    assert asyncio.run(run_all()) == want
    assert max(pending) > 0  # some bytes waited for room in the pipe


def _leave_at_once(port: int, prompt: list[int], max_tokens: int, wait_headers: bool) -> None:
    """A streamed request whose client resets the connection before reading a token."""
    body = json.dumps(
        {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
        }
    ).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
        f"application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = reset
    s.sendall(head + body)
    if wait_headers:  # the response began; no token yet (the engine is slowed)
        assert s.recv(12).startswith(b"HTTP/1.1 200")
    s.close()


def _check_leavers_aborted(url: str, worker, spent_before: float) -> None:
    port = int(url.rsplit(":", 1)[1])
    aborts = _finished(url, "abort")
    for k in range(6):  # 50 ms a step while they run: 200 tokens would take 10 s
        _leave_at_once(port, [STALL, 1 + k, 2], 200, wait_headers=k % 2 == 1)
    deadline = time.monotonic() + 8
    while _finished(url, "abort") - aborts < 6 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _finished(url, "abort") - aborts == 6
    h = _wait_idle(url)
    assert h["running"] == 0 and h["kv_pages_free"] == h["kv_pages_total"], h
    assert _metric(url, "stepgraph_generation_tokens_total") - spent_before < 6 * 40


def test_clients_that_leave_before_their_first_byte_are_aborted(server):
    _check_leavers_aborted(
        server.url, server.worker, _metric(server.url, "stepgraph_generation_tokens_total")
    )


def test_clients_that_leave_before_their_first_byte_are_aborted_engine_thread():
    worker = EngineWorker(SPEC, ServeMetrics())  # the same engine, on a thread
    try:
        app, thread = _serve(worker)
        with thread as url:
            _check_leavers_aborted(url, worker, 0.0)
    finally:
        worker.stop(30)
    kv = worker.engine.model_runner.kv_cache
    assert kv.allocator.num_free == kv.num_pages - 1


async def _all_fail(url: str, running: list[list[int]], bad: list[int], n: int) -> list:
    """The errors of ``running`` (slowed requests, half of them streamed) and of ``bad``, sent
    once they run."""

    async def one(c, p, stream):
        try:
            if not stream:
                await c.completions.create(model="tiny", prompt=p, max_tokens=n, temperature=0)
                return None
            async for _ in await c.completions.create(
                model="tiny", prompt=p, max_tokens=n, temperature=0, stream=True
            ):
                pass
        except openai.APIError as e:
            return e
        return None

    async with openai.AsyncOpenAI(
        base_url=url + "/v1", api_key="x", max_retries=0, timeout=30
    ) as c:
        first = [asyncio.ensure_future(one(c, p, i % 2 == 1)) for i, p in enumerate(running)]
        await asyncio.sleep(0.3)  # they run (slowed: STALL), then the bad one joins them
        last = await one(c, bad, False)
        return [*(await asyncio.gather(*first)), last]


def test_an_engine_fault_fails_what_is_in_flight_and_the_next_is_served(server, capsys):
    pid = _health(server.url)["engine_pid"]
    running = [[STALL, *p] for p in _prompts(23, 3)]
    errors = asyncio.run(_all_fail(server.url, running, [FAULT, 5, 6], 200))
    for e in errors:
        assert e is not None and e.body["code"] == "engine_fault", e
        assert "injected decode fault" in e.body["message"]
    assert errors[0].status_code == 500 and errors[-1].status_code == 500
    (p,) = _prompts(24, 1)
    r = server.client.completions.create(
        model="tiny", prompt=p, max_tokens=10, temperature=0, extra_body=IDS
    )
    assert _ids(r.choices[0]) == _generate(capsys, [p], 10)[0]
    assert _health(server.url)["engine_pid"] == pid  # the same process carried on


def test_a_dead_engine_process_fails_what_is_in_flight_and_is_started_again(server, capsys):
    pid = _health(server.url)["engine_pid"]
    running = [[STALL, *p] for p in _prompts(25, 3)]
    errors = asyncio.run(_all_fail(server.url, running, [DIE, 5, 6], 200))
    for e in errors:
        assert e is not None and e.body["code"] == "engine_fault", e
        assert "exited (status 3)" in e.body["message"]
    r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": [1]})
    assert r.status_code == 503 and "restarting" in r.json()["error"]["message"]
    assert r.headers["Retry-After"] == "1" and _health(server.url)["status"] == "unavailable"
    h = _health(server.url)  # the new process's counts, not the old one's requests taken
    assert h["waiting"] == h["running"] == 0, h
    deadline = time.monotonic() + 90
    while _health(server.url)["status"] != "ok" and time.monotonic() < deadline:
        time.sleep(0.1)
    h = _health(server.url)
    assert h["status"] == "ok" and h["engine_pid"] not in (pid, None), h
    (p,) = _prompts(26, 1)
    r = server.client.completions.create(
        model="tiny", prompt=p, max_tokens=10, temperature=0, extra_body=IDS
    )
    assert _ids(r.choices[0]) == _generate(capsys, [p], 10)[0]
    assert server.worker.restarts == 1


def test_a_hung_engine_process_never_hangs_the_front_end():
    worker = ProcessWorker(SPEC, ServeMetrics())
    app, thread = _serve(worker)
    try:
        with thread as url:
            pid = _health(url)["engine_pid"]

            async def hung():
                async with httpx.AsyncClient(base_url=url, timeout=30) as c:
                    body = {"model": "tiny", "prompt": [HANG, 1], "max_tokens": 5}
                    sent = asyncio.ensure_future(c.post("/v1/completions", json=body))
                    await asyncio.sleep(0.5)  # the engine sleeps in a step now
                    t = time.perf_counter()
                    bad = await c.post("/v1/completions", json={"model": "tiny", "prompt": []})
                    health = await c.get("/health")
                    assert time.perf_counter() - t < 2 and bad.status_code == 400
                    assert health.json()["running"] == 1
                    await asyncio.get_running_loop().run_in_executor(None, worker.stop, 1.0)
                    return await sent

            r = asyncio.run(hung())  # stopped: the engine did not answer, so it was ended
            assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
            assert gone(pid)
    finally:
        worker.stop(5)


def test_the_engine_process_leaves_when_the_front_end_is_killed():
    with Served("--max-context", "256") as s:
        child = httpx.get(s.url + "/health", timeout=5).json()["engine_pid"]
        assert child and not gone(child)
        s.proc.send_signal(signal.SIGKILL)
        s.proc.wait(10)
        deadline = time.monotonic() + 20
        while not gone(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gone(child)
