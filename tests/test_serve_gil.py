"""The server's engine thread gets the GIL back within a fraction of a GPU step: starting the
worker lowers Python's switch interval from its 5 ms default (never raises a lower one)."""

from __future__ import annotations

import sys

import pytest
import torch

from stepgraph.engine import Engine
from stepgraph.model import ModelRunner
from stepgraph.serve import worker


@pytest.mark.parametrize("before", [0.005, 0.0001])
def test_starting_the_worker_lowers_the_switch_interval(before):
    old = sys.getswitchinterval()
    sys.setswitchinterval(before)
    try:
        mr = ModelRunner.from_preset("tiny", "cpu", torch.float32, max_bs=2, max_context_len=32)
        w = worker.EngineWorker(lambda: Engine(mr, "eager")).start(timeout=60)
        try:
            want = min(before, worker.SWITCH_INTERVAL_S)
            assert sys.getswitchinterval() == pytest.approx(want, rel=0.02)  # microseconds
        finally:
            w.stop(timeout=30)
    finally:
        sys.setswitchinterval(old)
