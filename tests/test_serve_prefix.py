"""`stepgraph serve` with prefix caching (the tiny preset on the CPU, the thread transport over
HTTP; the engine loop that both transports run, directly): ``usage.prompt_tokens_details.
cached_tokens`` in completions and chat, plain and in the final stream usage chunk; a
``cache_salt`` that is not a string is a 400 naming it, and another salt never hits; /metrics
counts prefix cache queries and hits; ``--no-prefix-caching`` reaches the engine."""

from __future__ import annotations

import dataclasses
import json
import re
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
httpx = pytest.importorskip("httpx")

from stepgraph.engine import Engine  # noqa: E402
from stepgraph.model import ModelRunner  # noqa: E402
from stepgraph.serve.app import build_app  # noqa: E402
from stepgraph.serve.loop import STEP, STOP, SUBMIT, EngineLoop, submit_fields  # noqa: E402
from stepgraph.serve.metrics import ServeMetrics  # noqa: E402
from stepgraph.serve.server import ServerThread  # noqa: E402
from stepgraph.serve.worker import EngineWorker, engine_limits  # noqa: E402

PROMPT = [(7 * i) % 500 + 1 for i in range(40)]  # 40 tokens: two full pages can be cached


def _runner() -> ModelRunner:
    return ModelRunner.from_preset("tiny", "cpu", torch.float32, 0, max_bs=4, max_context_len=96)


@pytest.fixture(scope="module")
def server():
    worker = EngineWorker(lambda: Engine(_runner(), "eager"), ServeMetrics())
    try:
        worker.start(timeout=120)
        app = build_app(worker, engine_limits(worker.engine, "tiny", False, False), None, 64)
        with ServerThread(app) as url:
            yield SimpleNamespace(url=url, worker=worker)
    finally:
        worker.stop(30)


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=30)


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def _body(salt=None, **kw) -> dict:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 3, "temperature": 0, **kw}
    if salt is not None:
        body["cache_salt"] = salt
    return body


def _cached(r: httpx.Response) -> int:
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_completions_report_cached_tokens_and_metrics_count_them(server):
    url = server.url
    q0 = _metric(url, "stepgraph_prefix_cache_queries_total")
    h0 = _metric(url, "stepgraph_prefix_cache_hits_total")
    first = _post(url, "/v1/completions", _body("metrics"))
    assert _cached(first) == 0  # a new salt: nothing cached yet
    again = _post(url, "/v1/completions", _body("metrics"))
    assert _cached(again) == 32  # two full pages; the last token is recomputed
    assert again.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
    assert again.json()["usage"]["prompt_tokens"] == 40
    assert _metric(url, "stepgraph_prefix_cache_queries_total") - q0 == 80
    assert _metric(url, "stepgraph_prefix_cache_hits_total") - h0 == 32


def test_the_final_stream_usage_chunk_and_chat_report_cached_tokens(server):
    url = server.url
    _post(url, "/v1/completions", _body("stream"))
    with httpx.stream(
        "POST",
        url + "/v1/completions",
        json=_body("stream", stream=True, stream_options={"include_usage": True}),
        timeout=30,
    ) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    usage = json.loads(events[-2])["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 32}
    assert all("usage" not in json.loads(e) for e in events[:-2])


def test_another_salt_never_hits_and_a_bad_salt_is_a_400(server):
    url = server.url
    _post(url, "/v1/completions", _body("tenant-a"))
    assert _cached(_post(url, "/v1/completions", _body("tenant-b"))) == 0
    assert _cached(_post(url, "/v1/completions", _body("tenant-a"))) == 32
    for bad in (7, ["a"], {"s": 1}, True):
        r = _post(url, "/v1/completions", _body(bad))
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "cache_salt" and "string" in err["message"]


def test_the_engine_loop_sends_cached_tokens_with_the_first_tokens_and_counts_them():
    """The loop both transports run: a request's first item carries its cached tokens, later
    items None; the state ends with the engine's prefix cache queries and hits."""

    def fields(max_tokens: int):
        p = SimpleNamespace(
            prompt_ids=PROMPT,
            max_tokens=max_tokens,
            stop_ids=None,
            ignore_eos=True,
            min_tokens=0,
            seed=None,
            temperature=0.0,
            top_k=None,
            cache_salt=None,
        )
        return submit_fields(p)

    engine = Engine(_runner(), "eager")
    engine.generate([PROMPT], 2)  # caches the prompt's two full pages

    class Box:
        def __init__(self, *cmds):
            self.cmds, self.msgs = list(cmds), []

        def recv(self):
            return self.cmds.pop(0) if self.cmds else (STOP,)

        def poll(self):
            return bool(self.cmds)

        def send(self, msg):
            self.msgs.append(msg)

    box = Box((SUBMIT, 5, fields(4)))
    EngineLoop(engine, box, box).run()
    items = [it for m in box.msgs if m[0] == STEP for it in m[1]]
    assert [it[3] for it in items] == [32, None, None, None]
    *_, queries, hits = box.msgs[-1][2]
    assert (queries, hits) == (80, 32)  # generate's request, then the loop's


def test_no_prefix_caching_reaches_the_engine_spec():
    import argparse

    from stepgraph.serve.cli import add_arguments, engine_spec

    p = argparse.ArgumentParser()
    add_arguments(p)
    on = p.parse_args(["--model", "tiny"])
    off = p.parse_args(["--model", "tiny", "--no-prefix-caching"])
    assert engine_spec(on, "cpu", "float32", 64).prefix_caching is True
    spec = engine_spec(off, "cpu", "float32", 64)
    assert spec.prefix_caching is False
    engine = dataclasses.replace(spec, warmup=False)()
    assert engine.prefix_caching is False
    engine.shutdown()


@pytest.mark.parametrize(
    ("flags", "want"),
    [
        ([], 2048),
        (["--max-prefill-tokens-with-decode", "16"], 16),
        (["--max-prefill-tokens-with-decode", "0"], None),
    ],
)
def test_the_decoding_steps_prefill_cap_reaches_the_engine(flags, want):
    import argparse

    from stepgraph.serve.cli import add_arguments, engine_spec

    p = argparse.ArgumentParser()
    add_arguments(p)
    spec = engine_spec(p.parse_args(["--model", "tiny", *flags]), "cpu", "float32", 64)
    engine = dataclasses.replace(spec, warmup=False)()
    try:
        assert engine.max_prefill_tokens_with_decode == want
    finally:
        engine.shutdown()


def test_a_negative_decoding_steps_prefill_cap_is_refused(capsys):
    import argparse

    from stepgraph.serve.cli import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    with pytest.raises(SystemExit):
        p.parse_args(["--model", "tiny", "--max-prefill-tokens-with-decode", "-1"])
    assert "--max-prefill-tokens-with-decode" in capsys.readouterr().err
