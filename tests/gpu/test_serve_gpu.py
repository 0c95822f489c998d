"""`stepgraph serve` on the GPU (tiny preset, float32, graph mode, the overlapped loop with its
pinned copies and events): concurrent streams equal a fresh engine's tokens, clients that leave
mid-stream are aborted and every KV page comes back, an engine fault fails what is in flight
(500) and the next request is served. Speaks the API with httpx (the openai client is tested
on the CPU); skips without the serve extra."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time

import pytest
import torch

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
httpx = pytest.importorskip("httpx")

from stepgraph.engine import Engine  # noqa: E402
from stepgraph.model import ModelRunner  # noqa: E402
from stepgraph.serve.app import build_app  # noqa: E402
from stepgraph.serve.metrics import ServeMetrics  # noqa: E402
from stepgraph.serve.server import ServerThread  # noqa: E402
from stepgraph.serve.worker import EngineWorker, engine_limits  # noqa: E402

MAX_RUNNING, CONTEXT, VOCAB = 16, 256, 512


def _runner() -> ModelRunner:
    return ModelRunner.from_preset(
        "tiny", "cuda", torch.float32, 0, max_bs=MAX_RUNNING, max_context_len=CONTEXT
    )


async def _stream(client, url, prompt, n, leave_after=None) -> list[int]:
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": n,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": True,
    }
    ids: list[int] = []
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return chunk
            ids += chunk["choices"][0]["token_ids"]
            if leave_after is not None and len(ids) >= leave_after:
                break  # leaving the block closes the connection
    return ids


def _wait_idle(worker, timeout=20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (
            not worker.running
            and not worker.waiting
            and (worker.kv_pages_free == worker.kv_pages_total)
        ):
            return
        time.sleep(0.02)


def test_serve_on_cuda_streams_aborts_and_survives_a_fault():
    worker = EngineWorker(
        lambda: Engine(_runner(), "graph", max_running=MAX_RUNNING), ServeMetrics()
    )
    rng = random.Random(5)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(3, 60))] for _ in range(12)]
    lens = [rng.randint(8, 64) for _ in prompts]
    leave = {1: 3, 6: 5, 9: 2}  # request -> tokens read before leaving
    for i in leave:
        lens[i] = CONTEXT - len(prompts[i]) + 1
    try:
        worker.start(timeout=300)
        app = build_app(worker, engine_limits(worker.engine, "tiny", False, False))
        with ServerThread(app) as url:

            async def run_all():
                limits = httpx.Limits(max_connections=32)
                async with httpx.AsyncClient(timeout=120, limits=limits) as c:
                    return await asyncio.gather(
                        *(
                            _stream(c, url, p, n, leave.get(i))
                            for i, (p, n) in enumerate(zip(prompts, lens))
                        )
                    )

            got = asyncio.run(run_all())
            _wait_idle(worker)
            assert worker.kv_pages_free == worker.kv_pages_total  # the aborted ones' too
            assert worker.metrics.finished.labels("abort")._value.get() == len(leave)

            engine = worker.engine
            real, armed = engine.decoder.logits, threading.Event()

            def faulty(*a, **k):
                if armed.is_set():
                    raise RuntimeError("injected decode fault")
                return real(*a, **k)

            engine.decoder.logits = faulty
            armed.set()
            try:
                body = {"model": "tiny", "prompt": prompts[0], "max_tokens": 16}
                r = httpx.post(url + "/v1/completions", json=body, timeout=60)
            finally:
                armed.clear()
                del engine.decoder.logits
            assert r.status_code == 500 and r.json()["error"]["code"] == "engine_fault"
            again = asyncio.run(run_one(url, prompts[2], lens[2]))
            _wait_idle(worker)
            assert worker.kv_pages_free == worker.kv_pages_total
    finally:
        worker.stop(60)

    ref = Engine(_runner(), "graph", max_running=MAX_RUNNING)
    try:
        stay = [i for i in range(len(prompts)) if i not in leave]
        want = ref.generate([prompts[i] for i in stay], max(lens[i] for i in stay), ignore_eos=True)
        for i, w in zip(stay, want):
            assert got[i] == w[: lens[i]], i
        most = max(len(got[i]) for i in leave)
        short = ref.generate([prompts[i] for i in leave], most, ignore_eos=True)
        for i, w in zip(leave, short):
            assert leave[i] <= len(got[i]) < lens[i] and got[i] == w[: len(got[i])]
    finally:
        ref.shutdown()
    assert again == got[2]


async def run_one(url, prompt, n):
    async with httpx.AsyncClient(timeout=120) as c:
        return await _stream(c, url, prompt, n)


def test_serve_on_cuda_with_the_engine_in_its_own_process():
    """The default ``--engine process`` on CUDA: streams equal a fresh engine's tokens, leavers
    are aborted, a fault is a 500 and a dead engine process is started again (CUDA in the
    spawned process only)."""
    from stepgraph.serve.engine_proc import EngineSpec
    from stepgraph.serve.proc_worker import ProcessWorker
    from tests.serve_hooks import DIE, FAULT

    spec = EngineSpec(
        "tiny",
        "cuda",
        "float32",
        "graph",
        MAX_RUNNING,
        CONTEXT,
        warmup=False,
        setup="tests.serve_hooks:arm",
    )
    worker = ProcessWorker(spec, ServeMetrics())
    rng = random.Random(6)
    prompts = [[rng.randrange(1, 500) for _ in range(rng.randint(3, 60))] for _ in range(12)]
    lens = [rng.randint(8, 64) for _ in prompts]
    leave = {2: 3, 7: 4}
    for i in leave:
        lens[i] = CONTEXT - len(prompts[i]) + 1
    try:
        worker.start(timeout=300)
        app = build_app(worker, worker.limits("tiny", False, False))
        with ServerThread(app) as url:

            async def run_all():
                async with httpx.AsyncClient(timeout=120) as c:
                    return await asyncio.gather(
                        *(
                            _stream(c, url, p, n, leave.get(i))
                            for i, (p, n) in enumerate(zip(prompts, lens))
                        )
                    )

            got = asyncio.run(run_all())
            _wait_idle(worker)
            assert worker.kv_pages_free == worker.kv_pages_total
            for bad, code in ((FAULT, 500), (DIE, 500)):
                body = {"model": "tiny", "prompt": [bad, 1, 2], "max_tokens": 8}
                r = httpx.post(url + "/v1/completions", json=body, timeout=60)
                assert r.status_code == code and r.json()["error"]["code"] == "engine_fault"
            deadline = time.monotonic() + 300
            while httpx.get(url + "/health").status_code != 200:
                assert time.monotonic() < deadline, "the engine process was not started again"
                time.sleep(0.2)
            again = asyncio.run(run_one(url, prompts[0], lens[0]))
    finally:
        worker.stop(60)
    ref = Engine(_runner(), "graph", max_running=MAX_RUNNING)
    try:
        stay = [i for i in range(len(prompts)) if i not in leave]
        want = ref.generate([prompts[i] for i in stay], max(lens[i] for i in stay), ignore_eos=True)
        for i, w in zip(stay, want):
            assert got[i] == w[: lens[i]], i
    finally:
        ref.shutdown()
    assert again == got[0] and worker.restarts == 1
