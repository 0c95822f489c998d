"""The engine records its decode batch sizes; `stepgraph buckets` plans from the written trace,
and a runner captured with the planned buckets gives the eager tokens."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("stepgraph.runner")

from stepgraph.bucket_plan import padding_waste, read_trace  # noqa: E402
from stepgraph.cli import main  # noqa: E402
from stepgraph.engine import Engine  # noqa: E402
from stepgraph.model import ModelRunner  # noqa: E402
from stepgraph.runner import RunnerConfig  # noqa: E402


def _run(engine: Engine, prompts: list[list[int]], lengths: list[int]) -> list[list[int]]:
    rids = [engine.add_request(p, n) for p, n in zip(prompts, lengths)]
    while engine.has_unfinished:
        engine.step()
    return [engine.finished.pop(r).output for r in rids]


def test_trace_to_buckets_to_runner(tmp_path, capsys):
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, 512, (int(n),), generator=g).tolist() for n in (4, 9, 2, 6, 3)]
    lengths = [2, 9, 5, 7, 3]  # requests finish at different steps: the batch shrinks 5 -> 1
    mr = ModelRunner.from_preset("tiny", "cpu", torch.float32, 0, max_bs=8, max_context_len=64)
    eager = Engine(mr, mode="eager")
    want = _run(eager, prompts, lengths)
    hist = eager.stats.batch_sizes
    # decode steps: 8 at least one request (the longest runs 8 decodes), sizes from 5 down to 1
    assert sum(hist.values()) == max(lengths) - 1 and min(hist) == 1 and max(hist) == 5
    assert sum(bs * n for bs, n in hist.items()) == eager.stats.decode_tokens

    trace = tmp_path / "trace.txt"
    eager.stats.write_trace(str(trace))
    assert read_trace(trace.read_text()) == hist

    assert main(["buckets", "--trace", str(trace), "--max-graphs", "2", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert set(plan) == {
        "buckets",
        "padding_waste",
        "padding_waste_pct",
        "default_padding_waste",
        "default_padding_waste_pct",
    }
    assert len(plan["buckets"]) <= 2 and plan["buckets"][-1] == 5
    assert plan["padding_waste"] == pytest.approx(padding_waste(hist, plan["buckets"]))

    assert main(["buckets", "--trace", str(trace), "--max-graphs", "3"]) == 0
    text = capsys.readouterr().out
    assert "padding waste" in text and "default power-of-two set" in text

    config = RunnerConfig(capture_bs=plan["buckets"], show_progress=False)
    engine = Engine(mr, mode="graph", runner_config=config)
    assert engine.runner.capture_bs == plan["buckets"]
    assert _run(engine, prompts, lengths) == want
    assert engine.stats.graph_steps == sum(hist.values())  # every step fit a planned bucket
    engine.shutdown()
