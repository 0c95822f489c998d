"""The overlapped loop against the synchronous one on the CPU (tiny preset, float32): the same
tokens over random request mixes (requests joining and finishing mid-stream, max_running below
the batch, stop ids hit at the first and at the last token, greedy and seeded sampling, eager
and the graph stand-in); no page reused while a step that holds it may still run (a device
that always lags is emulated, and freed pages are poisoned); a fault while a step is in
flight; Engine.abort of one request."""

from __future__ import annotations

import pytest
import torch

from stepgraph.engine import Engine, Sampling
from stepgraph.engine import overlap as overlap_mod
from stepgraph.model import ModelRunner
from stepgraph.runner import RunnerConfig

from .guards import time_limit

VOCAB = 512


def _runner(num_pages: int = 64) -> ModelRunner:
    return ModelRunner.from_preset(
        "tiny", "cpu", torch.float32, seed=8, max_bs=4, max_context_len=80, num_pages=num_pages
    )


def _engine(mode: str, overlap: bool, max_running=None, num_pages: int = 64) -> Engine:
    config = None if mode == "eager" else RunnerConfig(max_bs=4, show_progress=False)
    return Engine(_runner(num_pages), mode, config, max_running=max_running, overlap=overlap)


def _mix(seed: int):
    """Requests as (step to add it at, prompt, max_new_tokens)."""
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(3, 7, (1,), generator=g))
    out = []
    for _ in range(n):
        at = int(torch.randint(0, 6, (1,), generator=g))
        prompt = torch.randint(
            1, VOCAB, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g
        )
        out.append((at, prompt.tolist(), int(torch.randint(1, 12, (1,), generator=g))))
    return sorted(out, key=lambda r: r[0])


def _drive(engine: Engine, mix, stops=(), sampling=None, seed=None, abort=None):
    """Add each request at its step, step until done; the outputs by request, in mix order."""
    gen = None if seed is None else torch.Generator().manual_seed(seed)
    sampling = sampling or Sampling()
    rids, step = [], 0
    while len(rids) < len(mix) or engine.has_unfinished:
        for at, prompt, new in mix:
            if at == step:
                rids.append(engine.add_request(prompt, new, stop_ids=list(stops)))
        if abort is not None and step == abort[0]:
            assert engine.abort(rids[abort[1]])
        engine.step(sampling, gen)
        step += 1
        assert step < 500, "the loop does not end"
    engine.drain()
    return [engine.finished[r].output if r in engine.finished else None for r in rids]


@pytest.mark.parametrize("mode", ["eager", "graph"])
@pytest.mark.parametrize("seed", range(4))
def test_overlap_gives_the_synchronous_tokens(mode, seed):
    mix = _mix(seed)
    max_running = 2 if seed % 2 else None  # below the batch: admission waits for finishes
    want = _drive(_engine(mode, False, max_running), mix)
    assert _drive(_engine(mode, True, max_running), mix) == want
    # stop ids hit at a request's first token and at another's last token
    stops = {want[0][0], want[-1][-1]}
    want_stop = _drive(_engine(mode, False, max_running), mix, stops)
    assert any(len(a) < len(b) for a, b in zip(want_stop, want))  # the stops did cut
    assert _drive(_engine(mode, True, max_running), mix, stops) == want_stop
    sampled = Sampling(temperature=0.8, top_k=20)
    want_s = _drive(_engine(mode, False, max_running), mix, sampling=sampled, seed=seed)
    assert _drive(_engine(mode, True, max_running), mix, sampling=sampled, seed=seed) == want_s


def test_steps_return_the_tokens_of_the_step_before():
    engine = _engine("eager", True)
    rid = engine.add_request([5, 6, 7], 3)
    got = [engine.step() for _ in range(4)]
    assert got[0] == []  # launched; nothing on the host yet
    assert [len(g) for g in got[1:]] == [1, 1, 1]  # each step lands the one before
    assert not engine.has_unfinished
    assert engine.finished[rid].output == [tok for g in got for _, tok in g]
    want = _engine("eager", False).generate([[5, 6, 7]], 3)[0]
    assert engine.finished[rid].output == want


class LaggingDevice:
    """Every launched step still runs until it is waited for (a device that is always
    behind the host); reserved pages must never belong to a request of a running step."""

    def __init__(self, monkeypatch, engine: Engine) -> None:
        self.running: list[overlap_mod.InFlight] = []
        self.owner: dict[int, int] = {}  # page -> request id that last held it
        launch, sync = overlap_mod.InFlight.launch.__func__, overlap_mod.InFlight.synchronize

        def lagging_launch(cls, rows, tokens, ring=None, host=None):
            step = launch(cls, rows, tokens, ring, host)
            self.running.append(step)
            return step

        def lagging_sync(step):
            if step in self.running:
                self.running.remove(step)
            return sync(step)

        monkeypatch.setattr(overlap_mod.InFlight, "launch", classmethod(lagging_launch))
        monkeypatch.setattr(overlap_mod.InFlight, "synchronize", lagging_sync)
        monkeypatch.setattr(overlap_mod.InFlight, "done", property(lambda s: s not in self.running))
        kv, cache = engine.model_runner.kv_cache, engine.prefix_cache
        allocate, free, evict = cache.allocate, kv.allocator.free, cache._tree.evict_leaves

        def checked_allocate(n):  # new pages only: matched cached pages are shared, read-only
            pages = allocate(n)
            busy = {r.rid for step in self.running for r in step.rows}
            reused = [p for p in pages if self.owner.get(p) in busy]
            assert not reused, f"pages {reused} reused while a step holding them still runs"
            return pages

        def poison(pages):
            for c in (*kv.k_caches, *kv.v_caches):
                c[pages] = float("nan")  # a live request reading a freed page gets NaN

        def poisoned_free(pages):
            poison(pages)
            free(pages)

        def poisoned_evict(n):
            pages = evict(n)
            poison(pages)
            return pages

        monkeypatch.setattr(cache, "allocate", checked_allocate)
        monkeypatch.setattr(kv.allocator, "free", poisoned_free)
        monkeypatch.setattr(cache._tree, "evict_leaves", poisoned_evict)
        self.kv, self.cache = kv, cache

    def track(self, engine: Engine) -> None:
        for req in engine.running:
            for p in req.pages:
                self.owner[p] = req.rid


def _shared_mix(seed: int):
    """``_mix`` whose prompts mostly start with one of two shared prefixes (16 and 35 tokens):
    full cached pages matched by later requests, chunks that start after them."""
    g = torch.Generator().manual_seed(seed)
    heads = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in (16, 35)]
    out = []
    for i, (at, prompt, new) in enumerate(_mix(seed)):
        head = heads[i % 2] if i else []
        out.append((at + 2 * i, (head + prompt)[:60], new))  # later: after a prefix is written
    return out


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_no_page_is_reused_while_a_step_holding_it_runs(monkeypatch, seed, shared):
    """12 pages: requests must reuse each other's pages (new, freed or evicted from the prefix
    cache), with stop ids cutting some short; shared prefixes are matched while requests that
    wrote them still run or wait for their late release."""
    mix = _shared_mix(10 + seed) if shared else _mix(10 + seed)
    want = _drive(_engine("graph", False, 3, num_pages=12), mix)
    stops = {want[0][0]}
    want = _drive(_engine("graph", False, 3, num_pages=12), mix, stops)
    engine = _engine("graph", True, 3, num_pages=12)
    device = LaggingDevice(monkeypatch, engine)
    step = engine.step

    def tracked_step(*a, **k):
        out = step(*a, **k)
        device.track(engine)
        return out

    monkeypatch.setattr(engine, "step", tracked_step)
    assert _drive(engine, mix, stops) == want  # and no poison was read
    device.cache.check()
    assert device.cache.num_available == 11 and not device.cache._tree.refs
    device.cache.clear()
    assert device.kv.allocator.num_free == 11
    if shared:
        assert engine.stats.cached_tokens > 0  # the shared prefixes did hit


def test_a_fault_while_a_step_is_in_flight_frees_everything():
    engine = _engine("graph", True)
    free = engine.model_runner.kv_cache.allocator.num_free
    calls = {"n": 0}
    logits = engine.decoder.logits

    def failing(*args):
        calls["n"] += 1
        if calls["n"] == 3:  # step N+1 fails while step N is in flight
            raise RuntimeError("injected decode fault")
        return logits(*args)

    engine.decoder.logits = failing
    prompts = [[3, 4, 5], [9] * 20, [7, 1]]
    with time_limit(30), pytest.raises(RuntimeError, match="injected decode fault"):
        engine.generate(prompts, 6)
    assert engine.model_runner.kv_cache.allocator.num_free == free
    assert not engine.has_unfinished and engine._inflight is None
    del engine.decoder.logits
    assert engine.generate(prompts, 6) == _engine("graph", True).generate(prompts, 6)


@pytest.mark.parametrize("overlap", [False, True])
def test_abort_one_request_mid_flight(overlap):
    mix = [(0, [4, 5, 6], 10), (0, [8] * 12, 10), (0, [1, 2], 10)]
    want = _drive(_engine("eager", False), mix, abort=(3, 1))
    got = _drive(_engine("eager", overlap), mix, abort=(3, 1))
    assert got == want and got[1] is None and all(len(o) == 10 for o in (got[0], got[2]))


def test_abort_frees_its_pages_and_refuses_unknown_ids():
    engine = _engine("eager", True, max_running=1)
    free = engine.model_runner.kv_cache.allocator.num_free
    running = engine.add_request([1, 2, 3], 30)
    waiting = engine.add_request([4, 5], 30)  # max_running=1: it waits
    engine.step()
    engine.step()
    assert [r.rid for r in engine.waiting] == [waiting]
    assert engine.abort(waiting) and not engine.waiting
    assert engine.abort(running) and not engine.running
    assert not engine.abort(running) and not engine.abort(12345)  # gone, or never there
    engine.drain()
    assert engine.model_runner.kv_cache.allocator.num_free == free
    assert running not in engine.finished and not engine.has_unfinished


@pytest.mark.parametrize("staged", [False, True])
def test_decode_rows_read_the_last_step_from_the_feed(staged):
    """In graph mode the host builds every decode batch without the last step's tokens: rows
    that continue a request carry ``-1 - j`` (row j of the step before, in the runner's feed),
    and the tokens still equal the synchronous loop's."""
    mix = _mix(3)
    config = RunnerConfig(max_bs=4, show_progress=False, pinned_staging=staged)
    engine = Engine(_runner(), "graph", config, max_running=4, overlap=True)
    runner = engine.decoder.runner
    assert runner.feed.data_ptr() == engine.model_runner.greedy_tokens.data_ptr()
    fed, replay = [], runner.replay

    def spy(batch):
        fed.append(int(batch.packed_cpu[:, 0].min()) < 0)
        assert batch.values_checked and (batch.packed is None) == staged
        return replay(batch)

    runner.replay = spy
    got = _drive(engine, mix)
    assert any(fed) and engine.stats.eager_steps == 0
    assert got == _drive(_engine("graph", False, max_running=4), mix)
