"""Per-request sampling and ``min_tokens`` in the engine (what ``stepgraph serve`` needs): a
seeded request samples the same tokens alone, in a crowd of greedy and other sampled requests,
and as a one-prompt ``Engine.generate`` with that seed; greedy rows stay argmax; stop ids wait
for ``min_tokens``."""

from __future__ import annotations

import pytest
import torch

from stepgraph.engine import Engine, Sampling
from stepgraph.errors import ConfigError
from stepgraph.model import ModelRunner

VOCAB = 512


def _engine(mode: str = "eager") -> Engine:
    mr = ModelRunner.from_preset("tiny", "cpu", torch.float32, seed=7, max_bs=8, max_context_len=96)
    return Engine(mr, mode)


def _prompts(seed: int, n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(1, VOCAB, (int(k),), generator=g).tolist()
        for k in torch.randint(3, 20, (n,), generator=g)
    ]


def _run(engine: Engine, specs: list[dict]) -> list[list[int]]:
    rids = [engine.add_request(s["prompt"], s.get("n", 12), **s.get("kw", {})) for s in specs]
    while engine.has_unfinished:
        engine.step()
    return [engine.finished.pop(r).output for r in rids]


def test_a_seeded_request_samples_the_same_alone_in_a_crowd_and_as_generate():
    prompts = _prompts(1, 7)
    target, k, t = prompts[0], 20, 1.3
    mine = dict(sampling=Sampling(t, k), seed=1234)
    want = _engine().generate([target], 12, temperature=t, top_k=k, seed=1234)[0]
    alone = _run(_engine(), [dict(prompt=target, kw=mine)])[0]
    crowd = [
        dict(prompt=p, kw=dict(sampling=Sampling(0.8), seed=i)) for i, p in enumerate(prompts[1:4])
    ]
    crowd += [dict(prompt=p) for p in prompts[4:]]  # greedy
    crowd.insert(2, dict(prompt=target, kw=mine))
    together = _run(_engine("graph"), crowd)
    assert alone == want and together[2] == want
    assert want != _engine().generate([target], 12)[0]  # sampled, not greedy
    greedy = _engine().generate(prompts[4:], 12)
    assert together[-3:] == greedy  # greedy rows are argmax beside sampled ones
    other = _run(_engine(), [dict(prompt=target, kw=dict(sampling=Sampling(t, k), seed=99))])[0]
    assert other != want  # the seed matters (12 draws over 20 ids: a tie is ~impossible)


def test_an_unseeded_sampled_request_draws_its_own_random_seed():
    p = _prompts(2, 1)[0]
    outs = {
        tuple(_run(_engine(), [dict(prompt=p, kw=dict(sampling=Sampling(2.0)))])[0])
        for _ in range(3)
    }
    assert len(outs) > 1


def test_min_tokens_holds_the_stop_ids_back():
    p = _prompts(3, 1)[0]
    free = _engine().generate([p], 16, ignore_eos=True)[0]
    stop = free[2]  # the 3rd greedy token
    first = free.index(stop)
    out = _run(_engine(), [dict(prompt=p, n=16, kw=dict(stop_ids=[stop]))])[0]
    assert out == free[: first + 1]
    held = _run(_engine(), [dict(prompt=p, n=16, kw=dict(stop_ids=[stop], min_tokens=first + 2))])[
        0
    ]
    later = [i for i, t in enumerate(free) if t == stop and i >= first + 1]
    assert held == (free[: later[0] + 1] if later else free)
    assert len(held) > len(out)


@pytest.mark.parametrize("bad", [-1, 17, 1.5, True])
def test_min_tokens_out_of_range_is_refused_before_queueing(bad):
    engine = _engine()
    with pytest.raises(ConfigError, match="min_tokens"):
        engine.add_request([1, 2, 3], 16, min_tokens=bad)
    assert not engine.has_unfinished
