"""``enable_torch_compile``: which buckets capture a compiled forward, on the CPU
stand-in with ``torch.compile`` replaced by a recorder (a real compile runs on the GPU tier)."""

from __future__ import annotations

import pytest
import torch

from stepgraph.runner import CudaGraphRunner, RunnerConfig
from stepgraph.toy_model import ToyModelRunner


class CompileRecorder:
    """Stands in for ``torch.compile``: records its options and which batch sizes the compiled
    callable served."""

    def __init__(self) -> None:
        self.options: list[dict] = []
        self.served: list[int] = []

    def __call__(self, fn, **options):
        self.options.append(options)

        def compiled(batch):
            self.served.append(batch.batch_size)
            return fn(batch)

        return compiled


@pytest.fixture
def recorder(monkeypatch):
    rec = CompileRecorder()
    monkeypatch.setattr(torch, "compile", rec)
    return rec


@pytest.mark.parametrize(
    "max_bs, want", [(4, [1, 2, 4]), (5, [1, 2, 4]), (1, [1]), (0, []), (16, [1, 2, 4, 8, 16])]
)
def test_buckets_up_to_torch_compile_max_bs_compile(recorder, max_bs, want):
    cfg = RunnerConfig(
        capture_bs=(1, 2, 4, 8, 16),
        enable_torch_compile=True,
        torch_compile_max_bs=max_bs,
        torch_compile_mode="default",
        show_progress=False,
    )
    assert cfg.compile_buckets() == want
    mr = ToyModelRunner(num_pages=160, seed=3)
    runner = CudaGraphRunner(mr, cfg)
    assert runner.compile_bs == want
    # compiled once, with the configured mode, and only the compiled buckets ran through it
    assert recorder.options == ([{"mode": "default", "dynamic": False}] if want else [])
    assert set(recorder.served) == set(want)
    g = torch.Generator().manual_seed(11)
    for bs in (1, 3, 4, 9, 16):  # compiled and plain buckets both replay equal to eager
        batch = mr.random_batch(bs, g)
        want_logits, _ = mr.eager_reference(batch)
        torch.testing.assert_close(runner.replay(batch), want_logits, rtol=1e-5, atol=1e-5)


def test_without_enable_torch_compile_nothing_compiles(recorder):
    cfg = RunnerConfig(capture_bs=(1, 2, 4), torch_compile_max_bs=64, show_progress=False)
    runner = CudaGraphRunner(ToyModelRunner(num_pages=64, seed=4), cfg)
    assert runner.compile_bs == [] and cfg.compile_buckets() == []
    assert recorder.options == [] and recorder.served == []
