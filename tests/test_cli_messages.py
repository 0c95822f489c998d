"""One-line CLI messages that name the flag and agree with each other: `buckets --json` gives
the padding waste as the text shows it, ``--max-graphs 0`` and ``--stop-ids -4`` name their
flag, a bad config.json is named once, ``info --model nosuch`` prints its error before any
other line, and `bench --serve` prints no end-to-end step time from a single step."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from stepgraph.bench.serve_metrics import StepRecord
from stepgraph.bench.serve_report import MIN_E2E_STEPS, _decode_rows
from stepgraph.cli import main

from .guards import time_limit


def _one_line(capsys, argv) -> str:
    with time_limit(30):
        assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("stepgraph: error: "), captured.err
    assert captured.out == "", captured.out
    return lines[0]


def test_buckets_json_gives_the_percentage_the_text_shows(capsys, tmp_path):
    trace = tmp_path / "trace.txt"
    trace.write_text("1\n2\n3\n")
    assert main(["buckets", "--trace", str(trace), "--max-graphs", "2", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["buckets"] == [1, 3]
    assert plan["padding_waste"] == pytest.approx(7 / 6)  # rows run per real row
    assert plan["padding_waste_pct"] == pytest.approx(16.667, abs=1e-3)
    assert plan["default_padding_waste_pct"] == 0.0
    assert main(["buckets", "--trace", str(trace), "--max-graphs", "2"]) == 0
    assert f"{plan['padding_waste_pct']:.1f}% extra rows" in capsys.readouterr().out


@pytest.mark.parametrize("value", ["0", "-1"])
def test_max_graphs_below_one_names_the_flag(capsys, tmp_path, value):
    trace = tmp_path / "trace.txt"
    trace.write_text("1\n2\n")
    line = _one_line(capsys, ["buckets", "--trace", str(trace), "--max-graphs", value])
    assert "argument --max-graphs" in line and ">= 1" in line and "max_graphs" not in line
    assert main(["buckets", "--trace", str(trace), "--max-graphs", "1"]) == 0  # the limit


GEN = [
    "generate",
    "--model",
    "tiny",
    "--device",
    "cpu",
    "--prompt-ids",
    "1,2",
    "--max-new-tokens",
    "2",
]


@pytest.mark.parametrize("ids,bad", [("-4", "[-4]"), ("2,512", "[512]"), ("x", "'x'")])
def test_stop_ids_outside_the_vocabulary_name_the_flag(capsys, ids, bad):
    line = _one_line(capsys, [*GEN, "--stop-ids", ids])
    assert "argument --stop-ids" in line and bad in line, line


def test_stop_ids_at_the_vocabulary_edges_pass(capsys):
    assert main([*GEN, "--stop-ids", "0,511"]) == 0  # tiny's vocabulary: [0, 512)


def test_a_bad_config_json_is_named_once(capsys, tmp_path):
    (tmp_path / "config.json").write_text("{")
    line = _one_line(capsys, ["generate", "--model", str(tmp_path), "--prompt-ids", "1"])
    assert line.count(str(tmp_path / "config.json")) == 1, line
    assert "is not valid JSON" in line


def test_info_of_an_unknown_model_is_its_error_alone(capsys):
    line = _one_line(capsys, ["info", "--model", "nosuch"])
    assert "argument --model: 'nosuch'" in line


def _steps(bs: int, n: int) -> list[StepRecord]:
    return [StepRecord(0.0, 0.01, 0, bs, True) for _ in range(n)]


@pytest.mark.parametrize("n", [0, MIN_E2E_STEPS - 1, MIN_E2E_STEPS])
def test_e2e_step_time_needs_two_decode_steps(n):
    gpu = [{"bs": 2, "context": 16, "step_ms": 5.0, "how": "graph replay"}]
    (row,) = _decode_rows(gpu, _steps(2, n), "workload")
    assert row["e2e_steps"] == n
    if n < MIN_E2E_STEPS:  # one step is no measurement: null in the JSON, "-" in the table
        assert row["e2e_ms"] is None and row["e2e_over_step"] is None
    else:
        assert row["e2e_ms"] == pytest.approx(10.0) and row["e2e_over_step"] == pytest.approx(2)


def test_serve_plot_legend_covers_no_data(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from stepgraph.bench import serve_report
    from stepgraph.bench.serve_metrics import RequestTiming

    timings = []
    for i in range(6):
        t = RequestTiming(0.0, 8)
        t.token_times = [0.01 * (i + 1), 0.01 * (i + 2), 0.01 * (i + 3)]
        timings.append(t)
    report = {
        "meta": {"model": "tiny", "dtype": "float32", "device": "cpu"},
        "workload": {"num_requests": 6, "request_rate": "inf"},
    }
    saved = {}
    close = plt.close
    plt.close = lambda fig=None: saved.setdefault("fig", fig)
    try:
        serve_report.plot_requests(
            str(tmp_path / "serve.png"), report, SimpleNamespace(timings=timings)
        )
    finally:
        plt.close = close
    fig = saved["fig"]
    assert (tmp_path / "serve.png").stat().st_size > 0
    assert all(ax.get_legend() is None for ax in fig.axes)  # no legend inside a panel
    (legend,) = fig.legends
    fig.canvas.draw()
    box = legend.get_window_extent()
    for ax in fig.axes:
        assert not box.overlaps(ax.get_window_extent()), "the legend covers a panel"
    close(fig)
