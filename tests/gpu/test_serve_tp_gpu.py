"""`stepgraph serve --tp 2` on two GPUs over NCCL (``TPWorker``: torchrun starts the ranks): the
tiny preset in float32, graph mode, greedy tokens of concurrent requests equal the unsharded
server's (TP=1, the engine process); rank 1 killed mid-request fails it with a 500 (rank 0 sits
in an NCCL collective its peer will never join: torchrun must end it), /health says 503 while
the group starts again, then the same tokens are served. Skipped with fewer than 2 GPUs."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest
import torch

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
httpx = pytest.importorskip("httpx")

from stepgraph.serve.app import build_app  # noqa: E402
from stepgraph.serve.engine_proc import EngineSpec  # noqa: E402
from stepgraph.serve.metrics import ServeMetrics  # noqa: E402
from stepgraph.serve.proc_worker import ProcessWorker  # noqa: E402
from stepgraph.serve.server import ServerThread  # noqa: E402
from stepgraph.serve.tp import TPWorker  # noqa: E402

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL, TP=2)"),
]

MAX_RUNNING, CONTEXT, NEW = 16, 256, 32
PROMPTS = [[5, 6, 7, 8], [9, 10], list(range(11, 140)), [41, 3], list(range(200, 230))]
STALL = 508  # tests/serve_hooks.py: each step of a request starting with it sleeps 50 ms


def _spec(tp: int) -> EngineSpec:
    return EngineSpec(
        "tiny",
        "cuda",
        "float32",
        "graph",
        MAX_RUNNING,
        CONTEXT,
        warmup=False,
        setup="tests.serve_hooks:arm",
        tp=tp,
    )


def _tokens(url: str) -> list[list[int]]:
    async def one(c, p):
        body = {
            "model": "tiny",
            "prompt": p,
            "max_tokens": NEW,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        r = await c.post(url + "/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]

    async def all_at_once():
        async with httpx.AsyncClient(timeout=120) as c:
            return await asyncio.gather(*(one(c, p) for p in PROMPTS))

    return asyncio.run(all_at_once())


def _served(worker):
    worker.start(timeout=300)
    app = build_app(worker, worker.limits("tiny", False, False), None, 64, stop_timeout=20)
    return ServerThread(app)


@pytest.fixture(scope="module")
def tp1() -> list[list[int]]:
    worker = ProcessWorker(_spec(1))
    try:
        with _served(worker) as url:
            return _tokens(url)
    finally:
        worker.stop(60)


@pytest.fixture(scope="module")
def tp2():
    worker = TPWorker(_spec(2), ServeMetrics())
    try:
        with _served(worker) as url:
            yield worker, url
    finally:
        worker.stop(60)


def test_tp2_over_nccl_serves_tp1s_tokens(tp1, tp2):
    worker, url = tp2
    assert len(worker.rank_pids) == 2
    assert [len(t) for t in tp1] == [NEW] * len(PROMPTS)
    assert _tokens(url) == tp1  # float32: identical


def test_a_killed_rank_fails_its_request_and_the_group_serves_again(tp1, tp2):
    worker, url = tp2
    old, answer = worker.rank_pids, {}

    def slow():
        body = {"model": "tiny", "prompt": [STALL, 3], "max_tokens": 200, "temperature": 0}
        answer["r"] = httpx.post(url + "/v1/completions", json=body, timeout=120)

    t = threading.Thread(target=slow)
    t.start()
    deadline = time.monotonic() + 30
    while httpx.get(url + "/health").json()["running"] == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    os.kill(old[1], signal.SIGKILL)
    t.join(120)
    assert answer["r"].status_code == 500, answer["r"].text
    seen, deadline = [], time.monotonic() + 300
    while time.monotonic() < deadline:
        seen.append(httpx.get(url + "/health", timeout=10).status_code)
        if seen[-1] == 200:
            break
        time.sleep(0.2)
    assert seen[0] == 503 and seen[-1] == 200, seen
    assert set(worker.rank_pids).isdisjoint(old)
    assert _tokens(url) == tp1
