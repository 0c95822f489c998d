"""Serving the app with uvicorn: the listening socket bound first (a busy port is a one-line
error before any weight is built), a ``Server`` whose SIGINT/SIGTERM shutdown ends with exit
status 0, and ``ServerThread``: an app served on 127.0.0.1 from a thread (the tests, the GPU
check), stopped on exit even when the body raised."""

from __future__ import annotations

import contextlib
import errno
import signal
import socket
import threading
import time
from typing import Any

import uvicorn

from ..cli_args import UsageError


def listen(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (0: a free port; read it from ``getsockname``)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        address = socket.getaddrinfo(host, port, family, socket.SOCK_STREAM)[0][4]
    except (socket.gaierror, UnicodeError) as e:
        reason = getattr(e, "strerror", None) or str(e)
        raise UsageError(
            f"argument --host: cannot resolve {host!r} ({reason}); pass an address of this "
            "machine, such as 127.0.0.1 or 0.0.0.0"
        ) from e
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # asyncio: TCP_NODELAY
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRNOTAVAIL:  # a name or address of another machine
            raise UsageError(
                f"argument --host: cannot listen on {host} ({e.strerror}): it is not an address "
                "of this machine; pass one that is, such as 127.0.0.1 or 0.0.0.0"
            ) from e
        raise UsageError(
            f"argument --port: cannot listen on {host}:{port} ({e.strerror}); pick another "
            "--port (0: any free one)"
        ) from e
    sock.listen(2048)  # connections queue from now on, while the engine is still being built
    return sock


class Server(uvicorn.Server):
    """uvicorn's server, except that after a graceful shutdown on SIGINT/SIGTERM it does not
    raise the signal again (which would end the process with status 130 or 143): stop
    accepting, let the requests in flight finish within ``timeout_graceful_shutdown`` (then
    they are cancelled, which aborts them), stop the engine, return."""

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        sigs = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in sigs}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def uvicorn_config(app: Any, shutdown_timeout: float, log_level: str = "warning"):
    return uvicorn.Config(
        app,
        lifespan="on",
        log_level=log_level,
        timeout_graceful_shutdown=shutdown_timeout,
        access_log=False,
    )


class ServerThread:
    """``with ServerThread(app) as url:`` serves ``app`` on 127.0.0.1 (a free port) from a
    thread; leaving the block stops the server (the app's shutdown stops its worker)."""

    def __init__(self, app: Any, shutdown_timeout: float = 5.0, start_timeout: float = 30.0):
        self.server = Server(uvicorn_config(app, shutdown_timeout))
        self.sock = listen("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self._thread = threading.Thread(target=self.server.run, args=([self.sock],), daemon=True)
        self._start_timeout = start_timeout

    def __enter__(self) -> str:
        self._thread.start()
        deadline = time.monotonic() + self._start_timeout
        while not self.server.started:  # uvicorn sets it once it accepts connections
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the test server on {self.url} did not start")
            time.sleep(0.01)
        return self.url

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)
        self.sock.close()

    def __exit__(self, *exc) -> None:
        self.stop()


__all__ = ["Server", "ServerThread", "listen", "uvicorn_config"]
