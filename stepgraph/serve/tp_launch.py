"""How `stepgraph serve --tp N` starts its ranks through torchrun (``python -m
torch.distributed.run``), on one node or over several: ``Rendezvous`` (torchrun's standalone
rendezvous on one node; its static one over nodes, node 0 hosting the store), the torchrun line
of this node's ranks (``torchrun_command``), the `stepgraph serve` line another node runs to join
(``follower_command``), ``Launcher`` (torchrun as the front end holds it, killed ranks first) and
``follow``, the body of a node other than node 0: its ranks and no front end.

Rank 0 must be on node 0, beside the front end (its Unix socket is local). torchrun's static
rendezvous numbers ranks node by node in node-rank order (each node's agent takes the ranks
after those of the nodes ranked before it), so node rank 0's local rank 0 is global rank 0;
c10d's dynamic rendezvous orders nodes by their ids instead, so it is not used (the CLI refuses
it) and each rank checks (``tp.rank_main``)."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import logging
import os
import signal
import subprocess
import sys
import time
from typing import Any

from .engine_proc import EngineSpec
from .proc_worker import MAX_RESTARTS

log = logging.getLogger("stepgraph.serve")

MASTER_PORT = 29500  # torchrun's default


@dataclasses.dataclass(frozen=True)
class Rendezvous:
    """Where this node's ranks meet the others: ``nnodes`` nodes, this one ``node_rank``, node
    0's store at ``master_addr:master_port`` (torchrun's static rendezvous). One node: the
    standalone rendezvous on a free port."""

    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = MASTER_PORT

    def torchrun_args(self) -> list[str]:
        if self.nnodes == 1:
            return ["--standalone"]
        return [
            "--nnodes",
            str(self.nnodes),
            "--node-rank",
            str(self.node_rank),
            "--rdzv-backend",
            "static",  # ranks numbered in node-rank order: node 0's first is global rank 0
            "--master-addr",
            self.master_addr,
            "--master-port",
            str(self.master_port),
        ]


def torchrun_command(
    spec: EngineSpec, connect: str | None, rendezvous: Rendezvous | None = None
) -> list[str]:
    """The torchrun line that starts this node's ``spec.tp / nnodes`` ranks (``connect``: the
    front end's socket, on node 0 only)."""
    rdzv = rendezvous or Rendezvous()
    if spec.tp % rdzv.nnodes:
        raise ValueError(f"tp={spec.tp} ranks do not split evenly over {rdzv.nnodes} nodes")
    cmd = [sys.executable, "-m", "torch.distributed.run", *rdzv.torchrun_args()]
    cmd += ["--nproc-per-node", str(spec.tp // rdzv.nnodes), "--max-restarts", "0"]
    cmd += ["--monitor-interval", "0.1"]
    cmd += ["-m", "stepgraph.serve.tp", "--spec", json.dumps(dataclasses.asdict(spec))]
    return cmd + (["--connect", connect] if connect else [])


def follower_command(spec: EngineSpec, rendezvous: Rendezvous, node_rank: int) -> list[str]:
    """The `stepgraph serve` line node ``node_rank`` runs to join node 0's rank group (the
    engine's flags from ``spec``, so that it builds the same shards)."""
    cmd = ["stepgraph", "serve", "--model", spec.model, "--device", spec.device]
    cmd += ["--dtype", spec.dtype, "--mode", spec.mode, "--max-running", str(spec.max_running)]
    cmd += ["--max-context", str(spec.context), "--seed", str(spec.seed)]
    for flag, value in (
        ("--kernels", spec.kernels),
        ("--max-prefill-tokens", spec.max_prefill_tokens),
        ("--threads", spec.threads),
    ):
        cmd += [flag, str(value)] if value is not None else []
    cmd += [] if spec.prefix_caching else ["--no-prefix-caching"]
    cmd += ["--tp", str(spec.tp), "--nnodes", str(rendezvous.nnodes)]
    cmd += ["--node-rank", str(node_rank), "--master-addr", rendezvous.master_addr]
    return cmd + ["--master-port", str(rendezvous.master_port)]


def follow(
    spec: EngineSpec, rendezvous: Rendezvous, restarts: int = MAX_RESTARTS, pause: float = 1.0
) -> int:
    """Node ``rendezvous.node_rank`` > 0: run its ranks until the group stops (0). A group that
    ended in a fault is joined again (node 0's front end restarts it), at most ``restarts``
    times, ``pause`` s after, then its status is returned. SIGTERM/SIGINT end the ranks: 0."""
    stopping = False
    launcher: Launcher | None = None

    def stop(*_: Any) -> None:
        nonlocal stopping
        stopping = True
        if launcher is not None:
            for pid in [*descendants(launcher.pid), launcher.pid]:  # the ranks first
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    old = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        for attempt in itertools.count():
            launcher = Launcher(torchrun_command(spec, None, rendezvous))
            status = launcher.popen.wait()
            launcher.close()
            if stopping or status == 0:
                return 0
            if attempt >= restarts:
                log.error("the rank group ended (status %s); no more restarts", status)
                return status if status > 0 else 1
            log.warning("the rank group ended (status %s); joining it again", status)
            time.sleep(pause)
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    return 1


def descendants(pid: int) -> list[int]:
    """The ids of ``pid``'s children, theirs, and so on (from ``/proc``), deepest last."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            parents.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        kids = parents.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


class Launcher:
    """torchrun, as ``EngineProcess.proc``: ``sentinel`` (a pidfd, readable once it exited),
    ``is_alive``, ``join``, ``exitcode``, ``kill`` (the ranks first, then torchrun)."""

    def __init__(self, cmd: list[str]) -> None:
        self.popen = subprocess.Popen(cmd, start_new_session=True)  # no terminal's Ctrl-C
        self.pid = self.popen.pid
        self.sentinel = os.pidfd_open(self.pid)

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def join(self, timeout: float | None = None) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout)

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def kill(self) -> None:
        for pid in [*descendants(self.pid), self.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.join(5)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.sentinel)


__all__ = [
    "MASTER_PORT",
    "Launcher",
    "Rendezvous",
    "descendants",
    "follow",
    "follower_command",
    "torchrun_command",
]
