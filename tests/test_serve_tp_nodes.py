"""`stepgraph serve --tp N` over several nodes (torchrun's static rendezvous): the flags' checks
(each limit, and one past it), the torchrun lines node 0 and node K run, the follower's
`stepgraph serve` line node 0 prints (it parses back to node 0's engine), a rank given another
engine than rank 0's, and two "nodes" on this machine over gloo: node 0 serving HTTP, node 1
its ranks only; their tokens equal the unsharded server's, and SIGTERM to node 0 ends both
nodes' processes."""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
import signal
import socket
import subprocess
import sys
import time

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
httpx = pytest.importorskip("httpx")

from stepgraph.cli import main as cli_main  # noqa: E402
from stepgraph.cli_args import Parser, UsageError  # noqa: E402
from stepgraph.errors import StepGraphError  # noqa: E402
from stepgraph.serve.cli import add_arguments, engine_spec, rendezvous  # noqa: E402
from stepgraph.serve.engine_proc import EngineSpec  # noqa: E402
from stepgraph.serve.tp import _check_group, _spec_differences  # noqa: E402
from stepgraph.serve.tp_launch import (  # noqa: E402
    MASTER_PORT,
    Rendezvous,
    descendants,
    follower_command,
    torchrun_command,
)
from tests.test_serve_cli import Served, gone  # noqa: E402
from tests.test_serve_tp import CONTEXT, MAX_RUNNING, _served_tokens, unsharded  # noqa: E402, F401

NODE = ["--model", "tiny", "--device", "cpu"]


def _args(*argv: str):
    p = Parser(prog="stepgraph serve")
    add_arguments(p)
    return p.parse_args([*NODE, *argv])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the flags ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, want",
    [
        ([], Rendezvous()),
        (["--tp", "2"], Rendezvous()),
        (  # --tp == --nnodes: one rank a node; the last node rank
            ["--tp", "2", "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1"],
            Rendezvous(2, 1, "10.0.0.1", MASTER_PORT),
        ),
        (
            ["--tp", "8", "--nnodes", "2", "--node-rank", "0", "--master-addr", "h"]
            + ["--master-port", "65535"],
            Rendezvous(2, 0, "h", 65535),
        ),
        (
            ["--tp", "4", "--nnodes", "2", "--node-rank", "0", "--master-addr", "h"]
            + ["--master-port", "1", "--rdzv-backend", "static"],
            Rendezvous(2, 0, "h", 1),
        ),
    ],
)
def test_rendezvous_flags_at_their_limits(argv, want):
    assert rendezvous(_args(*argv)) == want


@pytest.mark.parametrize(
    "argv, said",
    [
        (["--tp", "3", "--nnodes", "2", "--node-rank", "0", "--master-addr", "h"], "--nnodes"),
        (["--tp", "2", "--nnodes", "4", "--node-rank", "0", "--master-addr", "h"], "--nnodes"),
        (["--tp", "2", "--nnodes", "2", "--node-rank", "2", "--master-addr", "h"], "--node-rank"),
        (["--tp", "2", "--nnodes", "2", "--master-addr", "h"], "--node-rank"),
        (["--tp", "2", "--nnodes", "2", "--node-rank", "1"], "--master-addr"),
        (["--tp", "2", "--node-rank", "0"], "--node-rank"),
        (["--tp", "2", "--master-addr", "h"], "--master-addr"),
        (["--tp", "2", "--master-port", "29500"], "--master-port"),
        (["--tp", "2", "--nnodes", "2", "--node-rank", "0", "--rdzv-backend", "c10d"], "c10d"),
    ],
)
def test_rendezvous_flags_one_past_their_limits(argv, said):
    with pytest.raises(UsageError) as e:
        rendezvous(_args(*argv))
    assert said in str(e.value) and "\n" not in str(e.value), e.value


@pytest.mark.parametrize(
    "argv, said",
    [
        (["--tp", "3", "--nnodes", "2", "--node-rank", "0", "--master-addr", "h"], "--nnodes"),
        (["--tp", "2", "--nnodes", "2", "--node-rank", "2", "--master-addr", "h"], "--node-rank"),
        (["--tp", "2", "--nnodes", "0"], "--nnodes"),
        (["--tp", "2", "--nnodes", "2", "--node-rank", "-1"], "--node-rank"),
        (["--tp", "2", "--nnodes", "2", "--master-port", "0"], "--master-port"),
        (["--tp", "2", "--nnodes", "2", "--master-port", "65536"], "--master-port"),
        (["--tp", "2", "--nnodes", "2", "--rdzv-backend", "c10d"], "--rdzv-backend"),
    ],
)
def test_bad_node_flags_exit_2_with_one_line(argv, said, capsys):
    assert cli_main(["serve", *NODE, *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("stepgraph: error:") and "\n" not in err and said in err, err


# -- the command lines -------------------------------------------------------------------------


def _after(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


def test_torchrun_lines_of_node_0_and_node_k():
    spec = EngineSpec("tiny", "cpu", "float32", tp=4)
    one = torchrun_command(spec, "/tmp/s.sock")
    assert one[1:4] == ["-m", "torch.distributed.run", "--standalone"]
    assert _after(one, "--nproc-per-node") == "4" and "--nnodes" not in one
    rdzv = Rendezvous(2, 0, "10.0.0.1", 29400)
    node0 = torchrun_command(spec, "/tmp/s.sock", rdzv)
    nodek = torchrun_command(spec, None, dataclasses.replace(rdzv, node_rank=1))
    for cmd, k in ((node0, "0"), (nodek, "1")):
        launcher = cmd[: cmd.index("stepgraph.serve.tp")]
        assert "--standalone" not in launcher
        assert _after(launcher, "--nnodes") == "2" and _after(launcher, "--node-rank") == k
        assert _after(launcher, "--rdzv-backend") == "static"
        assert _after(launcher, "--master-addr") == "10.0.0.1"
        assert _after(launcher, "--master-port") == "29400"
        assert _after(launcher, "--nproc-per-node") == "2"  # tp / nnodes
        assert _after(launcher, "--max-restarts") == "0"
        assert EngineSpec(**json.loads(_after(cmd, "--spec"))) == spec
    assert _after(node0, "--connect") == "/tmp/s.sock" and "--connect" not in nodek
    with pytest.raises(ValueError, match="evenly"):
        torchrun_command(dataclasses.replace(spec, tp=3), None, rdzv)


@pytest.mark.parametrize(
    "flags",
    [
        [],
        ["--dtype", "bfloat16", "--mode", "eager", "--kernels", "reference", "--seed", "7"]
        + ["--max-prefill-tokens", "64", "--threads", "1", "--no-prefix-caching"],
    ],
)
def test_the_printed_follower_line_builds_node_0s_engine(flags):
    argv = ["--tp", "4", "--nnodes", "2", "--node-rank", "0", "--master-addr", "10.0.0.1"]
    args = _args(*argv, "--max-running", "8", "--max-context", "64", *flags)
    rdzv = rendezvous(args)
    spec = engine_spec(args, "cpu", args.dtype or "float32", 64)
    line = shlex.join(follower_command(spec, rdzv, 1))
    assert line.startswith("stepgraph serve ")
    back = _args(*shlex.split(line)[2:])
    assert rendezvous(back) == dataclasses.replace(rdzv, node_rank=1)
    assert engine_spec(back, back.device, back.dtype, back.max_context) == spec


def test_ranks_given_other_engines_are_named():
    a = dataclasses.asdict(EngineSpec("tiny", tp=2))
    assert _spec_differences([a, dict(a)]) is None
    diff = _spec_differences([a, dict(a), {**a, "max_running": 8, "seed": 1}])
    assert diff == "rank 2: max_running=8 (rank 0: 64), seed=1 (rank 0: 0)"


@pytest.mark.parametrize("rank, leads", [(0, False), (1, True)])
def test_global_rank_0_away_from_the_servers_node_is_refused(rank, leads):
    with pytest.raises(StepGraphError, match="rank 0 must run beside the HTTP front end"):
        _check_group(EngineSpec("tiny", tp=2), rank, leads)


# -- two nodes on this machine -----------------------------------------------------------------


def _follower(port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "stepgraph", "serve", *NODE, "--max-running", str(MAX_RUNNING)]
    cmd += ["--max-context", str(CONTEXT), "--tp", "2", "--nnodes", "2", "--node-rank", "1"]
    cmd += ["--master-addr", "127.0.0.1", "--master-port", str(port)]
    return subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


def test_two_nodes_serve_the_unsharded_servers_tokens_and_stop_together(unsharded):  # noqa: F811
    port = _free_port()
    follower = _follower(port)
    pids: list[int] = []
    try:
        flags = ["--max-context", str(CONTEXT), "--tp", "2", "--nnodes", "2", "--node-rank", "0"]
        flags += ["--master-addr", "127.0.0.1", "--master-port", str(port)]
        with Served(*flags, "--shutdown-timeout", "5", session=True) as node0:
            said = "".join(node0.err)
            line = shlex.split(re.search(r"node 1: (stepgraph serve .*)", said).group(1))
            assert line[-6:] == ["--node-rank", "1", "--master-addr", "127.0.0.1"] + [
                "--master-port",
                str(port),
            ]
            health = httpx.get(node0.url + "/health", timeout=10).json()
            ranks0, ranks1 = (_ranks(p) for p in (node0.proc.pid, follower.pid))
            assert len(ranks0) == 1 and len(ranks1) == 1, (ranks0, ranks1)  # one rank a node
            assert health["engine_pid"] == ranks0[0]  # global rank 0: on node 0
            pids = descendants(node0.proc.pid) + descendants(follower.pid)
            assert _served_tokens(node0.url) == unsharded
            node0.proc.send_signal(signal.SIGTERM)
            assert node0.proc.wait(60) == 0
        assert follower.wait(60) == 0, follower.stderr.read()  # the group stopped: it exits
        deadline = time.monotonic() + 10
        while not all(gone(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [p for p in pids if not gone(p)] == []
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.wait(10)
        for p in pids:
            if not gone(p):
                subprocess.run(["kill", "-9", str(p)], check=False)


def _ranks(pid: int) -> list[int]:
    """The ranks among ``pid``'s descendants (not torchrun, whose line names them too)."""
    return [
        p
        for p in descendants(pid)
        if "stepgraph.serve.tp" in (c := _cmdline(p)) and "torch.distributed.run" not in c
    ]


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""
