"""`stepgraph serve --tp N`: the engine as N tensor-parallel ranks, one process per device, that
torchrun starts (``python -m torch.distributed.run``; NCCL on CUDA, gloo on the CPU).

The front end (the HTTP process) is a ``ProcessWorker`` whose engine process is a rank group
(``RankGroup``): it runs torchrun as a child, in a process group of its own (setsid), with ``-m
stepgraph.serve.tp``. Each rank builds its shard of the model and an ``Engine`` over it; rank 0
connects back to the front end over a Unix socket (two connections: answers, commands) and runs
the same ``EngineLoop`` an engine process runs. The other ranks run it too, over no pipe: once per
iteration rank 0 broadcasts the commands it read (submissions, aborts, stop) over the schedule's
gloo group (``TPEngineLoop``), every rank applies them in the same order, and every rank steps;
inside the step ``engine/tp_sync.py`` broadcasts rank 0's admission and checks the schedule.
Idle, rank 0 broadcasts an empty list every ``HEARTBEAT_S`` seconds, so a follower never waits
on a collective longer than its timeout.

Faults: a step that raises on any rank ends that rank (``fatal_step_errors``); torchrun then ends
the others (``--max-restarts 0``) and exits; the front end sees it, fails the requests in flight
with a 500 and starts the whole group again, answering 503 until it is ready, as it does for one
engine process. Stopping: ``STOP`` reaches every rank through the broadcast; each leaves the
process group and exits, then torchrun does; a group that does not is killed, ranks first (each
is a process group of its own, setsid; their ids are read from ``/proc``). If the front end goes
away, rank 0 reads the end of its socket and stops every rank the same way.

Across nodes (``tp_launch.py``): node 0 runs the front end and its share of the ranks, the
others ``tp_launch.follow``. Every rank checks before building that global rank 0 is node 0's
first (the one that reaches the front end's socket) and that all ranks were given the same
``EngineSpec``."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import logging
import os
import pickle
import select
import shutil
import socket
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from typing import Any

import torch

from .engine_proc import EngineProcess, EngineSpec
from .loop import FAILED, READY, STOP, EngineLoop, engine_info
from .proc_worker import MAX_RESTARTS, ProcessWorker
from .tp_launch import Launcher, Rendezvous, descendants, torchrun_command

HEARTBEAT_S = 2.0  # idle, rank 0 tells the other ranks so this often
log = logging.getLogger("stepgraph.serve")


# -- the ranks ---------------------------------------------------------------------------------


class _NoOutbox:
    """A follower's answers: nobody reads them."""

    def send(self, msg: tuple) -> None:
        pass


class TPEngineLoop(EngineLoop):
    """The engine loop on one rank. Rank 0 reads ``inbox`` and broadcasts what it read over
    ``group`` (gloo); the others apply what rank 0 broadcast (``inbox`` None). A step that
    raises ends the loop on that rank: the group cannot go on without it."""

    fatal_step_errors = True

    def __init__(self, engine: Any, inbox: Any, outbox: Any, group: Any) -> None:
        super().__init__(engine, inbox, outbox if outbox is not None else _NoOutbox())
        import torch.distributed as dist

        self._dist, self.group = dist, group
        self.rank = dist.get_rank()

    def _commands(self, idle: bool) -> list[tuple]:
        if self.rank != 0:
            return self._receive()
        cmds: list[tuple] = []
        try:
            if not idle or self.inbox.poll(HEARTBEAT_S):
                cmds = super()._commands(idle)
        except (EOFError, OSError):  # the front end went away: stop every rank
            cmds = [(STOP,)]
        self._share(cmds)
        return cmds

    def _share(self, cmds: list[tuple]) -> None:
        data = pickle.dumps(cmds, pickle.HIGHEST_PROTOCOL) if cmds else b""
        size = torch.tensor([len(data)], dtype=torch.long)
        self._dist.broadcast(size, src=0, group=self.group)
        if data:
            payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            self._dist.broadcast(payload, src=0, group=self.group)

    def _receive(self) -> list[tuple]:
        size = torch.zeros(1, dtype=torch.long)
        self._dist.broadcast(size, src=0, group=self.group)
        if not int(size):
            return []
        payload = torch.empty(int(size), dtype=torch.uint8)
        self._dist.broadcast(payload, src=0, group=self.group)
        return pickle.loads(payload.numpy().tobytes())


def _spec_differences(specs: list[dict]) -> str | None:
    """What the ranks' specs (``specs[r]``: rank r's fields) differ in from rank 0's, or None."""
    diffs = []
    for r, other in enumerate(specs[1:], 1):
        fields = [k for k in specs[0] if other.get(k) != specs[0][k]]
        if fields:
            said = ", ".join(f"{k}={other.get(k)!r} (rank 0: {specs[0][k]!r})" for k in fields)
            diffs.append(f"rank {r}: {said}")
    return "; ".join(diffs) or None


def _check_group(spec: EngineSpec, rank: int, leads: bool) -> None:
    """Rank 0 is the front end's node's first rank (``leads``), and every rank builds the same
    engine as rank 0 (the nodes' commands may differ); raises ``StepGraphError`` naming what
    is wrong."""
    import torch.distributed as dist

    from ..errors import StepGraphError
    from ..model.distributed import init_distributed

    if (rank == 0) != leads:
        raise StepGraphError(
            f"global rank {rank} is{' not' if leads else ''} the first rank of the server's "
            "node: rank 0 must run beside the HTTP front end (its socket is local). Start the "
            "server's node as node rank 0 of a static rendezvous (torchrun numbers ranks node "
            "by node in node-rank order)."
        )
    init_distributed("nccl" if torch.device(spec.device).type == "cuda" else "gloo")
    specs: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(specs, dataclasses.asdict(spec))
    if (diff := _spec_differences(specs)) is not None:
        raise StepGraphError(
            f"the ranks were not given the same engine: {diff}; start every node with the "
            "same model, device, dtype, mode, limits and seed as node 0"
        )


def rank_main(argv: list[str] | None = None) -> int:
    """One rank (``python -m stepgraph.serve.tp --spec JSON [--connect PATH]``, under
    torchrun): build the shard and the engine, then serve; rank 0 over ``--connect``, which
    the front end's node passes to all its ranks (its first one connects)."""
    from ..model.launch import finish

    p = argparse.ArgumentParser(prog="python -m stepgraph.serve.tp")
    p.add_argument("--spec", required=True, help="the EngineSpec's fields, as JSON")
    p.add_argument("--connect", default=None, help="rank 0: the front end's Unix socket")
    args = p.parse_args(argv)
    spec = EngineSpec(**json.loads(args.spec))
    rank = int(os.environ.get("RANK", "0"))
    leads = bool(args.connect) and os.environ.get("LOCAL_RANK", "0") == "0"
    logging.basicConfig(format=f"stepgraph rank {rank}: %(message)s")
    outbox = inbox = None
    if rank == 0 and leads:  # before building: a failed build is told to the front end
        outbox, inbox = (_connect(args.connect) for _ in range(2))
    try:
        _check_group(spec, rank, leads)
        engine = spec()
    except BaseException as e:
        if outbox is not None:
            with contextlib.suppress(OSError):
                outbox.send((FAILED, f"rank {rank}: {type(e).__name__}: {e}"))
        raise
    import torch.distributed as dist

    group = engine._sync.group if engine._sync is not None else None
    pids: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(pids, os.getpid(), group=group)
    if outbox is not None:
        outbox.send((READY, {**engine_info(engine), "rank_pids": pids}))
    try:
        TPEngineLoop(engine, inbox, outbox, group).run()
    except (EOFError, OSError):  # rank 0: the front end went away after the stop went out
        pass
    except BaseException:  # the group cannot go on: torchrun ends the other ranks
        log.exception("rank %d failed; the rank group stops", rank)
        sys.stderr.flush()
        os._exit(1)
    engine.shutdown()
    finish()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # gloo's threads may abort an interpreter exit (model/launch.py)


def _connect(path: str) -> Connection:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    return Connection(s.detach())


# -- the front end's side ----------------------------------------------------------------------


class _Unconnected:
    """Rank 0's answers before it connected: nothing to read."""

    def poll(self, timeout: float | None = None) -> bool:
        return False

    def close(self) -> None:
        pass


class RankGroup(EngineProcess):
    """The ranks of one start, as the front end holds an engine process: torchrun (``proc``)
    and rank 0's two connections, accepted on ``listener`` once rank 0 made them (``from_r``:
    its answers; ``to_w``: commands, written without blocking, buffered until then)."""

    def __init__(self, spec: EngineSpec, path: str, rendezvous: Rendezvous | None = None) -> None:
        self.path = path
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(2)
        self.listener.setblocking(False)
        self._conns: list[Connection] = []
        self.from_r: Any = _Unconnected()
        self.to_w: Any = None
        self.dead = self._writing = False
        self._out = bytearray()
        self._loop: Any = None
        self.proc = Launcher(torchrun_command(spec, path, rendezvous))

    @property
    def connected(self) -> bool:
        return self.to_w is not None

    def accept(self) -> bool:
        """Take rank 0's connections that are there (never blocks); True once both are."""
        while len(self._conns) < 2 and not self.dead:
            try:
                s, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return False
            s.setblocking(True)
            self._conns.append(Connection(s.detach()))
        if self.dead:
            return False
        self.from_r, self.to_w = self._conns
        os.set_blocking(self.to_w.fileno(), False)
        self._close_listener()
        self._flush()
        return True

    def wait_connected(self, timeout: float | None) -> bool:
        """Block until rank 0 connected (True), torchrun exited, or ``timeout`` s passed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.accept():
            if not self.proc.is_alive():
                return False
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            select.select([self.listener, self.proc.sentinel], [], [], left)
        return True

    def _flush(self) -> None:
        if self.to_w is not None:
            super()._flush()

    def _close_listener(self) -> None:
        if self.listener.fileno() >= 0:
            self.listener.close()
            with contextlib.suppress(OSError):
                os.unlink(self.path)

    def close(self) -> None:
        if self._writing and not self._loop.is_closed():
            self._loop.remove_writer(self.to_w.fileno())
        self.dead, self._writing = True, False
        for conn in (*self._conns, self.from_r):
            conn.close()
        self._close_listener()
        self.proc.close()


class TPWorker(ProcessWorker):
    """The front end over a rank group of ``spec.tp`` ranks: a ``ProcessWorker`` whose engine
    process is a ``RankGroup`` (restarted whole, at most ``max_restarts`` times), this node's
    ranks of a group over ``rendezvous`` (default: this node alone)."""

    def __init__(
        self,
        spec: EngineSpec,
        metrics: Any = None,
        max_restarts: int = MAX_RESTARTS,
        rendezvous: Rendezvous | None = None,
    ):
        super().__init__(spec, metrics, max_restarts)
        self.rendezvous = rendezvous or Rendezvous()
        self._dir = tempfile.mkdtemp(prefix="stepgraph-tp-")  # 0700: only this user connects
        self._starts = itertools.count()

    def _spawn(self) -> RankGroup:
        path = os.path.join(self._dir, f"rank0-{next(self._starts)}.sock")
        return RankGroup(self.spec, path, self.rendezvous)

    def _first(self, ch: RankGroup, timeout: float | None) -> tuple | None:
        t = time.monotonic()
        if not ch.wait_connected(timeout):
            return None
        return super()._first(ch, None if timeout is None else timeout - time.monotonic() + t)

    def _watch(self, ch: RankGroup) -> None:
        self._loop.add_reader(ch.proc.sentinel, self._exited, ch)
        if ch.connected:
            self._watch_answers(ch)
        else:
            self._loop.add_reader(ch.listener.fileno(), self._accept, ch)

    def _accept(self, ch: RankGroup) -> None:
        fd = ch.listener.fileno()
        if ch.accept():
            self._loop.remove_reader(fd)
            self._watch_answers(ch)

    def _watch_answers(self, ch: RankGroup) -> None:
        ch.attach(self._loop)
        self._loop.add_reader(ch.from_r.fileno(), self._readable, ch)

    def _unwatch(self, ch: RankGroup) -> None:
        self._loop.remove_reader(ch.proc.sentinel)
        if ch.connected:
            self._loop.remove_reader(ch.from_r.fileno())
        elif ch.listener.fileno() >= 0:
            self._loop.remove_reader(ch.listener.fileno())

    @property
    def rank_pids(self) -> list[int]:
        """The ranks' process ids, as the group that is ready said."""
        return list(self.info.get("rank_pids", []))

    @property
    def launcher_pid(self) -> int | None:
        return None if self._child is None else self._child.proc.pid

    def stop(self, timeout: float | None = None) -> None:
        ch = self._child
        if ch is not None and not ch.dead and not ch.connected:  # still building: no stop
            ch.proc.kill()
        super().stop(timeout)
        shutil.rmtree(self._dir, ignore_errors=True)


__all__ = [
    "HEARTBEAT_S",
    "Launcher",
    "RankGroup",
    "Rendezvous",
    "TPEngineLoop",
    "TPWorker",
    "descendants",
    "rank_main",
    "torchrun_command",
]

if __name__ == "__main__":
    sys.exit(rank_main())
