"""The engine under tensor parallelism, two ranks over gloo: the overlapped loop gives the same
tokens on both ranks (greedy, equal to the unsharded engine's; sampled without a seed, equal to
each other), in eager and graph mode, and a rank given different requests raises, naming what
differs, instead of entering a collective its peer will not (``engine/tp_sync.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from stepgraph.engine import Engine, Sampling
from stepgraph.model.parallel import shard_model
from stepgraph.runner import RunnerConfig

from .test_parallel import TINY, WORLD, _model, _runner, spawn_ranks

PROMPTS = [[5, 6, 7, 8], [9, 10], list(range(11, 40)), [41]]
NEW = 7


def _engine(mr, mode: str, overlap: bool = True) -> Engine:
    config = None if mode == "eager" else RunnerConfig(max_bs=2, show_progress=False)
    return Engine(mr, mode, config, max_running=2, overlap=overlap, max_prefill_tokens=16)


def _serve(engine: Engine, sampled: bool) -> list[list[int]]:
    """Requests joining over the steps, max_running below their count, chunked prefill."""
    sampling = Sampling(temperature=0.9, top_k=20) if sampled else None
    rids = [engine.add_request(p, NEW, sampling=sampling) for p in PROMPTS[:2]]
    steps = 0
    while engine.has_unfinished or len(rids) < len(PROMPTS):
        if steps == 2:
            rids += [engine.add_request(p, NEW, sampling=sampling) for p in PROMPTS[2:]]
        engine.step()
        steps += 1
    engine.drain()
    return [engine.finished[r].output for r in rids]


def _tp_tokens(rank: int, out: str) -> None:
    mr = _runner(shard_model(_model(TINY), rank, WORLD))
    got = {}
    for mode in ("eager", "graph"):
        for sampled in (False, True):
            got[f"{mode}-{'sampled' if sampled else 'greedy'}"] = _serve(_engine(mr, mode), sampled)
    Path(out, f"rank{rank}.json").write_text(json.dumps(got))


def test_every_rank_serves_the_same_tokens(tmp_path):
    spawn_ranks("tests.test_tp_engine:_tp_tokens", str(tmp_path))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    assert ranks[0] == ranks[1]
    want = _serve(_engine(_runner(_model(TINY)), "eager", overlap=False), sampled=False)
    assert ranks[0]["eager-greedy"] == ranks[0]["graph-greedy"] == want  # float32: as unsharded
    assert all(len(t) == NEW for t in ranks[0]["eager-sampled"])
    assert ranks[0]["eager-sampled"] != want  # sampling really drew


def _diverge(rank: int) -> None:
    engine = _engine(_runner(shard_model(_model(TINY), rank, WORLD)), "eager")
    for p in PROMPTS[: 3 if rank == 1 else 2]:  # rank 1 was given one request more
        engine.add_request(p, NEW)
    while engine.has_unfinished:
        engine.step()


def test_a_rank_given_other_requests_raises_naming_it(tmp_path):
    with pytest.raises((mp.ProcessRaisedException, mp.ProcessExitedException)):
        spawn_ranks("tests.test_tp_engine:_diverge", err_dir=str(tmp_path))
    err = (tmp_path / "rank1.err").read_text()
    assert "rank 1 diverged from rank 0 at step 1: its waiting requests differ" in err, err


def test_one_process_needs_no_sync():
    engine = _engine(_runner(_model(TINY)), "eager")
    assert engine._sync is None and not torch.distributed.is_initialized()


def _whole_models(rank: int, out: str) -> None:
    """Data parallel: each rank serves a whole model, its own requests: no sync, no error."""
    engine = _engine(_runner(_model(TINY)), "eager")
    got = engine.generate([PROMPTS[rank]], NEW)  # different requests on each rank
    Path(out, f"rank{rank}.json").write_text(json.dumps({"sync": engine._sync is None, "got": got}))


def test_ranks_serving_whole_models_schedule_on_their_own(tmp_path):
    spawn_ranks("tests.test_tp_engine:_whole_models", str(tmp_path))
    for r in range(WORLD):
        got = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert got["sync"] and len(got["got"][0]) == NEW
