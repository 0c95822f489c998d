"""`stepgraph serve` as a process: it listens on the port it prints (127.0.0.1), and SIGTERM or
SIGINT stops it with exit status 0, a request in flight finished within --shutdown-timeout (or
aborted at 0), its engine process gone with it; bad flags are one-line errors before anything
is built."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
httpx = pytest.importorskip("httpx")

from stepgraph.cli import main as cli_main  # noqa: E402

START_TIMEOUT = 90


class Served:
    """``python -m stepgraph serve ...`` on a free port; killed on exit if still running."""

    def __init__(self, *flags: str, session: bool = False) -> None:
        cmd = [
            sys.executable,
            "-m",
            "stepgraph",
            "serve",
            "--model",
            "tiny",
            "--device",
            "cpu",
            "--port",
            "0",
            "--max-running",
            "4",
            *flags,
        ]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=session,
        )
        self.lines: queue.Queue = queue.Queue()
        self.err: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.err.append(line)
            self.lines.put(line)

    def __enter__(self) -> Served:
        try:  # a failed start must not leave the process behind (__exit__ would not run)
            self._wait_ready()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                line = self.lines.get(timeout=1)
            except queue.Empty:
                continue
            m = re.search(r"http://127\.0\.0\.1:(\d+)", line)
            if m:
                self.url = f"http://127.0.0.1:{m.group(1)}"
                break
        else:
            raise AssertionError(f"the server did not start: {''.join(self.err)}")
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise AssertionError(f"{self.url}/health never answered 200: {''.join(self.err)}")

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def gone(pid: int) -> bool:
    """No such process, or only its zombie (a container's init may not reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def _stream_in_thread(url: str, max_tokens: int):
    """A streamed request read in a thread: (lines, first chunk seen, thread)."""
    lines, first = [], threading.Event()
    body = {
        "model": "tiny",
        "prompt": [1, 2, 3],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }

    def read():
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                        first.set()
        except httpx.HTTPError:
            pass  # cut off by the shutdown
        first.set()

    t = threading.Thread(target=read, daemon=True)
    t.start()
    return lines, first, t


@pytest.mark.parametrize(
    "sig,timeout,n,finishes", [(signal.SIGTERM, "30", 300, True), (signal.SIGINT, "0", 2000, False)]
)
def test_a_signal_stops_the_server_with_exit_status_0(sig, timeout, n, finishes):
    with Served("--max-context", "2048", "--shutdown-timeout", timeout) as s:
        child = httpx.get(s.url + "/health", timeout=5).json()["engine_pid"]  # the default
        assert child and not gone(child)
        lines, first, reader = _stream_in_thread(s.url, n)
        assert first.wait(30) and lines, s.err
        t0 = time.monotonic()
        s.proc.send_signal(sig)
        rc = s.proc.wait(60)
        took = time.monotonic() - t0
        reader.join(30)
        assert rc == 0, "".join(s.err)
        assert gone(child)  # the engine process stopped with the server: no orphan
        assert not reader.is_alive()
        done = lines[-1] == "data: [DONE]"
        assert done == finishes, (len(lines), lines[-1][:80])
        chunks = [json.loads(x[6:]) for x in lines if x != "data: [DONE]"]
        tokens = sum(len(c["choices"][0]["token_ids"]) for c in chunks)
        if finishes:  # every token of the request, then [DONE]
            assert tokens == n and chunks[-1]["choices"][0]["finish_reason"] == "length"
        else:
            assert took < 15 and tokens < n
        assert "stepgraph serve: stopped" in "".join(s.err)
        with pytest.raises(httpx.ConnectError):
            httpx.get(s.url + "/health", timeout=5)


def test_sigterm_to_the_whole_process_group_drains_before_the_engine_stops():
    """A service manager signals every process of the server: the engine process waits for the
    front end, which lets the request in flight finish, stops the engine and exits 0."""
    with Served("--max-context", "2048", "--shutdown-timeout", "30", session=True) as s:
        child = httpx.get(s.url + "/health", timeout=5).json()["engine_pid"]
        lines, first, reader = _stream_in_thread(s.url, 300)
        assert first.wait(30) and lines, s.err
        os.killpg(s.proc.pid, signal.SIGTERM)  # its own session: the server and its engine
        assert s.proc.wait(60) == 0, "".join(s.err)
        reader.join(30)
        assert lines[-1] == "data: [DONE]" and gone(child)
        tokens = sum(len(json.loads(x[6:])["choices"][0]["token_ids"]) for x in lines[:-1])
        assert tokens == 300


def test_bad_flags_are_one_line_errors(capsys):
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = str(busy.getsockname()[1])
    cases = [
        (["--model", "nope"], "--model"),
        (["--model", "tiny", "--port", "70000"], "--port"),
        (["--model", "tiny", "--max-context", "4096"], "--max-context"),
        (["--model", "tiny", "--max-waiting", "-1"], "--max-waiting"),
        (["--model", "tiny", "--max-running", "0"], "--max-running"),
        (["--model", "tiny", "--shutdown-timeout", "-2"], "--shutdown-timeout"),
        (["--model", "tiny", "--device", "cpu", "--port", port], "--port: cannot listen"),
        (["--model", "tiny", "--device", "cpu", "--host", "nosuch.invalid"], "--host: cannot"),
        (["--model", "tiny", "--device", "cpu", "--host", "192.0.2.1"], "--host: cannot"),
    ]
    try:
        for argv, said in cases:
            assert cli_main(["serve", *argv]) == 2
            err = capsys.readouterr().err.strip()
            assert err.startswith("stepgraph: error:") and "\n" not in err and said in err, err
    finally:
        busy.close()


def test_the_served_connections_send_without_nagle():
    """Accepted connections have TCP_NODELAY (asyncio sets it only on a socket whose protocol
    is TCP): else an event's chunk after the response's headers waits for the client's delayed
    ACK, about 40 ms on a kept-alive connection."""
    import asyncio

    from stepgraph.serve.server import listen

    async def accepted() -> int:
        sock = listen("127.0.0.1", 0)
        got: asyncio.Future = asyncio.get_running_loop().create_future()

        class Proto(asyncio.Protocol):
            def connection_made(self, transport):
                s = transport.get_extra_info("socket")
                got.set_result(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))

        server = await asyncio.get_running_loop().create_server(Proto, sock=sock)
        try:
            _, w = await asyncio.open_connection(*sock.getsockname()[:2])
            value = await asyncio.wait_for(got, 10)
            w.close()
            return value
        finally:
            server.close()

    assert asyncio.run(accepted()) != 0


def test_sigterm_after_an_engine_restart_leaves_nothing_leaked():
    """The engine process killed, started again, then the server stopped: exit 0, and no
    resource tracker warning of a semaphore the killed process never released."""
    with Served("--max-context", "256") as s:
        child = httpx.get(s.url + "/health", timeout=5).json()["engine_pid"]
        os.kill(child, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            h = httpx.get(s.url + "/health", timeout=5).json()
            if h["status"] == "ok" and h["engine_pid"] != child:
                break
            time.sleep(0.1)
        assert h["status"] == "ok" and h["engine_pid"] != child, h
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(60) == 0, "".join(s.err)
        time.sleep(0.5)  # the reader thread takes the last lines
        err = "".join(s.err)
        assert "stepgraph serve: stopped" in err and "starting it again" in err
        assert "leaked" not in err and "resource_tracker" not in err, err
