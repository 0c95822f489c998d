"""`stepgraph serve --tp 2` on the CPU: two tensor-parallel ranks of ``tiny`` over gloo, started
through torchrun, behind the server (127.0.0.1, a free port): float32 tokens equal the unsharded
server's (completions, concurrent and streamed); rank 1 killed mid-request fails what is in
flight with a 500, /health says 503 while the group starts again, then requests are served
with the same tokens; SIGTERM to the `stepgraph serve` process leaves none of its processes
(torchrun, the ranks) behind; flags that cannot go with --tp are one-line errors."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from stepgraph.cli import main as cli_main  # noqa: E402
from stepgraph.serve.app import build_app  # noqa: E402
from stepgraph.serve.engine_proc import EngineSpec  # noqa: E402
from stepgraph.serve.metrics import ServeMetrics  # noqa: E402
from stepgraph.serve.server import ServerThread  # noqa: E402
from stepgraph.serve.tp import TPWorker, descendants  # noqa: E402
from stepgraph.serve.worker import EngineWorker  # noqa: E402
from tests.serve_hooks import STALL  # noqa: E402
from tests.test_serve_api import IDS, _health, _ids, _prompts, _wait_idle  # noqa: E402
from tests.test_serve_cli import Served, gone  # noqa: E402

MAX_RUNNING, CONTEXT, NEW = 4, 128, 12
SPEC = dict(warmup=False, setup="tests.serve_hooks:arm")
PROMPTS = _prompts(5, 3, hi=30)


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)


def _complete(url: str, prompt: list[int], n: int = NEW) -> list[int]:
    r = _client(url).completions.create(
        model="tiny", prompt=prompt, max_tokens=n, temperature=0, extra_body=IDS
    )
    return _ids(r.choices[0])


def _served_tokens(url: str) -> dict:
    """The prompts at once (concurrent completions), then the first one streamed."""

    async def all_at_once():
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0) as c:
            rs = await asyncio.gather(
                *(
                    c.completions.create(
                        model="tiny", prompt=p, max_tokens=NEW, temperature=0, extra_body=IDS
                    )
                    for p in PROMPTS
                )
            )
            return [_ids(r.choices[0]) for r in rs]

    chunks = _client(url).completions.create(
        model="tiny", prompt=PROMPTS[0], max_tokens=NEW, temperature=0, stream=True, extra_body=IDS
    )
    streamed = [t for c in chunks if c.choices for t in _ids(c.choices[0])]
    return {"completions": asyncio.run(all_at_once()), "streamed": streamed}


def _serve(worker):
    worker.start(timeout=120)
    app = build_app(worker, worker.limits("tiny", False, False), None, 64, stop_timeout=20)
    return ServerThread(app)


@pytest.fixture(scope="module")
def unsharded() -> dict:
    worker = EngineWorker(EngineSpec("tiny", "cpu", "float32", "graph", MAX_RUNNING, CONTEXT))
    try:
        with _serve(worker) as url:
            return _served_tokens(url)
    finally:
        worker.stop(30)


@pytest.fixture(scope="module")
def tp2():
    spec = EngineSpec("tiny", "cpu", "float32", "graph", MAX_RUNNING, CONTEXT, tp=2, **SPEC)
    worker = TPWorker(spec, ServeMetrics())
    try:
        with _serve(worker) as url:
            yield worker, url
    finally:
        worker.stop(30)
        launcher = worker.launcher_pid
    assert gone(launcher) and all(gone(p) for p in worker.rank_pids)  # stopped: no orphan


def test_two_ranks_serve_the_unsharded_servers_tokens(tp2, unsharded):
    worker, url = tp2
    assert len(set(worker.rank_pids)) == 2 and worker.pid == worker.rank_pids[0]
    got = _served_tokens(url)
    assert got == unsharded  # float32: the sharded model's tokens, bit for bit
    assert (
        all(len(t) == NEW for t in got["completions"]) and got["streamed"] == got["completions"][0]
    )
    h = _wait_idle(url)
    assert h["kv_pages_free"] == h["kv_pages_total"]


def test_a_killed_rank_fails_what_is_in_flight_and_the_group_starts_again(tp2, unsharded):
    worker, url = tp2
    old = worker.rank_pids
    answer: dict = {}

    def slow_request():  # STALL: each of its steps sleeps 50 ms on every rank
        body = {"model": "tiny", "prompt": [STALL, 3, 4], "max_tokens": 100, "temperature": 0}
        answer["r"] = httpx.post(url + "/v1/completions", json=body, timeout=60)

    t = threading.Thread(target=slow_request)
    t.start()
    deadline = time.monotonic() + 20
    while _health(url)["running"] == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    os.kill(old[1], signal.SIGKILL)
    t.join(30)
    r = answer["r"]
    assert r.status_code == 500, r.text
    assert "exited" in r.json()["error"]["message"]
    seen = []
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        code = httpx.get(url + "/health", timeout=10).status_code
        seen.append(code)
        if code == 200:
            break
        time.sleep(0.1)
    assert seen[0] == 503 and seen[-1] == 200, seen  # 503 while the ranks start again
    assert worker.restarts == 1 and set(worker.rank_pids).isdisjoint(old)
    assert all(gone(p) for p in old)  # the whole group was restarted
    assert _complete(url, PROMPTS[1]) == unsharded["completions"][1]


def test_sigterm_leaves_no_process_behind():
    with Served("--tp", "2", "--shutdown-timeout", "5", session=True) as s:
        health = httpx.get(s.url + "/health", timeout=10).json()
        kids = descendants(s.proc.pid)  # torchrun and its two ranks
        assert health["engine_pid"] in kids and len(kids) >= 3, kids
        assert _complete(s.url, PROMPTS[2], 4)
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(60) == 0
    deadline = time.monotonic() + 10
    while not all(gone(p) for p in kids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [p for p in kids if not gone(p)] == []


@pytest.mark.parametrize(
    "argv, said",
    [
        (["--tp", "2", "--engine", "thread"], "--engine"),
        (["--tp", "2", "--quantization", "fp8"], "--quantization"),
        (["--tp", "0"], "--tp"),
    ],
)
def test_flags_that_cannot_go_with_tp_are_one_line_errors(argv, said, capsys):
    assert cli_main(["serve", "--model", "tiny", "--device", "cpu", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("stepgraph: error:") and "\n" not in err and said in err, err


def test_tp_under_torchrun_is_refused(monkeypatch, capsys):
    for k, v in dict(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="x").items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("MASTER_PORT", "1")
    assert cli_main(["serve", "--model", "tiny", "--device", "cpu", "--tp", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "not under torchrun" in err and "\n" not in err, err
