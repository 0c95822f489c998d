"""The token mirror (``runner/token_mirror.py``): the captured step stores the feed's rows to
pinned host memory itself, one slot per replay. The kernel under the Triton interpreter against
the torch ops it stands for (poisoned slots, fresh random ids, a bucket exactly at the loop's
block and one past it), and the runner on the CPU stand-in: each replay's host rows equal the
step's own argmax and stay put until the slot comes round again; and an ``Engine`` on the stand-in
landing its decode steps' tokens from the slots, equal to an eager engine's."""

from __future__ import annotations

import pytest
import torch

from stepgraph.runner import CudaGraphRunner, RunnerConfig
from stepgraph.runner.token_mirror import BLOCK, SLOTS, TokenMirror, _mirror_kernel
from stepgraph.toy_model import ToyModelRunner
from stepgraph.tuning import DecodeTuning

POISON = -77


@pytest.mark.parametrize("n", [1, 5, BLOCK, BLOCK + 1, 2 * BLOCK + 3])
def test_kernel_stores_the_feed_into_the_slot_of_the_count(n):
    g = torch.Generator().manual_seed(n)
    width = n + 4
    for count in range(1, 2 * SLOTS + 2):  # every slot, each more than once
        feed = torch.randint(0, 2**40, (width,), generator=g)
        host = torch.full((SLOTS, width), POISON, dtype=torch.int64)
        copies = torch.tensor([count])
        _mirror_kernel[(1,)](feed, copies, host, n, host.stride(0), SLOTS=SLOTS, BLOCK=BLOCK)
        want = torch.full_like(host, POISON)
        want[count % SLOTS, :n] = feed[:n]  # rows past n and the other slots untouched
        assert torch.equal(host, want), count


def test_torch_ops_store_the_same_rows():
    g = torch.Generator().manual_seed(1)
    mirror = TokenMirror(16, torch.device("cpu"))
    mirror.host.fill_(POISON)
    for count in range(1, 7):
        feed = torch.randint(0, 1000, (16,), generator=g)
        before = mirror.host.clone()
        mirror.store(feed, torch.tensor([count]), 9)
        want = before
        want[count % SLOTS, :9] = feed[:9]
        assert torch.equal(mirror.host, want)
        assert torch.equal(mirror.rows(count, 9), feed[:9])
        assert mirror.rows(count, 4).data_ptr() == mirror.host[count % SLOTS].data_ptr()


class ArgmaxToy(ToyModelRunner):
    """The toy whose step writes its greedy ids into a feed, as the fused step writes
    ``ModelRunner.greedy_tokens``."""

    def __init__(self, mirror: bool, **kw) -> None:
        super().__init__(**kw)
        self.tuning = DecodeTuning(token_mirror=mirror)
        self.greedy = torch.zeros(8, dtype=torch.int64)

    def forward(self, batch):
        logits = super().forward(batch)
        self.greedy[: logits.shape[0]] = logits.argmax(-1)
        return logits


def _runner(mr, **kw):
    config = RunnerConfig(max_bs=8, show_progress=False, pinned_staging=True, **kw)
    return CudaGraphRunner(mr, config, feed=mr.greedy)


def test_each_replay_leaves_its_own_tokens_on_the_host_until_its_slot_returns():
    mr = ArgmaxToy(True, num_pages=200, seed=2)
    runner = _runner(mr)
    g = torch.Generator().manual_seed(3)
    kept = []  # (host rows, their tokens) of the replays still in their slot
    for step, bs in enumerate([3, 3, 8, 1, 5, 5, 2, 7]):
        logits = runner.replay(mr.random_batch(bs, g))
        host = runner.host_feed(bs)
        tokens = logits.argmax(-1)
        assert torch.equal(host, tokens), step
        kept = [*kept[-(SLOTS - 1) :], (host, tokens.clone())]
        for rows, want in kept:  # the last SLOTS replays' rows are all still there
            assert torch.equal(rows, want), step


@pytest.mark.parametrize(
    "mirror, staged, fed", [(False, True, True), (True, False, True), (True, True, False)]
)
def test_no_mirror_without_the_tuning_staging_or_a_feed(mirror, staged, fed):
    mr = ArgmaxToy(mirror, num_pages=200, seed=2)
    config = RunnerConfig(max_bs=8, show_progress=False, pinned_staging=staged)
    runner = CudaGraphRunner(mr, config, feed=mr.greedy if fed else None)
    runner.replay(mr.random_batch(2, torch.Generator().manual_seed(0)))
    assert runner.host_feed(2) is None


def _argmax_in_step(mr):
    """A CPU model runner whose decode step writes its greedy ids into ``greedy_tokens`` (the
    runner's feed) and reports them as the step's own, as the fused step does on CUDA."""
    forward = mr.forward

    def step(batch, *, out=None):
        logits = forward(batch, out=out)
        mr.greedy_tokens[: logits.shape[0]].copy_(logits.argmax(-1))
        return logits

    mr.forward = step
    mr.fused_tokens = lambda bs: mr.greedy_tokens[:bs]
    return mr


def mirror_mix(engine, vocab: int, host: torch.Tensor | None) -> tuple[list[list[int]], int]:
    """12 seeded requests (joins mid-stream, stop ids, budgets of 6-39) run to the end through
    ``engine``, which it shuts down: (each request's tokens, how many steps landed their
    tokens from ``host``, the mirror's pinned rows; 0 without)."""
    g = torch.Generator().manual_seed(7)
    rids, mirrored = [], 0
    for i in range(12):
        n = int(torch.randint(1, 70, (1,), generator=g))
        stops = torch.randint(0, vocab, (3,), generator=g).tolist()
        prompt = torch.randint(1, vocab, (n,), generator=g).tolist()
        rids.append(engine.add_request(prompt, 6 + 3 * i, stop_ids=stops))
    while engine.has_unfinished:
        engine.step()
        step = engine._inflight
        if host is not None and step is not None:
            mirrored += host.data_ptr() <= step.host.data_ptr() < host.data_ptr() + host.nbytes
    engine.drain()
    out = [engine.finished[r].output for r in rids]
    engine.shutdown()
    return out, mirrored


def _engine_outputs(mode: str, mirror: bool | None):
    """``mirror_mix`` through an ``Engine`` of the tiny preset; ``mirror`` not None: the step
    writes the feed, with the mirror on or off."""
    from stepgraph.engine import Engine
    from stepgraph.model import ModelRunner

    mr = ModelRunner.from_preset(
        "tiny", "cpu", torch.float32, 0, max_bs=8, max_context_len=256,
        tuning=DecodeTuning(token_mirror=bool(mirror)),
    )  # fmt: skip
    if mirror is not None:
        _argmax_in_step(mr)
    engine = Engine(mr, mode, RunnerConfig(max_bs=8, show_progress=False, pinned_staging=True))
    return mirror_mix(engine, 512, engine.runner._mirror.host if mirror else None)


def test_the_engine_lands_the_mirrored_tokens_as_eager_computes_them():
    """The engine over a staged runner with the mirror, on a step that writes its argmax into
    the feed: decode-only steps land their tokens from the pinned slots (no copy), and every
    request's tokens equal an eager engine's from the logits. (Without the mirror the CPU
    stand-in hands the step's tokens over as a view of the feed, which the next step
    overwrites: there the fused step's tokens exist only on CUDA, behind a stream-ordered copy.)"""
    want, _ = _engine_outputs("eager", None)
    got, mirrored = _engine_outputs("graph", True)
    assert got == want
    assert mirrored > 20 and sum(map(len, want)) > 200
