"""Stats a person can read: ``str(stats)`` of the decode runner, the config runner and the
piecewise runner is a short table; ``as_dict()`` (JSON-ready) and ``repr`` keep every figure."""

from __future__ import annotations

import json

import torch

from stepgraph.engine import Engine
from stepgraph.model import ModelRunner
from stepgraph.model.prefill.piecewise_prefill import PiecewisePrefill, PrefillShapes
from stepgraph.runner import CudaGraphRunner, RunnerConfig
from stepgraph.runner.stats_table import by_reason, compact_sizes
from stepgraph.toy_model import ToyModelRunner


def _readable(text: str, most: int = 8) -> list[str]:
    lines = text.splitlines()
    assert 3 <= len(lines) <= most, text
    assert all(len(line) <= 100 for line in lines), text
    return lines


def _row(text: str, name: str) -> str:
    return next(line.split(None, 1)[1] for line in text.splitlines()[1:] if line.split()[0] == name)


def test_compact_sizes_and_reasons():
    assert compact_sizes([1, 2, 4, 8] + list(range(16, 257, 16))) == "1,2,4,8,16-256/16"
    assert compact_sizes([3, 3, 9, 17]) == "3,9,17"
    assert compact_sizes([5, 6, 7, 8, 20]) == "5-8/1,20"
    assert by_reason({"too_large": 2, "bad_input": 5, "empty": 0}) == "bad_input 5, too_large 2"
    assert by_reason({}) == "none"


def test_graph_runner_stats_table_and_dict():
    mr = ToyModelRunner(num_pages=200, seed=4)
    g = torch.Generator().manual_seed(8)
    runner = CudaGraphRunner(mr, RunnerConfig(max_bs=16, show_progress=False))
    assert _row(str(runner.stats), "replays").startswith("0")
    for bs in (3, 9, 5):
        runner.replay(mr.random_batch(bs, g))
    too_big = mr.random_batch(20, g)
    assert not runner.can_run(too_big) and not runner.can_run(too_big)
    text = str(runner.stats)
    _readable(text)
    assert text.splitlines()[0] == "CudaGraphRunner stats"
    assert _row(text, "buckets") == "5 graphs, bs 1,2,4,8,16"
    assert _row(text, "capture").endswith("MiB outside it)") and " s, graph pool " in text
    assert _row(text, "replays").startswith("3 ")
    assert _row(text, "fallbacks") == "too_large 2"

    d = runner.stats.as_dict()
    assert json.loads(json.dumps(d)) == d  # JSON-ready
    assert d["replays"] == 3 and d["fallbacks"] == {"too_large": 2}
    assert [b["bs"] for b in d["capture"]["buckets"]] == [16, 8, 4, 2, 1]  # capture order
    assert d["capture"]["seconds"] == runner.stats.capture.seconds > 0
    assert "pool_bytes" in d["capture"] and "pool_bytes" in d["capture"]["buckets"][0]
    r = repr(runner.stats)
    assert r.startswith("RunnerStats(") and r.count("BucketStats(") == 5
    runner.shutdown()


def test_config_runner_and_piecewise_stats_tables():
    mr = ModelRunner.from_preset("tiny", "cpu", torch.float32, 0, max_bs=4, max_context_len=64)
    config = RunnerConfig(capture_bs=[1, 2], show_progress=False)
    engine = Engine(mr, mode="graph", decode_via="configs", runner_config=config)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, 512, (n,), generator=g).tolist() for n in (3, 5, 2)]
    engine.generate(prompts, 3)  # 3 requests > the largest bucket (2): eager, by reason
    stats = engine.config_runner.stats
    text = str(stats)
    _readable(text)
    assert text.splitlines()[0] == "ConfigGraphRunner stats"
    assert _row(text, "buckets") == "2 graphs, bs 1,2"
    assert _row(text, "eager") == f"{stats.eager_calls} calls; batches by reason: too_large 2"
    assert stats.as_dict()["eager_reasons"] == {"too_large": 2}
    engine.shutdown()

    prefill = PiecewisePrefill(mr, PrefillShapes((8, 16), (1, 2)))
    region = prefill.runners[0]
    text = str(region.stats)  # a PiecewiseRunner's stats: its capture ledger
    _readable(text)
    assert _row(text, "buckets").startswith(f"{len(region.stats.buckets)} graphs, bs 1,2")
    assert region.stats.as_dict()["seconds"] == region.stats.seconds
    prefill.shutdown()
