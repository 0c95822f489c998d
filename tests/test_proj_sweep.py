"""``benchmarks/proj_sweep.py --preset``: the shapes it sweeps are the weight shapes the fused
step looks its tiles up by (``fused_decode._measured``: ``lin.weight.shape``), so a sweep's
``--tiles-out`` file applies to that model. Checked on the tiny preset's real weights."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch

from stepgraph.model import ModelRunner

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load_sweep():
    spec = importlib.util.spec_from_file_location(
        "proj_sweep", ROOT / "benchmarks" / "proj_sweep.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_preset_shapes_are_the_model_weight_shapes():
    sweep = load_sweep()
    assert sweep.SHAPES["qkv"] == ("qkv_rope", 3072, 2048)  # llama-3.2-1b by default
    sweep.use_preset("tiny")
    mr = ModelRunner.from_preset("tiny", "cpu", torch.float32, max_bs=2, max_context_len=16)
    layer, model = mr.model.layers[0], mr.model
    weights = {
        "qkv": layer.self_attn.qkv_proj,
        "o_proj": layer.self_attn.o_proj,
        "gate_up": layer.mlp.gate_up_proj,
        "down": layer.mlp.down_proj,
        "lm_head": model.lm_head,
    }
    for case, lin in weights.items():
        assert sweep.SHAPES[case][1:] == tuple(lin.weight.shape), case
    assert sweep.SHAPES["qkv_normed"][1:] == sweep.SHAPES["qkv"][1:]
    sweep.use_preset("llama-3.1-8b")
    assert sweep.SHAPES["down"] == ("gemv_residual", 4096, 14336)


def test_a_local_hf_directory_gives_its_shapes(tmp_path):
    import json

    hf = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 1000,
        "hidden_size": 256,
        "intermediate_size": 688,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 512,
        "rope_theta": 10000.0,
    }
    (tmp_path / "config.json").write_text(json.dumps(hf))
    sweep = load_sweep()
    sweep.use_preset(str(tmp_path))
    assert sweep.SHAPES["qkv"] == ("qkv_rope", 256 + 2 * 64, 256)  # head_dim 32, 2 KV heads
    assert sweep.SHAPES["down"] == ("gemv_residual", 256, 688)
    assert sweep.SHAPES["lm_head"] == ("lm_head", 1000, 256)


def _cpu_sweep(monkeypatch):
    """The sweep on the CPU under the interpreter: float16 activations, 2 weight copies, a
    clock that counts calls instead of timing them."""
    sweep = load_sweep()
    monkeypatch.setattr(sweep, "DEVICE", "cpu")
    monkeypatch.setattr(sweep, "DT", torch.float16)
    monkeypatch.setattr(sweep, "COPIES", 2)
    monkeypatch.setattr(sweep, "copy_bandwidth_gbps", lambda: 1000.0)
    return sweep


def test_fp8_sweep_checks_every_tile_and_prints_the_fp8_table(monkeypatch, capsys, tmp_path):
    """``--quantization fp8``: every candidate (the launcher's own, bf16's tile through the
    pointer loop, FP8_CANDIDATES) is checked against float64 over the dequantized weights and
    timed; bf16's own tile on bf16 weights is timed beside them as the reference; the best
    FP8 tile per key is printed as the ``FP8_TILES`` literal. Tiny preset, rows 1 and 17."""
    sweep = _cpu_sweep(monkeypatch)
    timed = []
    monkeypatch.setattr(sweep, "graph_call_us", lambda fns, **k: timed.append(len(fns)) or 1.0)
    cases = "o_proj,gate_up_normed"
    tiles_file = tmp_path / "fp8_tiles.json"
    args = ["--quantization", "fp8", "--preset", "tiny", "--rows", "1,17", "--cases", cases]
    result = sweep.main([*args, "--tiles-out", str(tiles_file)])
    rows = result["rows"]
    assert {(r["kernel"], r["m"]) for r in rows} == {
        (c, m) for c in cases.split(",") for m in (1, 17)
    }
    assert all("us" in r for r in rows), [r for r in rows if "us" not in r]
    a8 = [r for r in rows if r["tile"][6] and r["weights"] == "fp8"]  # one row too
    assert a8 and all(r["rel_err"] < 8e-2 for r in a8)  # W8A8: x in e4m3
    assert all(r["rel_err"] < 2e-2 for r in rows if r not in a8)
    assert sum(r.get("reference", False) for r in rows) == 4  # bf16's, once a (case, rows)
    assert all(r["weights"] == ("bf16" if r.get("reference") else "fp8") for r in rows)
    assert all(r["bf16_us"] == 1.0 and r["cublas_us"] == 1.0 for r in rows)
    out = capsys.readouterr().out
    assert "FP8_TILES = {" in out and '("gemv_residual", 64, 64, 1): Tile(' in out
    assert len(result["best"]) == 4  # gemv_residual and gate_up_silu_normed at 1 and 32 rows
    # the tiles file carries them as FP8 tiles: STEPGRAPH_PROJ_TILES puts them in fp8_tiles
    from stepgraph.tuning import ProjTables

    tables = ProjTables().with_tiles_file(str(tiles_file))
    key = ("gemv_residual", 64, 64, 32)
    assert tables.fp8_tiles[key] == sweep.Tile(*result["best"][str(key)][1])
    assert key not in tables.tiles and tables.tiles == ProjTables().tiles
    with pytest.raises(SystemExit):
        sweep.main(["--quantization", "fp8", "--cases", "lm_head"])  # the head stays bf16
    assert "no lm_head case" in capsys.readouterr().err


def test_compile_shards_cover_every_tile_once(monkeypatch):
    """``--compile-only --shard i/n``: the n shards call every (case, rows, tile) exactly once
    between them, bf16's reference tile included."""
    sweep = _cpu_sweep(monkeypatch)
    seen = []
    real = sweep.case

    def case(name, m, g, copies, fp8=False):
        ws, call, ref = real(name, m, g, copies, fp8)
        return ws, (lambda w, t: seen.append((name, m, fp8, t)) or call(w, t)), ref

    monkeypatch.setattr(sweep, "case", case)
    args = ["--quantization", "fp8", "--preset", "tiny", "--rows", "1,2", "--cases", "down"]
    for i in range(3):
        assert sweep.main([*args, "--compile-only", "--shard", f"{i}/3"]) == {}
    items = sweep.work_items("down", (1, 2), True)
    want = [(n, m, kind == "fp8", t) for n, m, its in items for kind, t in its]
    assert sorted(map(str, seen)) == sorted(map(str, want)) and len(set(map(str, seen))) == len(
        seen
    )


def test_fp8_sweep_runs_the_fp8_steps_kernels_by_default():
    """Without ``--cases``: at one row the norm-prologue kernels, from 2 rows the handoff's
    _normed ones (the FP8 step's), never the LM head."""
    sweep = load_sweep()
    jobs = sweep.jobs("", (1, 8), fp8=True)
    assert [c for c, m in jobs if m == 1] == ["o_proj", "down", "gate_up", "qkv"]
    assert [c for c, m in jobs if m == 8] == ["o_proj", "down", "gate_up_normed", "qkv_normed"]
    assert all(len(sweep.candidates(c, m, True)) <= 13 for c, m in jobs)


def test_scaled_mm_bench_quantizes_each_row_to_the_e4m3_range():
    """``benchmarks/fp8_rows.py``'s x for cuBLAS FP8: every row's largest value lands on
    448 (e4m3's largest), and scale x e4m3 is x within e4m3's rounding (3 mantissa bits), over
    rows whose magnitudes span 1e-3 to 1e4."""
    import sys

    sys.path.insert(0, str(ROOT))
    from benchmarks.fp8_rows import E4M3_MAX, quantize_rows

    g = torch.Generator().manual_seed(3)
    mags = torch.tensor([1e-3, 1.0, 37.0, 1e4])[:, None]
    x = (torch.randn(4, 1000, generator=g) * mags).to(torch.bfloat16)
    q, s = quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (4, 1) and s.dtype == torch.float32
    assert torch.equal(q.float().abs().amax(1), torch.full((4,), E4M3_MAX))
    back = q.float() * s
    rel = (back - x.float()).norm(dim=1) / x.float().norm(dim=1)
    assert (rel < 0.04).all() and (rel > 0.005).all()  # rounded, by e4m3's step (2^-4 / sqrt 3)


def test_fp8_rows_bench_sums_a_layer_per_row_count_and_drops_a_way_that_failed():
    """``fp8_rows.layer_sums``: each way's µs over the four projections, per row
    count; a way cuBLAS refused for one projection has no sum at that row count."""
    import sys

    sys.path.insert(0, str(ROOT))
    from benchmarks.fp8_rows import WAYS, layer_sums

    def row(case, m, us, failed=()):
        return dict(case=case, m=m, **{w: None if w in failed else us for w in WAYS})

    rows = [row("qkv", 64, 1.0), row("down", 64, 2.5), row("qkv", 128, 3.0, failed=("w8a8",))]
    rows.append(row("down", 128, 4.0))
    sums = layer_sums(rows)
    assert sums[64] == dict.fromkeys(WAYS, 3.5)
    assert sums[128]["w8a8"] is None and sums[128]["bf16"] == 7.0
