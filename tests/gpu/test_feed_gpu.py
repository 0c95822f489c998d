"""The device token feed on the GPU, with the host ahead: a loop that builds every step on the
host (ids of the last step as ``-1 - j``, rows staged in pinned memory, the default on CUDA),
while a sleep kernel keeps the GPU behind, gives the tokens of a loop that reads each step's
ids back before the next."""

from __future__ import annotations

import pytest
import torch

from stepgraph.batch import PACKED
from stepgraph.runner import CudaGraphRunner, RunnerConfig
from stepgraph.runner.feed import feed_id
from stepgraph.toy_model import ToyModelRunner

pytestmark = pytest.mark.cuda
SLEEP_CYCLES = 2_000_000  # ~1 ms of GPU time per step: the host stays ahead
STEPS = 12


@pytest.fixture(scope="module")
def mr():
    return ToyModelRunner(
        vocab=300,
        hidden=64,
        num_layers=4,
        num_pages=600,
        page_size=16,
        max_pages_per_request=8,
        device="cuda",
        seed=31,
    )


def _advance(rows: torch.Tensor, page_size: int) -> torch.Tensor:
    """The host rows of the next step: one position on, its slot from the row's own table."""
    nxt = rows.clone()
    pos = PACKED.column(nxt, "positions")
    pos += 1
    PACKED.column(nxt, "seq_lens")[:] += 1
    page = PACKED.table(nxt).gather(1, (pos // page_size)[:, None])[:, 0]
    PACKED.column(nxt, "out_cache_loc")[:] = page * page_size + pos % page_size
    return nxt


def _loop(mr, runner, first, fed: bool):
    """STEPS greedy steps from ``first``; with ``fed`` the host never waits for an id."""
    saved = mr.clone_state()
    rows, tokens = first.packed_cpu.clone(), []
    bs = rows.shape[0]
    for _ in range(STEPS):
        batch = first.__class__(**{**first.__dict__})
        batch.packed, batch.packed_cpu = None, rows
        batch.seq_lens_cpu = PACKED.column(rows, "seq_lens").to(torch.int32)
        torch.cuda._sleep(SLEEP_CYCLES)
        out = runner.replay(batch)
        if fed:
            torch.argmax(out, -1, out=runner.feed[:bs])  # stays on the device
            tokens.append(runner.feed[:bs].clone())
        else:
            tokens.append(out.argmax(-1))
        rows = _advance(rows, mr.page_size)
        PACKED.column(rows, "input_ids")[:] = (
            torch.tensor([feed_id(i) for i in range(bs)]) if fed else tokens[-1].cpu()
        )
    torch.cuda.synchronize()
    mr.load_state(saved)
    return torch.stack(tokens).tolist()


@pytest.mark.parametrize("bs", [1, 5, 16])
def test_a_loop_fed_on_the_device_equals_one_that_reads_ids_back(mr, bs):
    feed = torch.zeros(16, dtype=torch.int64, device="cuda")
    runner = CudaGraphRunner(mr, RunnerConfig(max_bs=16, show_progress=False), feed=feed)
    assert runner.staged  # the default on CUDA
    first = mr.random_batch(bs, torch.Generator().manual_seed(bs), packed=True, max_len=100)
    want = _loop(mr, runner, first, fed=False)
    got = _loop(mr, runner, first, fed=True)
    assert got == want
    assert len({tuple(t) for t in want}) > 1  # the tokens really changed from step to step
    runner.shutdown()
