"""`stepgraph generate --tp 2` under torchrun on the CPU (gloo, the CPU graph stand-in): the
tokens equal the unsharded run's, and only rank 0 prints."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ARGS = [
    "generate",
    "--device",
    "cpu",
    "--model",
    "tiny",
    "--prompt-ids",
    "5,9,3,7;4,7,1",
    "--max-new-tokens",
    "8",
    "--json",
    "--seed",
    "3",
]


def _run(cmd: list[str]) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run(
        cmd, env=env, capture_output=True, text=True, timeout=240, cwd=REPO, start_new_session=True
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def test_generate_tp2_matches_tp1_and_prints_once():
    (tp1,) = _run([sys.executable, "-m", "stepgraph", *ARGS, "--mode", "eager"])
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "stepgraph",
    ]
    printed = _run([*torchrun, *ARGS, "--mode", "graph", "--tp", "2"])
    assert len(printed) == 1  # rank 0 only
    assert printed[0]["outputs"] == tp1["outputs"]
    assert all(len(o) == 8 for o in tp1["outputs"])
