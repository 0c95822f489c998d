"""The one engine loop of `stepgraph serve`, the same on an engine thread (``worker.py``) and in
an engine process (``engine_proc.py``): only how its messages cross differs.

``EngineLoop`` is the engine's only caller (the thread rule). It reads commands from an
``Inbox``, ``(SUBMIT, id, fields)``, ``(ABORT, id)`` and ``(STOP,)``, where ``id`` is the front
end's id of the request, and answers through an ``Outbox`` with **one message per engine step**
carrying every request's new tokens, ``(STEP, [(id, tokens, finish reason or None, cached
prompt tokens or None), ...], state)`` (the cached tokens with a request's first tokens), where
``state`` is ``(running, waiting in the engine, KV pages free or evictable, submissions taken,
graph steps, eager steps, prefill steps, prefix cache queries, prefix cache hits)`` (queries
and hits in prompt tokens, since the engine was built); ``(FAULT, ids, text, state)`` when a step
raised (the engine has dropped those requests and freed their pages already: ``Engine.step``;
the loop carries on), ``(REJECT, id, text)`` for a request the engine refused. Idle, it blocks
on its inbox; busy, it polls it between steps. ``STOP`` aborts what is left (every page back
once the device is idle) and returns; the caller then shuts the engine down.

The transport around it says ``(READY, info)`` once the engine is built (``engine_info``), or
``(FAILED, text)``.
"""

from __future__ import annotations

import gc
import logging
import os
from typing import Any, Protocol

SUBMIT, ABORT, STOP = "submit", "abort", "stop"
READY, FAILED, STEP, FAULT, REJECT = "ready", "failed", "step", "fault", "reject"
log = logging.getLogger("stepgraph.serve")


class Inbox(Protocol):
    """Where the loop reads commands: a pipe's end, or a queue on the engine thread."""

    def recv(self) -> tuple: ...  # blocks until a command comes

    def poll(self) -> bool: ...  # a command is there now (never blocks)


class Outbox(Protocol):
    """Where the loop writes its answers: a pipe's end, or the event loop's thread."""

    def send(self, msg: tuple) -> None: ...


def finish_reason(req: Any) -> str:
    """ "stop" when the last token is a stop id that counted (``min_tokens`` met), else
    "length"."""
    out = req.output
    counted = len(out) >= max(req.min_tokens, 1)
    return "stop" if out and counted and out[-1] in req.stop_ids else "length"


def engine_info(engine: Any) -> dict:
    """What the front end needs to check requests: the vocabulary, the longest request the
    engine can ever hold (positions, one request's KV, the whole cache), the KV pages, and the
    id of the process the engine runs in."""
    mr, kv = engine.model_runner, engine.model_runner.kv_cache
    room = min(
        mr.config.max_position_embeddings, kv.max_context_len, (kv.num_pages - 1) * kv.page_size
    )
    return {
        "vocab": mr.config.vocab_size,
        "room": room,
        "kv_pages_total": kv.num_pages - 1,
        "pid": os.getpid(),
    }


def submit_fields(p: Any) -> tuple:
    """The parts of a ``GenParams`` the engine needs, as sent to the loop."""
    return (
        p.prompt_ids,
        p.max_tokens,
        p.stop_ids,
        p.ignore_eos,
        p.min_tokens,
        p.seed,
        p.temperature,
        p.top_k,
        p.cache_salt,
    )


def add_request(engine: Any, fields: tuple) -> int:
    """``engine.add_request`` of ``submit_fields``; its own sampling only when not greedy."""
    from ..engine import Sampling

    prompt, max_tokens, stop_ids, ignore_eos, min_tokens, seed, temperature, top_k, salt = fields
    sampling = Sampling(temperature, top_k) if temperature > 0 else None
    return engine.add_request(
        prompt,
        max_tokens,
        stop_ids=stop_ids,
        ignore_eos=ignore_eos,
        min_tokens=min_tokens,
        seed=seed,
        sampling=sampling,
        cache_salt=salt,
    )


class EngineLoop:
    """The step loop over ``inbox`` (commands) and ``outbox`` (answers)."""

    fatal_step_errors = False  # True: a step that raises ends the loop (tensor-parallel ranks)

    def __init__(self, engine: Any, inbox: Inbox, outbox: Outbox) -> None:
        self.engine, self.inbox, self.outbox = engine, inbox, outbox
        self.ids: dict[int, int] = {}  # engine request id -> front end id
        self.rids: dict[int, int] = {}  # front end id -> engine request id
        self.taken = 0
        self._sent_state: tuple | None = None
        self._started: set[int] = set()  # engine ids whose first tokens (and hits) were sent

    def run(self) -> None:
        """Serve the inbox until ``STOP``; every request left is aborted, its pages freed.

        What is alive when it starts (the model, the warm-up's objects) is frozen out of the
        garbage collector's passes until it returns (``gc.freeze``): a full pass walked it all
        while every running request waited (45 ms on the CPU with torch and the tiny model)."""
        gc.collect()
        gc.freeze()
        try:
            self._serve()
        finally:
            gc.unfreeze()

    def _serve(self) -> None:
        engine = self.engine
        while True:
            if not engine.has_unfinished:
                engine.drain()  # pages of the last step back before sleeping
                if self.state() != self._sent_state:
                    self.outbox.send((STEP, [], self._state()))
            for cmd in self._commands(idle=not engine.has_unfinished):
                if cmd[0] == STOP:
                    engine.abort_all()
                    self.outbox.send((STEP, [], self._state()))
                    return
                if cmd[0] == SUBMIT:
                    self._add(cmd[1], cmd[2])
                else:
                    rid = self.rids.pop(cmd[1], None)
                    if rid is not None:
                        engine.abort(rid)
                        del self.ids[rid]
                        self._started.discard(rid)
            if not engine.has_unfinished:
                continue
            try:
                pairs = engine.step()
            except Exception as e:  # the engine freed every page already (Engine.step)
                if self.fatal_step_errors:
                    raise
                log.exception("engine step failed; failing %d requests", len(self.ids))
                text = f"{type(e).__name__}: {e}"
                self.outbox.send((FAULT, list(self.ids.values()), text, self._state()))
                self.ids.clear()
                self.rids.clear()
                self._started.clear()
                continue
            self.outbox.send((STEP, self._items(pairs), self._state()))

    def _commands(self, idle: bool) -> list[tuple]:
        """The commands to apply before this step: idle, block until one comes; busy, those
        there now (maybe none)."""
        cmds = [self.inbox.recv()] if idle else []
        while self.inbox.poll():
            cmds.append(self.inbox.recv())
        return cmds

    def _add(self, fid: int, fields: tuple) -> None:
        self.taken += 1
        try:
            rid = add_request(self.engine, fields)
        except Exception as e:  # the front end's checks should have caught it
            self.outbox.send((REJECT, fid, str(e)))
            return
        self.ids[rid], self.rids[fid] = fid, rid

    def _items(self, pairs: list[tuple[int, int]]) -> list[tuple]:
        """Each request's new tokens of this step, with its finish reason once it ended, and
        with its first tokens the prompt tokens it found in the prefix cache."""
        new: dict[int, list[int]] = {}
        for rid, tok in pairs:
            new.setdefault(rid, []).append(tok)
        items = []
        finished, live = self.engine.finished, None
        for rid, toks in new.items():
            req = finished.pop(rid, None)
            fid = self.ids.get(rid)
            if fid is None:
                continue
            cached = None
            if rid not in self._started:
                self._started.add(rid)
                if req is None:
                    e = self.engine
                    live = live or {r.rid: r for r in (*e.running, *e._draining)}
                    req_now = live.get(rid)
                else:
                    req_now = req
                cached = getattr(req_now, "cached_tokens", 0)
            reason = None
            if req is not None:
                reason = finish_reason(req)
                del self.ids[rid], self.rids[fid]
                self._started.discard(rid)
            items.append((fid, toks, reason, cached))
        return items

    def state(self) -> tuple:
        e = self.engine
        s = e.stats
        return (
            len(e.running),
            len(e.waiting),
            e.prefix_cache.num_available,  # free, or cached and unreferenced
            self.taken,
            s.graph_steps,
            s.eager_steps,
            s.prefill_steps,
            s.queried_tokens,
            s.cached_tokens,
        )

    def _state(self) -> tuple:
        self._sent_state = self.state()
        return self._sent_state


__all__ = [
    "ABORT",
    "FAILED",
    "FAULT",
    "READY",
    "REJECT",
    "STEP",
    "STOP",
    "SUBMIT",
    "EngineLoop",
    "Inbox",
    "Outbox",
    "add_request",
    "engine_info",
    "finish_reason",
    "submit_fields",
]
