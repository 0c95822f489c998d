"""`stepgraph serve --api-key`: ``/v1/`` answers 401 (OpenAI's error object) without the key or
with a wrong one and 200 with it, through the real ``openai`` client too; ``/health`` and
``/metrics`` stay open; without a key nothing is asked; the warning for a server that listens
beyond this machine with no key (decided from the bound address; the tests bind 127.0.0.1
only); ``--api-key`` and ``$STEPGRAPH_API_KEY``; ``--host``'s help says what it does."""

from __future__ import annotations

import argparse

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from stepgraph.cli import main as cli_main  # noqa: E402
from stepgraph.cli_args import UsageError  # noqa: E402
from stepgraph.serve import cli as serve_cli  # noqa: E402
from stepgraph.serve.app import build_app  # noqa: E402
from stepgraph.serve.auth import bearer_matches, exposure_warning, is_loopback  # noqa: E402
from stepgraph.serve.engine_proc import EngineSpec  # noqa: E402
from stepgraph.serve.metrics import ServeMetrics  # noqa: E402
from stepgraph.serve.server import ServerThread  # noqa: E402
from stepgraph.serve.worker import EngineWorker  # noqa: E402

KEY = "sk-local-7f3a"
SPEC = EngineSpec("tiny", "cpu", "float32", "graph", 4, 256, warmup=False)
BODY = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2}


@pytest.fixture(scope="module")
def worker():
    w = EngineWorker(SPEC, ServeMetrics())
    try:
        yield w.start(timeout=120)
    finally:
        w.stop(30)


def _app(worker, key):
    app = build_app(worker, worker.limits("tiny", False, False), None, 64, api_key=key)
    app.router.lifespan_context = _no_stop  # the module's worker outlives each server
    return app


class _no_stop:
    def __init__(self, app):
        pass

    async def __aenter__(self):
        return None

    async def __aexit__(self, *exc):
        return None


def test_v1_needs_the_key_and_health_and_metrics_stay_open(worker):
    with ServerThread(_app(worker, KEY)) as url:
        refused = ["", "Bearer wrong", KEY, f"Bearer {KEY}x", "Bearer", f"Basic {KEY}"]
        for headers in [{"Authorization": v} if v else {} for v in refused]:
            for r in (
                httpx.get(url + "/v1/models", headers=headers),
                httpx.post(url + "/v1/completions", json=BODY, headers=headers),
            ):
                assert r.status_code == 401, (headers, r.text)
                err = r.json()["error"]
                assert (
                    err["code"] == "invalid_api_key" and "Authorization: Bearer" in err["message"]
                )
                assert r.headers["WWW-Authenticate"] == "Bearer"
        good = {"Authorization": f"Bearer {KEY}"}
        assert httpx.get(url + "/v1/models", headers=good).status_code == 200
        assert httpx.get(url + "/v1/models", headers={"authorization": f"bearer {KEY}"}).is_success
        r = httpx.post(url + "/v1/completions", json=BODY, headers=good, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        assert httpx.get(url + "/health").status_code == 200  # no key: open
        assert httpx.get(url + "/metrics").status_code == 200
        ok = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=30)
        assert ok.completions.create(**BODY).usage.completion_tokens == 2
        bad = openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0, timeout=30)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()


def test_without_a_key_nothing_is_asked(worker):
    with ServerThread(_app(worker, None)) as url:
        assert httpx.get(url + "/v1/models").status_code == 200
        assert httpx.post(url + "/v1/completions", json=BODY, timeout=30).status_code == 200


def test_the_bearer_header_is_matched_exactly():
    key = KEY.encode()
    assert bearer_matches(b"Bearer " + key, key) and bearer_matches(b"bearer  " + key, key)
    for value in (
        None,
        b"",
        key,
        b"Basic " + key,
        b"Bearer " + key[:-1],
        b"Bearer " + key + b"x",
        b"Bearer",
    ):
        assert not bearer_matches(value, key), value


def test_a_server_beyond_loopback_without_a_key_warns_in_one_line():
    for address in ("127.0.0.1", "127.8.9.10", "::1", "::ffff:127.0.0.1"):
        assert is_loopback(address) and exposure_warning(address, None) is None, address
    for address in ("0.0.0.0", "::", "192.168.1.20", "10.0.0.1", "fe80::1%eth0"):
        line = exposure_warning(address, None)
        assert line is not None and "\n" not in line, address
        assert address in line and "--api-key" in line and "STEPGRAPH_API_KEY" in line
        assert exposure_warning(address, KEY) is None  # a key: no warning


def _parsed(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    serve_cli.add_arguments(p)
    return p.parse_args(["--model", "tiny", *argv])


def test_the_key_comes_from_the_flag_else_the_environment(monkeypatch):
    monkeypatch.delenv("STEPGRAPH_API_KEY", raising=False)
    assert serve_cli.api_key(_parsed()) is None
    monkeypatch.setenv("STEPGRAPH_API_KEY", "from-env")
    assert serve_cli.api_key(_parsed()) == "from-env"
    assert serve_cli.api_key(_parsed("--api-key", "flag")) == "flag"
    monkeypatch.setenv("STEPGRAPH_API_KEY", "")
    assert serve_cli.api_key(_parsed()) is None
    with pytest.raises(UsageError, match="--api-key"):
        serve_cli.api_key(_parsed("--api-key", " "))


def test_an_empty_key_is_a_one_line_error_and_the_help_says_what_host_does(capsys):
    assert cli_main(["serve", "--model", "tiny", "--device", "cpu", "--api-key", ""]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("stepgraph: error:") and "--api-key" in err and "\n" not in err
    with pytest.raises(SystemExit):
        cli_main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "loopback only" not in text and "0.0.0.0" in text and "--api-key" in text
    assert "STEPGRAPH_API_KEY" in text
