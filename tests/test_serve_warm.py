"""`stepgraph serve` warms every prompt-length class before it says ready, on both transports:
the engine's build runs ``warm_up`` (``engine/warm.py``), so ``/health`` is ok only after it;
the warm-up's requests are counted apart (``EngineStats.warm_requests``), not as served
traffic, and leave nothing cached. A setup hook that runs between the build and ready refuses
an engine that was not warmed (so a build without the warm-up never says ready)."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
httpx = pytest.importorskip("httpx")

from stepgraph.engine.warm import warm_lengths, warm_room  # noqa: E402
from stepgraph.serve.app import build_app  # noqa: E402
from stepgraph.serve.engine_proc import EngineSpec  # noqa: E402
from stepgraph.serve.metrics import ServeMetrics  # noqa: E402
from stepgraph.serve.proc_worker import ProcessWorker  # noqa: E402
from stepgraph.serve.server import ServerThread  # noqa: E402
from stepgraph.serve.worker import EngineWorker  # noqa: E402

SPEC = EngineSpec("tiny", "cpu", "float32", "graph", 4, 128, setup="tests.serve_hooks:require_warm")
WORKERS = {"thread": EngineWorker, "process": ProcessWorker}


@pytest.mark.parametrize("transport", sorted(WORKERS))
def test_serve_is_ready_only_after_the_warm_up(transport, capsys):
    worker = WORKERS[transport](SPEC, ServeMetrics())
    try:
        worker.start(timeout=120)  # the hook raised (FAILED) unless the warm-up ran first
        app = build_app(worker, worker.limits("tiny", False, False), None, 64, stop_timeout=20)
        with ServerThread(app) as url:
            assert httpx.get(url + "/health", timeout=10).json()["status"] == "ok"
            body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2}
            r = httpx.post(url + "/v1/completions", json=body, timeout=30)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        if transport == "thread":  # the engine is in this process: read its counts
            stats = worker.engine.stats
            assert stats.warm_requests > 0 and stats.prefill_steps == 1
    finally:
        worker.stop(30)
    if transport == "thread":  # the process's build speaks on its own stderr
        err = capsys.readouterr().err
        assert "warming up every prompt-length class" in err and ": done in " in err


def test_a_build_without_the_warm_up_is_refused_by_the_hook():
    worker = EngineWorker(dataclasses.replace(SPEC, warmup=False))
    with pytest.raises(RuntimeError, match="not warmed up"):
        worker.start(timeout=120)
    worker.stop(5)


def test_the_warm_up_fits_the_model_positions_below_the_context():
    """The serve default context (4096) is past the tiny preset's 2048 positions: the longest
    warm-up prompt still fits the positions (with its new tokens), not the context."""
    engine = EngineSpec("tiny", "cpu", "float32", "eager", 2, 4096)()
    try:
        assert engine.stats.warm_requests > 0
        room = warm_room(engine)
        assert room == 2048 - 3 - 1
        assert max(warm_lengths(room, engine.max_prefill_tokens)) <= room
    finally:
        engine.shutdown()
