"""How many eager runs a bucket gets before its capture: one, and another only while the last
used a Triton kernel variant for the first time, up to ``RunnerConfig.warmup_iters``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from triton import knobs

from stepgraph.backends import CpuGraphBackend
from stepgraph.runner import CudaGraphRunner, RunnerConfig
from stepgraph.runner.capture import STATE, capture_loop, capture_step
from stepgraph.toy_model import ToyModelRunner


def counting_model(compiles_on: dict[int, int]):
    """A toy whose forward logs every call and, on the calls ``compiles_on`` names (by index in
    the whole capture), reports that many first-use compiles through Triton's hook, as a cold
    Triton does from inside a launch."""
    mr = ToyModelRunner(num_pages=160, seed=3)
    forward, calls = mr.forward, []

    def logged(batch):
        for k in range(compiles_on.get(len(calls), 0)):
            info = SimpleNamespace(module="toy", name=f"k{len(calls)}_{k}", jit_function=None)
            knobs.runtime.jit_post_compile_hook(fn=info)
        calls.append(batch.batch_size)
        return forward(batch)

    mr.forward = logged
    return mr, calls


def warmups(stats) -> list[int]:
    return [b.warmups for b in stats.buckets]


def test_a_step_that_loads_nothing_new_is_warmed_up_once():
    mr, calls = counting_model({})
    stats = CudaGraphRunner(mr, RunnerConfig(max_bs=8, show_progress=False)).stats.capture
    assert warmups(stats) == [1, 1, 1, 1]
    assert calls == [8, 8, 4, 4, 2, 2, 1, 1]  # one warm-up and the recording each
    assert "runs" in stats.ledger_table().splitlines()[0]
    assert stats.ledger_table().splitlines()[-1].split()[3] == "4"


def test_a_run_that_compiles_is_followed_by_another_up_to_the_limit():
    # bucket 8: its first run compiles, the second does not -> 2 runs;
    # bucket 4: runs 1 and 2 compile -> a third, which is the limit of 3;
    # bucket 2: compiles nothing -> 1; bucket 1: its first run compiles -> 2
    mr, calls = counting_model({0: 3, 3: 1, 4: 2, 9: 1})
    cfg = RunnerConfig(max_bs=8, show_progress=False, warmup_iters=3)
    stats = CudaGraphRunner(mr, cfg).stats.capture
    assert warmups(stats) == [2, 3, 1, 2]
    assert calls == [8, 8, 8, 4, 4, 4, 4, 2, 2, 1, 1, 1]
    assert stats.kernel_variants == 3 + 1 + 2 + 1


def test_the_limit_holds_while_every_run_compiles():
    mr, _ = counting_model({i: 1 for i in range(40)})
    for limit in (1, 2, 4):
        cfg = RunnerConfig(max_bs=4, show_progress=False, warmup_iters=limit)
        assert warmups(CudaGraphRunner(mr, cfg).stats.capture) == [limit] * 3


@pytest.mark.parametrize("limit", [1, 2, 3])
def test_every_run_when_asked(limit):
    mr, calls = counting_model({})
    cfg = RunnerConfig(
        max_bs=4, show_progress=False, warmup_iters=limit, warmup_until_settled=False
    )
    stats = CudaGraphRunner(mr, cfg).stats.capture
    assert warmups(stats) == [limit] * 3
    assert len(calls) == 3 * (limit + 1)


def test_torch_compile_buckets_take_every_run(monkeypatch):
    """torch.compile's kernels do not pass Triton's hook: its buckets are not cut short."""
    mr, calls = counting_model({})
    runner = CudaGraphRunner(mr, RunnerConfig(max_bs=4, show_progress=False), capture=False)
    runner.compile_bs = {2}
    monkeypatch.setattr(runner, "_forward_for", lambda bs: mr.forward)
    stats = runner.capture()
    assert warmups(stats) == [1, 2, 1]


def test_outside_a_capture_loop_every_run_is_taken():
    """``capture_step`` alone has no compile count to settle by: ``warmup_iters`` runs."""
    backend = CpuGraphBackend(torch.device("cpu"))
    calls = []

    def step():
        calls.append(1)
        return torch.zeros(2)

    assert STATE.compiles is None
    _, stats = capture_step(backend, step, key=1, bs=1, what="a step", warmup_iters=3)
    assert stats.warmups == 3 and len(calls) == 4


def test_the_loop_clears_its_count_even_when_a_capture_fails():
    def boom(item):
        assert STATE.compiles is not None
        raise RuntimeError("no")

    with pytest.raises(RuntimeError):
        capture_loop([1], boom, show_progress=False)
    assert STATE.compiles is None
