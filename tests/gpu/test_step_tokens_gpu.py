"""On the GPU, a step's tokens reach the host through reused pinned rows and events
(``overlap.HostRing``): the slots rotate (a launch allocates nothing), a batch larger than the
ring falls back to its own rows, and the overlapped loop over many steps, with stop ids, budgets
and seeded sampling, returns the same tokens as the synchronous loop."""

from __future__ import annotations

import pytest
import torch

from stepgraph.engine import Engine
from stepgraph.engine.overlap import HostRing, InFlight
from stepgraph.engine.requests import Sampling
from stepgraph.model import ModelRunner
from stepgraph.runner import RunnerConfig
from tests.test_token_mirror import mirror_mix

pytestmark = pytest.mark.cuda


def test_ring_slots_rotate_and_a_larger_batch_gets_its_own_rows():
    ring = HostRing(8)
    seen = []
    for k in range(2 * HostRing.SLOTS):
        tokens = torch.arange(k, k + 5, device="cuda")
        step = InFlight.launch([], tokens, ring)
        assert step.wait() == list(range(k, k + 5))
        seen.append(step.host.data_ptr())
    assert seen[: HostRing.SLOTS] == seen[HostRing.SLOTS :]  # the same pinned rows again
    assert len(set(seen)) == HostRing.SLOTS
    big = InFlight.launch([], torch.arange(9, device="cuda"), ring)
    assert big.wait() == list(range(9)) and big.host.data_ptr() not in seen


@pytest.mark.parametrize("mode", ["graph", "exact"])
def test_overlapped_tokens_equal_the_synchronous_loop(mode):
    def run(overlap):
        mr = ModelRunner.from_preset(
            "llama-3.2-1b", "cuda", torch.float32, 0, num_layers=2, max_bs=8, max_context_len=512
        )
        engine = Engine(mr, mode, RunnerConfig(max_bs=8, show_progress=False), overlap=overlap)
        g = torch.Generator().manual_seed(5)
        rids = []
        for i in range(12):  # more requests than rows: joins mid-stream, stops at any token
            n = int(torch.randint(1, 90, (1,), generator=g))
            prompt = torch.randint(1, 128256, (n,), generator=g).tolist()
            own = Sampling(0.8, 40) if i % 3 == 0 else None
            stops = [int(t) for t in torch.randint(0, 128256, (3,), generator=g)]
            budget = 5 + i * 3
            rids.append(engine.add_request(prompt, budget, stop_ids=stops, sampling=own, seed=i))
        while engine.has_unfinished:
            engine.step()
        engine.drain()
        out = [engine.finished[r].output for r in rids]
        engine.shutdown()
        return out

    assert run(True) == run(False)


@pytest.mark.parametrize("mode", ["graph", "exact"])
def test_tokens_through_the_token_mirror_equal_the_copied_ones(mode):
    """``DecodeTuning(token_mirror=True)``: the graph stores its greedy ids to pinned host
    memory and the engine reads them there (no D2H copy); the same tokens as the copy, and the
    mirror is what the decode-only steps landed from."""
    from stepgraph.tuning import DecodeTuning

    def run(mirror):
        mr = ModelRunner.from_preset(
            "llama-3.2-1b", "cuda", torch.bfloat16, 0, num_layers=2, max_bs=8,
            max_context_len=512, tuning=DecodeTuning(token_mirror=mirror),
        )  # fmt: skip
        engine = Engine(mr, mode, RunnerConfig(max_bs=8, show_progress=False))
        host = engine.runner._mirror.host if mirror else None
        return mirror_mix(engine, 128256, host)  # steps with prefill rows copy

    copied, none = run(False)
    got, mirrored = run(True)
    assert got == copied
    assert none == 0 and mirrored > 20
