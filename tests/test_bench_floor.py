"""The bench's bandwidth floor: (weights + live KV) over a read-only stream's bandwidth, beside
the same bytes over the GPU's specification bandwidth (a table by device name; "–" for a GPU
not in it), in the table, the JSON rows and the summary; the read streams' timing runs on the
CPU; the CPU stand-in has no floor at all."""

from __future__ import annotations

import json

import pytest
import torch

from stepgraph.bench.floor import NO_SPEC, Bandwidth, floor_ms, share, spec_gbps
from stepgraph.bench.report import COLUMNS, Row, format_table, summary, write_json
from stepgraph.bench.timing import read_bandwidth, read_bandwidth_gbps


def test_the_floor_is_the_bytes_over_the_read_bandwidth():
    assert floor_ms(4_800_000_000, 4800.0) == pytest.approx(1.0)
    assert floor_ms(2_470_000_000, 4000.0) == pytest.approx(0.6175)
    bw = Bandwidth(read_gbps=4000.0, spec_gbps=4800.0, gpu="NVIDIA H200", copy_gbps=4150.0)
    assert bw.floor_ms(4_000_000_000) == pytest.approx(1.0)
    assert bw.spec_ms(4_800_000_000) == pytest.approx(1.0)
    assert Bandwidth(4000.0, None, "some GPU").spec_ms(10**9) is None
    # a step of 1.25 ms over 1.0 ms of floor reaches 80% of it; unknown parts give None
    assert share(1.0, 1.25) == pytest.approx(0.8)
    assert share(None, 1.0) is None and share(1.0, None) is None


@pytest.mark.parametrize(
    "name,gbps",
    [
        ("NVIDIA H200", 4800.0),
        ("NVIDIA H200 NVL", 4800.0),
        ("NVIDIA H100 80GB HBM3", 3350.0),
        ("NVIDIA H100 PCIe", 2000.0),
        ("NVIDIA H100 NVL", 3900.0),
        ("NVIDIA A100-SXM4-80GB", 2039.0),
        ("NVIDIA A100-SXM4-40GB", 1555.0),
        ("NVIDIA A100 80GB PCIe", 1935.0),
        ("NVIDIA B200", 8000.0),
    ],
)
def test_the_specification_bandwidth_of_a_known_gpu(name, gbps):
    assert spec_gbps(name) == gbps


@pytest.mark.parametrize(
    "name", ["NVIDIA GH200 480GB", "NVIDIA GeForce RTX 4090", "Tesla T4", "", "H2000 Ada"]
)
def test_an_unknown_gpu_has_no_specification_bandwidth(name):
    assert spec_gbps(name) is None


def _rows() -> tuple[list[Row], dict]:
    floor = {(1, 512): 0.55, (8, 512): 0.6}
    rows = [
        Row("eager", 1, 512, 5.0, 200.0, 0.11, spec_fraction=0.092),
        Row("graph", 1, 512, 0.6, 1667.0, 0.917, kernels_per_step=50, spec_fraction=0.84),
        Row("graph", 8, 512, 0.58, 13793.0, 1.034, spec_fraction=0.95),  # printed, not clamped
    ]
    return rows, floor


def test_the_table_shows_the_floor_and_the_spec_side_by_side():
    rows, floor = _rows()
    bw = Bandwidth(4400.0, 4800.0, "NVIDIA H200", copy_gbps=4150.0)
    lines = format_table(rows, floor, bw).splitlines()
    assert lines[0] == (
        "NVIDIA H200: read stream 4400 GB/s; copy 4150 GB/s (read + write); specification 4800 GB/s"
    )
    assert "floor = (weights + live KV) / read stream" in lines[1]
    head = lines[2].split()
    assert head[:5] == ["mode", "bs", "ctx", "ms/tok", "tok/s"] and "note" in head
    assert "of floor" in lines[2] and "of spec" in lines[2]
    assert lines[2].index("of floor") < lines[2].index("of spec") < lines[2].index("vs eager")
    assert list(COLUMNS)[6:8] == ["of floor", "of spec"]
    graph1 = next(x for x in lines if x.startswith("graph") and x.split()[1] == "1")
    assert graph1.split()[5:9] == ["0.550", "92%", "84%", "8.3x"]
    graph8 = next(x for x in lines if x.startswith("graph") and x.split()[1] == "8")
    assert graph8.split()[6] == "103%"  # above the floor: shown as measured


def test_an_unknown_gpu_shows_a_dash_in_the_spec_column():
    rows, floor = _rows()
    rows = [Row(r.mode, r.bs, r.context, r.ms_per_token, None, r.floor_fraction) for r in rows]
    lines = format_table(rows, floor, Bandwidth(4400.0, None, "NVIDIA GH200 480GB"))
    assert f"specification {NO_SPEC} (unknown GPU)" in lines.splitlines()[0]
    graph1 = next(x for x in lines.splitlines() if x.startswith("graph") and " 1 " in x)
    assert graph1.split()[5:8] == ["0.550", "92%", NO_SPEC]


def test_the_json_rows_and_summary_name_both_fractions(tmp_path):
    rows, _ = _rows()
    path = tmp_path / "bench.json"
    write_json(str(path), rows, {"read_gbps": 4400.0, "spec_gbps": 4800.0})
    data = json.loads(path.read_text())
    assert {"floor_fraction", "spec_fraction"} <= set(data["rows"][0])
    assert data["rows"][1]["floor_fraction"] == 0.917 and data["rows"][1]["spec_fraction"] == 0.84
    assert summary(rows)["graph_floor_bs1_ctx512"] == 0.917
    assert summary(rows)["graph_spec_bs1_ctx512"] == 0.84


def test_the_read_streams_time_on_the_cpu():
    reads = read_bandwidth(1 << 22, device="cpu", warmup=1, iters=3)
    assert set(reads) == {"sum", "gemv"} and all(v > 0 for v in reads.values())
    assert read_bandwidth_gbps(1 << 22, device="cpu") > 0


def test_the_cpu_stand_in_has_no_floor(tmp_path, monkeypatch):
    from stepgraph.cli import main

    before = torch.get_num_threads()
    out = tmp_path / "bench.json"
    argv = ["bench", "--device", "cpu", "--modes", "eager", "--batch-sizes", "1"]
    try:
        assert main([*argv, "--contexts", "8", "--iters", "2", "--json", str(out)]) == 0
    finally:
        torch.set_num_threads(before)
    rows = json.loads(out.read_text())["rows"]
    assert rows and all(r["floor_fraction"] is None and r["spec_fraction"] is None for r in rows)
