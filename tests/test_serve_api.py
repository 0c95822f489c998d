"""`stepgraph serve` through the real ``openai`` client, against a server this module starts on
a free 127.0.0.1 port (uvicorn in a thread, the tiny preset in graph mode on the CPU) and stops:
completions plain and streamed equal `stepgraph generate`; 32 concurrent streams equal their
own generate outputs while 5 clients leave mid-stream (aborted, every KV page free after);
bad requests are 400s naming the field with nothing queued; an engine fault fails what is in
flight (500) and the next request is served; 503 + Retry-After over --max-waiting; seeded
sampling, stop ids and min_tokens; /metrics, /health, /v1/models."""

from __future__ import annotations

import asyncio
import json
import random
import re
import threading
import time
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from stepgraph.cli import main as cli_main  # noqa: E402
from stepgraph.engine import Engine  # noqa: E402
from stepgraph.model import ModelRunner  # noqa: E402
from stepgraph.serve.app import build_app  # noqa: E402
from stepgraph.serve.metrics import ServeMetrics  # noqa: E402
from stepgraph.serve.server import ServerThread  # noqa: E402
from stepgraph.serve.worker import EngineWorker, engine_limits  # noqa: E402

VOCAB, MAX_RUNNING, CONTEXT = 512, 32, 256
IDS = {"return_token_ids": True, "ignore_eos": True}


def _runner() -> ModelRunner:
    return ModelRunner.from_preset(
        "tiny", "cpu", torch.float32, 0, max_bs=MAX_RUNNING, max_context_len=CONTEXT
    )


@pytest.fixture(scope="module")
def server():
    worker = EngineWorker(
        lambda: Engine(_runner(), "graph", max_running=MAX_RUNNING), ServeMetrics()
    )
    try:
        worker.start(timeout=120)
        app = build_app(worker, engine_limits(worker.engine, "tiny", False, False), None, 64)
        with ServerThread(app) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=30)
            yield SimpleNamespace(url=url, worker=worker, app=app, client=client)
    finally:
        worker.stop(30)


@pytest.fixture(scope="module")
def reference():
    engine = Engine(_runner(), "graph")
    return lambda prompts, n, **kw: engine.generate(prompts, n, ignore_eos=True, **kw)


def _prompts(seed: int, n: int, lo: int = 3, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _health(url: str) -> dict:
    return httpx.get(url + "/health", timeout=10).json()


def _wait_idle(url: str, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        h = _health(url)
        if h["running"] == 0 and h["waiting"] == 0 or time.monotonic() > deadline:
            return h
        time.sleep(0.02)


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


@pytest.fixture(autouse=True)
def every_page_free_after(server):
    yield
    h = _wait_idle(server.url)
    assert h["running"] == h["waiting"] == 0, h
    assert h["kv_pages_free"] == h["kv_pages_total"] > 0, h
    kv, cache = server.worker.engine.model_runner.kv_cache, server.worker.engine.prefix_cache
    assert cache.num_available == kv.num_pages - 1 and not cache._tree.refs  # free or cached


def _ids(choice) -> list[int]:
    return list(choice.model_extra["token_ids"])


def test_completion_plain_and_streamed_equal_stepgraph_generate(server, capsys):
    prompts, n = _prompts(11, 3), 24
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
    want = json.loads(capsys.readouterr().out)["outputs"]
    for p, w in zip(prompts, want):
        r = server.client.completions.create(
            model="tiny", prompt=p, max_tokens=n, temperature=0, extra_body=IDS
        )
        (ch,) = r.choices
        assert _ids(ch) == w and ch.finish_reason == "length" and ch.text == ""
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(p), n)
        assert r.object == "text_completion" and r.model == "tiny"
        chunks = list(
            server.client.completions.create(
                model="tiny",
                prompt=p,
                max_tokens=n,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body=IDS,
            )
        )
        body = [c for c in chunks if c.choices]
        assert [t for c in body for t in _ids(c.choices[0])] == w
        reasons = [c.choices[0].finish_reason for c in body]  # chunks may merge tokens
        assert reasons == [None] * (len(body) - 1) + ["length"]
        assert chunks[-1].usage.completion_tokens == n and not chunks[-1].choices


def test_32_concurrent_streams_and_5_that_leave_mid_stream(server, reference):
    rng = random.Random(12)
    prompts = _prompts(12, 32, hi=16)
    quits = dict.fromkeys(rng.sample(range(32), 5), 0)
    for i in quits:
        quits[i] = rng.randint(2, 8)  # tokens read before leaving
    lens = [
        CONTEXT - len(p) + 1 if i in quits else rng.randint(4, 90) for i, p in enumerate(prompts)
    ]
    url = server.url
    before = {
        r: _metric(url, f'stepgraph_requests_finished_total{{reason="{r}"}}')
        for r in ("abort", "length")
    }
    gen_before = _metric(url, "stepgraph_generation_tokens_total")

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
                await stream.close()  # the connection goes: the server must abort it
                break
        return ids

    async def run_all():
        async with openai.AsyncOpenAI(
            base_url=url + "/v1", api_key="none", max_retries=0, timeout=30
        ) as c:
            return await asyncio.gather(*(one(c, i) for i in range(32)))

    got = asyncio.run(run_all())
    stay = [i for i in range(32) if i not in quits]
    want = dict(zip(stay, reference([prompts[i] for i in stay], max(lens[i] for i in stay))))
    for i in stay:
        assert got[i] == want[i][: lens[i]], f"request {i} ({lens[i]} tokens)"
    left = reference([prompts[i] for i in quits], 12)
    for i, w in zip(quits, left):
        assert quits[i] <= len(got[i]) and got[i] == w[: len(got[i])]
    h = _wait_idle(url)
    assert h["kv_pages_free"] == h["kv_pages_total"]  # also checked after every test
    after = {r: _metric(url, f'stepgraph_requests_finished_total{{reason="{r}"}}') for r in before}
    assert (after["abort"] - before["abort"], after["length"] - before["length"]) == (5, 27)
    # the 5 would have run ~1200 tokens to their end: they stopped soon after leaving
    spent = _metric(url, "stepgraph_generation_tokens_total") - gen_before
    assert spent < sum(lens[i] for i in stay) + 5 * 120, spent


BAD = [
    (b"{bad json", "body"),
    (b"[1, 2, 3]", "body"),
    ({"prompt": [1, 2]}, "model"),
    ({"model": "tiny"}, "prompt"),
    ({"model": "tiny", "prompt": []}, "prompt"),
    ({"model": "tiny", "prompt": [1, VOCAB]}, "prompt"),
    ({"model": "tiny", "prompt": [-4, 2]}, "prompt"),
    ({"model": "tiny", "prompt": "text needs a tokenizer"}, "prompt"),
    ({"model": "tiny", "prompt": [0.5]}, "prompt"),
    ({"model": "tiny", "prompt": list(range(1, CONTEXT + 2))}, "prompt"),
    ({"model": "tiny", "prompt": [1], "max_tokens": -5}, "max_tokens"),
    ({"model": "tiny", "prompt": [1], "max_tokens": "16"}, "max_tokens"),
    ({"model": "tiny", "prompt": [1, 2, 3], "max_tokens": CONTEXT}, "max_tokens"),
    ({"model": "tiny", "prompt": [1], "temperature": -1}, "temperature"),
    ({"model": "tiny", "prompt": [1], "top_k": "ten"}, "top_k"),
    ({"model": "tiny", "prompt": [1], "seed": 1.5}, "seed"),
    ({"model": "tiny", "prompt": [1], "stream": "true"}, "stream"),
    ({"model": "tiny", "prompt": [1], "stop": [VOCAB + 3]}, "stop"),
    ({"model": "tiny", "prompt": [1], "stop": "\n"}, "stop"),
    ({"model": "tiny", "prompt": [1], "ignore_eos": "no"}, "ignore_eos"),
    ({"model": "tiny", "prompt": [1], "max_tokens": 4, "min_tokens": 9}, "min_tokens"),
    ({"model": "tiny", "prompt": [1], "return_token_ids": 1}, "return_token_ids"),
    ({"model": "tiny", "prompt": [1], "n": 3}, "n"),
    ({"model": "tiny", "prompt": [1], "stream_options": {"include_usage": True}}, "stream_options"),
]


def test_bad_requests_are_400s_naming_the_field_and_queue_nothing(server):
    w = server.worker
    handed = w.sent, w.taken, w.engine.stats.prefills  # sent, read by the engine, prefilled
    for body, field in BAD:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = httpx.post(
            server.url + "/v1/completions",
            content=raw,
            timeout=10,
            headers={"Content-Type": "application/json"},
        )
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert err["param"] == field and err["type"] == "invalid_request_error", (body, err)
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["code"] == "chat_template_missing"
    r = httpx.post(server.url + "/v1/completions", json={"model": "gpt-4", "prompt": [1]})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    assert httpx.get(server.url + "/v1/nothing").json()["error"]["message"]
    assert (w.sent, w.taken, w.engine.stats.prefills) == handed
    ok = server.client.completions.create(
        model="tiny", prompt=[5, 6, 7], max_tokens=4, temperature=0, extra_body=IDS
    )
    assert len(_ids(ok.choices[0])) == 4


def test_an_engine_fault_fails_the_requests_in_flight_and_the_next_is_served(server, reference):
    engine = server.worker.engine
    real = engine.decoder.logits
    armed = threading.Event()

    def faulty(*a, **k):
        if armed.is_set():
            raise RuntimeError("injected decode fault")
        return real(*a, **k)

    prompts = _prompts(13, 5)

    async def plain(c, p):
        with pytest.raises(openai.InternalServerError) as e:
            await c.completions.create(model="tiny", prompt=p, max_tokens=30, temperature=0)
        return e.value

    async def streamed(c, p):
        ids = []
        with pytest.raises(openai.APIError) as e:
            async for ch in await c.completions.create(
                model="tiny", prompt=p, max_tokens=30, temperature=0, stream=True, extra_body=IDS
            ):
                ids += _ids(ch.choices[0])
        return e.value, ids

    async def run_all():
        async with openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=30
        ) as c:
            two = [plain(c, prompts[0]), plain(c, prompts[1])]
            return await asyncio.gather(*two, streamed(c, prompts[2]), streamed(c, prompts[3]))

    engine.decoder.logits = faulty
    armed.set()
    try:
        out = asyncio.run(run_all())
    finally:
        armed.clear()
        del engine.decoder.logits  # the class's method again
    for err in out[:2]:
        assert err.status_code == 500 and err.body["code"] == "engine_fault"
        assert "injected decode fault" in err.body["message"]
    for err, ids in out[2:]:
        assert err.body["code"] == "engine_fault" and len(ids) <= 1  # a first token at most
    r = server.client.completions.create(
        model="tiny", prompt=prompts[4], max_tokens=12, temperature=0, extra_body=IDS
    )
    assert _ids(r.choices[0]) == reference([prompts[4]], 12)[0]


def test_over_max_waiting_is_a_503_with_retry_after(server):
    engine, handlers = server.worker.engine, server.app.state.handlers
    real, release, blocked = engine.decoder.logits, threading.Event(), threading.Event()

    def stalled(*a, **k):
        blocked.set()
        release.wait(20)
        return real(*a, **k)

    codes = []

    def send(p):
        body = {"model": "tiny", "prompt": p, "max_tokens": 3, "temperature": 0}
        codes.append(httpx.post(server.url + "/v1/completions", json=body, timeout=30).status_code)

    engine.decoder.logits, handlers.max_waiting = stalled, 2
    threads = [threading.Thread(target=send, args=([1, 2, 3 + i],)) for i in range(3)]
    try:
        threads[0].start()
        assert blocked.wait(10)  # the engine thread is inside a decode step now
        for t in threads[1:]:
            t.start()
        deadline = time.monotonic() + 10
        while server.worker.waiting < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        r = httpx.post(
            server.url + "/v1/completions",
            timeout=10,
            json={"model": "tiny", "prompt": [9], "max_tokens": 2},
        )
        assert r.status_code == 503 and r.headers["Retry-After"] == "1"
        assert r.json()["error"]["code"] == "server_overloaded"
    finally:
        release.set()
        for t in threads:
            t.join(30)
        handlers.max_waiting = 64
        del engine.decoder.logits
    assert codes == [200, 200, 200]


def test_seeded_sampling_stop_ids_and_min_tokens(server, reference):
    (p,) = _prompts(14, 1)
    kw = dict(model="tiny", prompt=p, max_tokens=20, temperature=0.9, seed=5)
    kw["extra_body"] = {**IDS, "top_k": 40}
    sampled = [_ids(server.client.completions.create(**kw).choices[0]) for _ in range(2)]
    assert sampled[0] == sampled[1] == reference([p], 20, temperature=0.9, top_k=40, seed=5)[0]
    assert sampled[0] != reference([p], 20)[0]  # not greedy
    greedy = reference([p], 40)[0]
    stop = greedy[3]
    r = server.client.completions.create(
        model="tiny",
        prompt=p,
        max_tokens=40,
        temperature=0,
        stop=[stop],
        extra_body={"return_token_ids": True},
    )
    first = greedy.index(stop)
    assert _ids(r.choices[0]) == greedy[: first + 1] and r.choices[0].finish_reason == "stop"
    r = server.client.completions.create(
        model="tiny",
        prompt=p,
        max_tokens=40,
        temperature=0,
        stop=[stop],
        extra_body={"return_token_ids": True, "min_tokens": first + 2},
    )
    later = [i for i, t in enumerate(greedy) if t == stop and i > first]
    n = later[0] + 1 if later else 40
    assert _ids(r.choices[0]) == greedy[:n]


def test_models_health_and_metrics(server):
    models = server.client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    h = _health(server.url)
    assert h["status"] == "ok" and h["kv_pages_total"] == server.worker.kv_pages_total
    server.client.completions.create(model="tiny", prompt=[1, 2], max_tokens=5, temperature=0)
    text = httpx.get(server.url + "/metrics").text
    for name in (
        "stepgraph_requests_running",
        "stepgraph_requests_waiting",
        "stepgraph_kv_pages_free",
        "stepgraph_generation_tokens_total",
        "stepgraph_generation_tokens_per_second",
        "stepgraph_time_to_first_token_seconds_bucket",
        "stepgraph_time_per_output_token_seconds_count",
    ):
        assert re.search(rf"^{name}[ {{]", text, re.M), name
    assert _metric(server.url, "stepgraph_time_to_first_token_seconds_count") >= 1
    assert _metric(server.url, "stepgraph_generation_tokens_per_second") > 0
    steps = server.worker.engine.stats  # read at the scrape: the engine's own counts
    assert _metric(server.url, 'stepgraph_engine_steps{kind="graph"}') == steps.graph_steps > 0
    assert _metric(server.url, 'stepgraph_engine_steps{kind="prefill"}') == steps.prefill_steps
