"""The engine process of `stepgraph serve` (``--engine process``): ``EngineSpec`` (what to build,
picklable, so that a spawned process can build it), and ``child_main``, the process's body: it
builds the ``Engine``, says it is ready, then runs the overlapped step loop, the only caller of
the engine (the thread rule).

The front end (``proc_worker.py``) sends it ``(SUBMIT, id, fields)``, ``(ABORT, id)`` and
``(STOP,)`` through one pipe; it answers through another with ``(READY, info)``, then **one
message per engine step** with every request's new tokens, ``(STEP, [(id, tokens, finish reason
or None), ...], state)``, where ``state`` is ``(running, waiting in the engine, KV pages free,
submissions taken, graph steps, eager steps, prefill steps)``; ``(FAULT, ids, text, state)``
when a step raised (the engine has dropped those requests and freed their pages already:
``Engine.step``; the loop carries on), ``(REJECT, id, text)`` for a request the engine refused.
Idle, it blocks on its pipe; busy, it polls it between steps. It ignores SIGINT and SIGTERM
(a terminal's Ctrl-C, or a service manager's stop, reaches the whole process group: the front
end drains, then stops it, or kills it when it does not stop) and leaves when the
front end says stop or goes away (end of file, a broken pipe): no orphan."""

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

from .progress import local_bar_lock, phase

SUBMIT, ABORT, STOP = "submit", "abort", "stop"
READY, FAILED, STEP, FAULT, REJECT = "ready", "failed", "step", "fault", "reject"
PIPE_BYTES = 1 << 20  # each pipe's capacity, where Linux allows it (64 KiB by default)
WARMUP_PROMPT = list(range(1, 17))  # one short request before serving: first-use compiles
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

    def __call__(self) -> Any:
        from ..bench.constants import DTYPES
        from ..engine import Engine
        from ..model.launch import build_model_runner

        if self.device == "cpu":  # where the ops run
            from ..bench.cpu import set_cpu_threads
            from ..cli_args import model_config

            line = set_cpu_threads(self.threads, model_config(self.model))
            print(f"stepgraph serve: {line}", file=sys.stderr)
        source = "loading" if os.path.isdir(self.model) else f"building random (seed {self.seed})"
        with phase(f"{source} weights of {self.model} on {self.device} ({self.dtype})"):
            mr = build_model_runner(self.model, self.device, DTYPES[self.dtype],
                                    seed=self.seed, max_bs=self.max_running,
                                    max_context_len=self.context)  # fmt: skip
            if self.kernels:
                mr.set_kernels(self.kernels)
        kw = {"max_prefill_tokens": self.max_prefill_tokens} if self.max_prefill_tokens else {}
        what = "" if self.mode == "eager" else ", capturing its decode graphs"
        with phase(f"building the engine ({self.mode}{what})"):
            engine = Engine(mr, mode=self.mode, max_running=self.max_running, **kw)
        if self.warmup:
            with phase("one warm-up request (first-use compiles)"):
                engine.generate([WARMUP_PROMPT[: max(1, self.context - 2)]], 2, ignore_eos=True)
        if self.setup:
            module, _, name = self.setup.partition(":")
            getattr(importlib.import_module(module), name)(engine)
        return engine


def finish_reason(req: Any) -> str:
    """ "stop" when the last token is a stop id that counted (``min_tokens`` met), else
    "length"."""
    out = req.output
    counted = len(out) >= max(req.min_tokens, 1)
    return "stop" if out and counted and out[-1] in req.stop_ids else "length"


def engine_info(engine: Any) -> dict:
    """What the front end needs to check requests: the vocabulary, the longest request the
    engine can ever hold (positions, one request's KV, the whole cache), the KV pages."""
    mr, kv = engine.model_runner, engine.model_runner.kv_cache
    room = min(mr.config.max_position_embeddings, kv.max_context_len,
               (kv.num_pages - 1) * kv.page_size)  # fmt: skip
    return {"vocab": mr.config.vocab_size, "room": room, "kv_pages_total": kv.num_pages - 1,
            "pid": os.getpid()}  # fmt: skip


def submit_fields(p: Any) -> tuple:
    """The parts of a ``GenParams`` the engine needs, as sent through the pipe."""
    return (p.prompt_ids, p.max_tokens, p.stop_ids, p.ignore_eos, p.min_tokens, p.seed,
            p.temperature, p.top_k)  # fmt: skip


def add_request(engine: Any, fields: tuple) -> int:
    from ..engine import Sampling

    prompt, max_tokens, stop_ids, ignore_eos, min_tokens, seed, temperature, top_k = fields
    return engine.add_request(
        prompt, max_tokens, stop_ids=stop_ids, ignore_eos=ignore_eos, min_tokens=min_tokens,
        seed=seed, sampling=Sampling(temperature, top_k) if temperature > 0 else None,
    )  # fmt: skip


class EngineLoop:
    """The step loop over ``inbox`` (commands) and ``outbox`` (answers)."""

    def __init__(self, engine: Any, inbox: Any, outbox: Any) -> None:
        self.engine, self.inbox, self.outbox = engine, inbox, outbox
        self.ids: dict[int, int] = {}  # engine request id -> front end id
        self.rids: dict[int, int] = {}  # front end id -> engine request id
        self.taken = 0
        self._sent_state: tuple | None = None

    def run(self) -> None:
        engine = self.engine
        while True:
            cmds = []
            if not engine.has_unfinished:
                engine.drain()  # pages of the last step back before sleeping
                if self.state() != self._sent_state:
                    self.outbox.send((STEP, [], self._state()))
                cmds.append(self.inbox.recv())  # idle: block until a command comes
            while self.inbox.poll():
                cmds.append(self.inbox.recv())
            for cmd in cmds:
                if cmd[0] == STOP:
                    engine.abort_all()
                    return
                if cmd[0] == SUBMIT:
                    self._add(cmd[1], cmd[2])
                else:
                    rid = self.rids.pop(cmd[1], None)
                    if rid is not None:
                        engine.abort(rid)
                        del self.ids[rid]
            if not engine.has_unfinished:
                continue
            try:
                pairs = engine.step()
            except Exception as e:  # the engine freed every page already (Engine.step)
                log.exception("engine step failed; failing %d requests", len(self.ids))
                text = f"{type(e).__name__}: {e}"
                self.outbox.send((FAULT, list(self.ids.values()), text, self._state()))
                self.ids.clear()
                self.rids.clear()
                continue
            self.outbox.send((STEP, self._items(pairs), self._state()))

    def _add(self, fid: int, fields: tuple) -> None:
        self.taken += 1
        try:
            rid = add_request(self.engine, fields)
        except Exception as e:  # the front end's checks should have caught it
            self.outbox.send((REJECT, fid, str(e)))
            return
        self.ids[rid], self.rids[fid] = fid, rid

    def _items(self, pairs: list) -> list:
        new: dict[int, list[int]] = {}
        for rid, tok in pairs:
            new.setdefault(rid, []).append(tok)
        items = []
        finished = self.engine.finished
        for rid, toks in new.items():
            req = finished.pop(rid, None)
            fid = self.ids.get(rid)
            if fid is None:
                continue
            reason = None
            if req is not None:
                reason = finish_reason(req)
                del self.ids[rid], self.rids[fid]
            items.append((fid, toks, reason))
        return items

    def state(self) -> tuple:
        e = self.engine
        s = e.stats
        return (len(e.running), len(e.waiting), e.model_runner.kv_cache.allocator.num_free,
                self.taken, s.graph_steps, s.eager_steps, s.prefill_steps)  # fmt: skip

    def _state(self) -> tuple:
        self._sent_state = self.state()
        return self._sent_state


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
        self.proc = ctx.Process(target=child_main, args=(to_r, from_w, spec),
                                name="stepgraph-engine")  # fmt: skip
        self.proc.start()
        to_r.close()  # the child's ends: its exit is an end of file here
        from_w.close()
        os.set_blocking(self.to_w.fileno(), False)
        self.sent = 0  # submissions handed to this process
        self.taken = 0  # of those, the ones it has read (its last state says)
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


__all__ = ["EngineLoop", "EngineProcess", "EngineSpec", "child_main", "engine_info",
           "finish_reason", "submit_fields"]  # fmt: skip
