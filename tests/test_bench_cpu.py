"""`stepgraph bench --device cpu`: one thread by default and said so, --json / --plot / --modes /
--iters honoured or refused by name, CPU prefill labels its targets as GPU targets."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("stepgraph.runner")
pytest.importorskip("matplotlib")

from stepgraph.cli import main  # noqa: E402

CPU = ["bench", "--device", "cpu", "--batch-sizes", "1,2", "--contexts", "8,16"]


@pytest.fixture
def threads(monkeypatch):
    """Start from torch's multi-thread default as a user's shell would; restore after."""
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_cpu_bench_writes_json_and_png(tmp_path, capsys, threads):
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    assert main([*CPU, "--iters", "3", "--json", str(out), "--plot", str(png)]) == 0
    text = capsys.readouterr().out
    assert "torch threads: 1 of" in text and torch.get_num_threads() == 1
    assert "no kernel launches for a graph to save" in text
    assert "graph tokens identical to eager: True" in text
    data = json.loads(out.read_text())
    assert data["meta"]["device"] == "cpu" and data["meta"]["iters"] == 3
    assert data["meta"]["threads"] == 1 and data["meta"]["tokens_match"] is True
    rows = data["rows"]
    assert sorted((r["mode"], r["bs"], r["context"]) for r in rows) == sorted(
        (m, b, c) for m in ("eager", "graph") for b in (1, 2) for c in (8, 16)
    )
    assert all(r["ms_per_token"] > 0 and r["floor_fraction"] is None for r in rows)
    assert all(r["capture_s"] > 0 for r in rows if r["mode"] == "graph")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000


def test_cpu_bench_modes_and_threads(tmp_path, capsys, threads):
    out = tmp_path / "eager.json"
    assert (
        main([*CPU, "--modes", "eager", "--threads", "2", "--iters", "2", "--json", str(out)]) == 0
    )
    text = capsys.readouterr().out
    assert "torch threads: 2 of" in text and "--threads" in text
    assert "identical to eager" not in text  # one mode: nothing to compare
    assert {r["mode"] for r in json.loads(out.read_text())["rows"]} == {"eager"}

    assert main([*CPU, "--modes", "eager,exact,hf-eager"]) == 2
    err = capsys.readouterr().err
    assert "--modes" in err and "exact" in err and "eager,graph" in err


def test_cpu_prefill_prints_no_gpu_floor_or_target(tmp_path, capsys, threads):
    out = tmp_path / "prefill.json"
    assert main(["bench", "--prefill", "--device", "cpu", "--iters", "2", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "target" not in text and "floor" not in text  # no GPU floor or target on the CPU
    assert "piecewise" in text and "packed prefill" in text
    got = json.loads(out.read_text())
    assert got["meta"]["targets_are_for"] == "cuda" and got["targets"] is None
    assert main(["bench", "--prefill", "--device", "cpu", "--plot", str(tmp_path / "p.png")]) == 2
    assert "--plot does not apply to --prefill" in capsys.readouterr().err
