"""The engine's host time by phase on the CPU: ``benchmarks/engine_host.py`` runs small and
reports every phase at every batch size; an engine with a ``PhaseTimer`` records one sample a
step and none without; the decode rows kept across steps (``DecodeRows``) feed the runner the
rows a whole rebuild would, with the longest KV length of each step, and only advance while the
batch holds the same requests."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from stepgraph.batch import PACKED
from stepgraph.engine import Engine
from stepgraph.engine.phase_timer import PHASES, PhaseTimer
from stepgraph.model import ModelRunner
from stepgraph.model.decode import decode_rows as rows_mod
from stepgraph.runner import RunnerConfig

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location(
        "engine_host", ROOT / "benchmarks" / "engine_host.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_benchmark_reports_every_phase_at_every_batch_size(tmp_path):
    out = tmp_path / "host.json"
    res = _bench().main(
        ["--device", "cpu", "--batch-sizes", "1,3", "--steps", "6", "--json", str(out)]
    )
    assert json.loads(out.read_text()) == res
    assert res["phases"] == list(PHASES) and set(res["bs"]) == {"1", "3"}
    for bs, row in res["bs"].items():
        assert row["decode_rows_seen"] == int(bs)  # every request decoded together
        assert all(row[p] >= 0 for p in PHASES) and row["total"] > 0
        assert row["total"] >= max(row[p] for p in PHASES)


def _engine(staged: bool) -> Engine:
    mr = ModelRunner.from_preset(
        "tiny", "cpu", torch.float32, seed=1, max_bs=4, max_context_len=64, num_pages=40
    )
    config = RunnerConfig(max_bs=4, show_progress=False, pinned_staging=staged)
    return Engine(mr, "graph", config)


def test_a_timer_records_one_sample_a_step_and_none_when_off():
    engine = _engine(False)
    engine.add_request([1, 2, 3], 6, ignore_eos=True)
    engine.step()
    timer = PhaseTimer()
    engine.timer = timer
    assert engine.decoder.timer is timer
    for _ in range(3):
        engine.step()
    assert timer.steps == 3
    us = timer.per_step_us()
    assert us["replay"] > 0 and us["batch_rows"] > 0 and us["total"] >= us["replay"]
    engine.timer = None
    engine.step()
    assert timer.steps == 3 and engine.decoder.timer is None


@pytest.mark.parametrize("staged", [False, True])
def test_kept_rows_equal_rows_built_whole_and_advance_while_the_batch_holds(monkeypatch, staged):
    engine = _engine(staged)
    seen, advances = [], []
    replay, advance = engine.runner.replay, rows_mod.DecodeRows.advance

    def spy(batch):
        seen.append((batch.packed_cpu.numpy().copy(), batch.max_seq_len))
        return replay(batch)

    def counted(self, bs):
        advances.append(bs)
        return advance(self, bs)

    monkeypatch.setattr(engine.runner, "replay", spy)
    monkeypatch.setattr(rows_mod.DecodeRows, "advance", counted)
    # three requests, one joining late and one finishing early: the batch changes twice
    engine.add_request(list(range(1, 6)), 14, ignore_eos=True)
    engine.add_request(list(range(1, 20)), 4, ignore_eos=True)
    for _ in range(3):
        engine.step()
    engine.add_request(list(range(3, 12)), 9, ignore_eos=True)
    while engine.has_unfinished:
        engine.step()
    ps, col = engine.model_runner.page_size, PACKED.fields.index
    for rows, longest in seen:
        pos, seq = rows[:, col("positions")], rows[:, col("seq_lens")]
        np.testing.assert_array_equal(seq, pos + 1)
        page = rows[np.arange(len(rows)), PACKED.table_col + pos // ps]
        np.testing.assert_array_equal(rows[:, col("out_cache_loc")], page * ps + pos % ps)
        assert longest == seq.max()
    assert advances and len(advances) < len(seen)  # advanced, and rebuilt on each change
