"""The one engine loop of `stepgraph serve` (``serve/loop.py``) over in-memory boxes, and the
``EngineClient`` both transports are: one message per step with every request's new tokens,
the same tokens as ``Engine.generate``, aborts, refusals, faults and stop freeing every page;
the thread transport refuses what is still in flight when it stops."""

from __future__ import annotations

import asyncio
from collections import deque
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("starlette")

from stepgraph.engine import Engine  # noqa: E402
from stepgraph.model import ModelRunner  # noqa: E402
from stepgraph.serve import engine_proc, worker  # noqa: E402
from stepgraph.serve.client import EngineClient, FrontEnd  # noqa: E402
from stepgraph.serve.engine_proc import EngineSpec  # noqa: E402
from stepgraph.serve.errors import ServerBusy  # noqa: E402
from stepgraph.serve.loop import (  # noqa: E402
    ABORT,
    FAULT,
    REJECT,
    STEP,
    STOP,
    SUBMIT,
    EngineLoop,
    submit_fields,
)
from stepgraph.serve.proc_worker import ProcessWorker  # noqa: E402
from stepgraph.serve.worker import EngineWorker  # noqa: E402

from .serve_hooks import FAULT as FAULT_ID  # noqa: E402
from .serve_hooks import STALL, arm  # noqa: E402

VOCAB = 512


def _engine() -> Engine:
    mr = ModelRunner.from_preset("tiny", "cpu", torch.float32, max_bs=4, max_context_len=64)
    return Engine(mr, "eager")


def _fields(prompt, max_tokens, temperature=0.0, seed=None, cache_salt=None):
    p = SimpleNamespace(
        prompt_ids=prompt,
        max_tokens=max_tokens,
        stop_ids=None,
        ignore_eos=True,
        min_tokens=0,
        seed=seed,
        temperature=temperature,
        top_k=None,
        cache_salt=cache_salt,
    )
    return submit_fields(p)


class _Inbox:
    """The commands queued now; once they are read, an idle loop's next read is ``STOP``."""

    def __init__(self, *cmds) -> None:
        self.cmds = deque(cmds)

    def recv(self) -> tuple:
        return self.cmds.popleft() if self.cmds else (STOP,)

    def poll(self) -> bool:
        return bool(self.cmds)


class _Outbox:
    def __init__(self) -> None:
        self.msgs: list[tuple] = []

    def send(self, msg: tuple) -> None:
        self.msgs.append(msg)


def _run(engine: Engine, *cmds) -> list[tuple]:
    out = _Outbox()
    EngineLoop(engine, _Inbox(*cmds), out).run()
    kv = engine.model_runner.kv_cache
    assert kv.allocator.num_free == kv.num_pages - 1  # every page back after STOP (cleared)
    running, waiting, free, *_ = out.msgs[-1][2]
    assert (running, waiting, free) == (0, 0, kv.num_pages - 1)  # its last state says so
    return out.msgs


def _tokens(msgs: list[tuple]) -> tuple[dict[int, list[int]], dict[int, str]]:
    toks: dict[int, list[int]] = {}
    reasons: dict[int, str] = {}
    for msg in msgs:
        if msg[0] != STEP:
            continue
        fids = [fid for fid, *_ in msg[1]]
        assert len(fids) == len(set(fids))  # one item per request and step
        for fid, new, reason, _cached in msg[1]:
            assert fid not in reasons  # nothing after its finish reason
            toks.setdefault(fid, []).extend(new)
            if reason is not None:
                reasons[fid] = reason
    return toks, reasons


def test_one_message_per_step_with_the_tokens_generate_gives():
    prompts, budgets = [[1, 2, 3], [4, 5]], [4, 3]
    want = [_engine().generate([p], n, ignore_eos=True)[0] for p, n in zip(prompts, budgets)]
    msgs = _run(_engine(), (SUBMIT, 7, _fields(prompts[0], 4)), (SUBMIT, 9, _fields(prompts[1], 3)))
    toks, reasons = _tokens(msgs)
    assert toks == {7: want[0], 9: want[1]}
    assert reasons == {7: "length", 9: "length"}
    steps = [m for m in msgs if m[0] == STEP and m[1]]
    assert max(len(new) for m in steps for _, new, *_ in m[1]) == 1  # a token a step each
    assert msgs[-1][2][3] == 2  # both submissions taken


def test_the_loop_serves_with_what_was_alive_before_it_frozen_out_of_the_collector():
    import gc

    engine, seen = _engine(), []
    frozen_before = gc.get_freeze_count()

    class Watching(_Inbox):
        def recv(self) -> tuple:
            seen.append(gc.get_freeze_count())
            return super().recv()

    want = _engine().generate([[1, 2, 3]], 4, ignore_eos=True)[0]
    out = _Outbox()
    EngineLoop(engine, Watching((SUBMIT, 7, _fields([1, 2, 3], 4))), out).run()
    assert seen and min(seen) > frozen_before  # the model and the engine among them
    assert gc.get_freeze_count() == 0  # thawed when it returns
    assert _tokens(out.msgs)[0] == {7: want}  # the same tokens


def test_an_abort_before_it_runs_frees_it_and_an_unknown_id_is_ignored():
    msgs = _run(
        _engine(),
        (SUBMIT, 1, _fields([1, 2], 40)),
        (ABORT, 1),
        (ABORT, 99),
        (SUBMIT, 2, _fields([3], 2)),
    )
    toks, reasons = _tokens(msgs)
    assert 1 not in toks and reasons == {2: "length"} and len(toks[2]) == 2


def test_a_request_the_engine_refuses_is_rejected_and_the_others_run():
    msgs = _run(_engine(), (SUBMIT, 1, _fields([1, VOCAB], 2)), (SUBMIT, 2, _fields([3], 2)))
    rejects = [m for m in msgs if m[0] == REJECT]
    assert [m[1] for m in rejects] == [1] and "token ids outside" in rejects[0][2]
    assert _tokens(msgs)[1] == {2: "length"}


def test_a_step_fault_fails_what_runs_and_the_loop_serves_the_next():
    engine = _engine()
    arm(engine)  # a request whose prompt starts with FAULT_ID fails every step it runs in
    inbox = _Inbox((SUBMIT, 1, _fields([FAULT_ID, 2], 8)), (SUBMIT, 2, _fields([3, 4], 8)))
    out = _Outbox()
    loop = EngineLoop(engine, inbox, out)
    sent = out.send

    def then_more(msg):  # once the fault is out, a new request comes
        sent(msg)
        if msg[0] == FAULT:
            inbox.cmds.append((SUBMIT, 3, _fields([5, 6], 3)))

    out.send = then_more
    loop.run()
    faults = [m for m in out.msgs if m[0] == FAULT]
    assert len(faults) == 1 and sorted(faults[0][1]) == [1, 2]
    assert faults[0][2].startswith("RuntimeError: injected decode fault")
    toks, reasons = _tokens(out.msgs)
    assert reasons == {3: "length"} and len(toks[3]) == 3
    kv = engine.model_runner.kv_cache
    assert kv.allocator.num_free == kv.num_pages - 1


def test_both_transports_are_engine_clients_over_the_one_front_end():
    thread = EngineWorker(_engine)
    proc = ProcessWorker(EngineSpec("tiny", "cpu", "float32", "eager", 4, 64, warmup=False))
    for w in (thread, proc):
        assert isinstance(w, EngineClient) and isinstance(w, FrontEnd)
        assert type(w)._handle is FrontEnd._handle  # the same answers, however they crossed
    assert thread.pid is None  # no engine process
    assert not isinstance(FrontEnd(), EngineClient)  # a transport adds start, stop, alive
    assert worker.EngineLoop is engine_proc.EngineLoop is EngineLoop  # one loop, two homes


def _stalled_engine() -> Engine:
    engine = _engine()
    arm(engine)  # a prompt that starts with STALL sleeps in every step it runs in
    return engine


def test_the_thread_transport_refuses_what_is_in_flight_when_it_stops():
    w = EngineWorker(_stalled_engine).start(timeout=60)
    params = SimpleNamespace(
        prompt_ids=[STALL, 2, 3],
        max_tokens=60,
        stop_ids=None,
        ignore_eos=True,
        min_tokens=0,
        seed=None,
        temperature=0.0,
        top_k=None,
        cache_salt=None,
    )

    async def go():
        loop = asyncio.get_running_loop()
        w.attach(loop)
        stream = w.submit(params, loop, 0.0)
        first = await stream.queue.get()
        await loop.run_in_executor(None, w.stop, 30)
        items = [first]
        while items[-1][1] is None and items[-1][2] is None:
            items.append(await asyncio.wait_for(stream.queue.get(), 30))
        return items

    try:
        items = asyncio.run(go())
    finally:
        w.stop(30)
    assert items[0][0] and items[0][2] is None  # a token came first
    last = items[-1]  # stopped long before its 60th token (each step sleeps): refused, 503
    assert last[1] is None and isinstance(last[2], ServerBusy), last
    assert "shutting down" in str(last[2]) and sum(len(i[0]) for i in items) < 60
    kv = w.engine.model_runner.kv_cache
    assert kv.allocator.num_free == kv.num_pages - 1 and not w.alive
