"""The engine process of `stepgraph serve` (``--engine process``): ``EngineSpec`` (what to build,
picklable, so that a spawned process can build it), ``EngineProcess`` (the process and its two
pipes, as the front end holds them) and ``child_main``, the process's body: it builds the
``Engine``, says ``(READY, info)`` (or ``(FAILED, text)``), then runs the ``EngineLoop``
(``loop.py``: the commands and the one message per step it answers) over the pipes.

It ignores SIGINT and SIGTERM (a terminal's Ctrl-C, or a service manager's stop, reaches the
whole process group: the front end drains, then stops it, or kills it when it does not stop)
and leaves when the front end says stop or goes away (end of file, a broken pipe): no orphan."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import importlib
import logging
import os
import pickle
import signal
import struct
import sys
import time
from typing import Any

from .loop import FAILED, READY, EngineLoop, engine_info
from .progress import local_bar_lock, phase

PIPE_BYTES = 1 << 20  # each pipe's capacity, where Linux allows it (64 KiB by default)
log = logging.getLogger("stepgraph.serve")


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """The model runner and engine `stepgraph serve` builds; calling it builds them (on the
    thread or in the process that will run the engine). ``setup``: ``"module:function"``
    called with the engine once built (the tests' fault hooks)."""

    model: str
    device: str = "cpu"
    dtype: str = "float32"
    mode: str = "graph"
    max_running: int = 64
    context: int = 4096
    seed: int = 0
    kernels: str | None = None
    max_prefill_tokens: int | None = None
    threads: int | None = None
    warmup: bool = True
    setup: str | None = None
    quantization: str | None = None  # "fp8": FP8 weights (build_model_runner's)
    prefix_caching: bool = True  # Engine(prefix_caching=...)
    max_prefill_tokens_with_decode: int | None = None  # None: the engine's; 0: no cap
    tp: int = 1  # tensor-parallel ranks: built in each rank torchrun started (``tp.py``)

    def __call__(self) -> Any:
        from ..bench.constants import DTYPES
        from ..engine import Engine
        from ..engine.warm import warm_lengths, warm_room, warm_up
        from ..model.launch import build_model_runner

        if self.device == "cpu":  # where the ops run
            from ..bench.cpu import set_cpu_threads
            from ..cli_args import model_config

            line = set_cpu_threads(self.threads, model_config(self.model))
            print(f"stepgraph serve: {line}", file=sys.stderr)
        source = "loading" if os.path.isdir(self.model) else f"building random (seed {self.seed})"
        with phase(f"{source} weights of {self.model} on {self.device} ({self.dtype})"):
            mr = build_model_runner(
                self.model,
                self.device,
                DTYPES[self.dtype],
                seed=self.seed,
                max_bs=self.max_running,
                max_context_len=self.context,
                quantization=self.quantization,
                tp=self.tp,
            )
            if self.kernels:
                mr.set_kernels(self.kernels)
        kw = {"max_prefill_tokens": self.max_prefill_tokens} if self.max_prefill_tokens else {}
        if self.max_prefill_tokens_with_decode is not None:
            kw["max_prefill_tokens_with_decode"] = self.max_prefill_tokens_with_decode or None
        what = "" if self.mode == "eager" else ", capturing its decode and prefill graphs"
        with phase(f"building the engine ({self.mode}{what})"):
            engine = Engine(
                mr,
                mode=self.mode,
                max_running=self.max_running,
                prefix_caching=self.prefix_caching,
                **kw,
            )
        if self.warmup:  # every prompt-length class once: no request compiles after ready
            lengths = warm_lengths(warm_room(engine), engine.max_prefill_tokens)
            what = f"{len(lengths)} prompt lengths of 1 to {max(lengths, default=0)} tokens"
            with phase(f"warming up every prompt-length class ({what}, alone and packed)"):
                warm_up(engine)
        if self.setup:
            module, _, name = self.setup.partition(":")
            getattr(importlib.import_module(module), name)(engine)
        return engine


class EngineProcess:
    """One engine process (``ctx``: a spawn context) and its two pipes. ``send`` never blocks:
    what the pipe does not take at once waits in a buffer, written from the event loop when the
    pipe has room (``attach``), so a busy or hung engine never stalls the front end, and no
    writer thread waits on the front end's GIL."""

    def __init__(self, ctx: Any, spec: EngineSpec) -> None:
        to_r, self.to_w = ctx.Pipe(duplex=False)
        self.from_r, from_w = ctx.Pipe(duplex=False)
        for conn in (self.to_w, self.from_r):  # room for a burst of prompts, a lagging reader
            with contextlib.suppress(OSError, AttributeError):
                fcntl.fcntl(conn.fileno(), fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        self.proc = ctx.Process(
            target=child_main, args=(to_r, from_w, spec), name="stepgraph-engine"
        )
        self.proc.start()
        to_r.close()  # the child's ends: its exit is an end of file here
        from_w.close()
        os.set_blocking(self.to_w.fileno(), False)
        self.dead = self._writing = False
        self._out = bytearray()
        self._loop: Any = None

    def attach(self, loop: Any) -> None:
        self._loop = loop
        self._flush()

    def send(self, msg: tuple) -> None:
        """``msg`` framed as ``Connection.send`` frames it (the child reads it with ``recv``)."""
        if not self.dead:
            data = pickle.dumps(msg, pickle.HIGHEST_PROTOCOL)
            self._out += struct.pack("!i", len(data)) + data
            self._flush()

    def _flush(self) -> None:
        fd = self.to_w.fileno()
        try:
            del self._out[: os.write(fd, self._out)]
        except BlockingIOError:
            pass
        except OSError:  # the process is gone; the event loop sees its exit
            self._out.clear()
        wait = bool(self._out) and self._loop is not None and not self.dead
        if wait != self._writing:
            self._writing = wait
            (self._loop.add_writer(fd, self._flush) if wait else self._loop.remove_writer(fd))

    def end(self, timeout: float) -> int | None:
        """Wait ``timeout`` s for the process to exit, then kill it (it ignores SIGTERM)."""
        for finish in (None, self.proc.kill):
            if finish is not None and self.proc.is_alive():
                log.warning("the engine process did not exit; %s", finish.__name__)
                finish()
            self.proc.join(timeout if finish is None else 5)
        return self.proc.exitcode

    def close(self) -> None:
        """Its pipes closed (on the event loop's thread, which watches them)."""
        if self._writing and not self._loop.is_closed():
            self._loop.remove_writer(self.to_w.fileno())
        self.dead, self._writing = True, False
        self.to_w.close()
        self.from_r.close()


def child_main(inbox: Any, outbox: Any, spec: EngineSpec) -> None:
    """The engine process: build, say ready (or why not), serve the pipe until told to stop."""
    for sig in (signal.SIGINT, signal.SIGTERM):  # a handler, not SIG_IGN: exec resets it
        signal.signal(sig, lambda *_: None)
    logging.basicConfig(format="stepgraph engine: %(message)s")
    local_bar_lock()
    try:
        engine = spec()
    except BaseException as e:  # noqa: BLE001 - told to the front end, which raises it
        outbox.send((FAILED, f"{type(e).__name__}: {e}"))
        return
    outbox.send((READY, engine_info(engine)))
    try:
        EngineLoop(engine, inbox, outbox).run()
    except (EOFError, OSError):  # the front end went away: nobody to serve
        pass
    finally:
        t = time.perf_counter()
        engine.shutdown()
        log.debug("engine shut down in %.2f s", time.perf_counter() - t)


__all__ = ["PIPE_BYTES", "EngineProcess", "EngineSpec", "child_main"]
