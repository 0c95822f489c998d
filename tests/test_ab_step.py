"""``benchmarks/ab_step.py``'s variants on the CPU: the ``name:VAR=V;VAR2=V2`` grammar (values
may hold commas and ``=``), and that applying a variant sets its switches, re-reads the step's
import-time flags, and that the next variant starts from the original environment."""

from __future__ import annotations

import importlib.util
import os
import pathlib

from stepgraph.kernels import splits
from stepgraph.model import fused_decode, fused_mlp, step_attention

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load_ab():
    spec = importlib.util.spec_from_file_location("ab_step", ROOT / "benchmarks" / "ab_step.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_parse_variant():
    ab = load_ab()
    assert ab.parse_variant("base:") == ("base", {})
    assert ab.parse_variant("x:STEPGRAPH_A=o,gu=0.25;STEPGRAPH_B=1") == (
        "x", {"STEPGRAPH_A": "o,gu=0.25", "STEPGRAPH_B": "1"},
    )  # fmt: skip
    assert ab.parse_variant("y: STEPGRAPH_C = 2-4 ;") == ("y", {"STEPGRAPH_C": "2-4"})


def test_apply_sets_rereads_and_restores(monkeypatch):
    ab = load_ab()
    monkeypatch.delenv("STEPGRAPH_NO_PDL_BUCKETS", raising=False)
    monkeypatch.setenv("STEPGRAPH_NORM_HANDOFF", "1")
    monkeypatch.delenv("STEPGRAPH_HANDOFF_MIN_BUCKET", raising=False)
    monkeypatch.delenv("STEPGRAPH_ATTENTION_PDL", raising=False)
    for name in ("NO_PDL_ENV", "NORM_HANDOFF", "REFERENCE_ROWS", "HANDOFF_MIN_BUCKET"):
        monkeypatch.setattr(fused_decode, name, getattr(fused_decode, name))  # restored after
    for name in ("ATTENTION_PDL", "FOLD_MERGE"):
        monkeypatch.setattr(step_attention, name, getattr(step_attention, name))
    monkeypatch.setattr(splits, "MIN_SPLIT_KEYS", splits.MIN_SPLIT_KEYS)
    monkeypatch.setattr(splits, "CAP2_MIN_SPLIT_KEYS", splits.CAP2_MIN_SPLIT_KEYS)
    monkeypatch.delenv("STEPGRAPH_CAP2_MIN_SPLIT_KEYS", raising=False)
    monkeypatch.delenv("STEPGRAPH_FOLD_MERGE", raising=False)
    monkeypatch.delenv("STEPGRAPH_MIN_SPLIT_KEYS", raising=False)
    saved: dict = {}
    first = {"STEPGRAPH_NO_PDL_BUCKETS": "2-64", "STEPGRAPH_NORM_HANDOFF": "0",
             "STEPGRAPH_HANDOFF_MIN_BUCKET": "8", "STEPGRAPH_ATTENTION_PDL": "1",
             "STEPGRAPH_FOLD_MERGE": "8-32", "STEPGRAPH_MIN_SPLIT_KEYS": "128",
             "STEPGRAPH_CAP2_MIN_SPLIT_KEYS": "512"}  # fmt: skip
    ab.apply(first, saved)
    assert fused_decode.NO_PDL_ENV == range(2, 65) and fused_decode.NORM_HANDOFF is False
    assert fused_decode.HANDOFF_MIN_BUCKET == 8
    assert step_attention.ATTENTION_PDL == (True, True, None)
    assert step_attention.FOLD_MERGE == range(8, 33) and splits.MIN_SPLIT_KEYS == 128
    assert splits.CAP2_MIN_SPLIT_KEYS == 512
    ab.apply({"STEPGRAPH_REFERENCE_ROWS": "2-4"}, saved)  # the next variant: the first undone
    assert "STEPGRAPH_NO_PDL_BUCKETS" not in os.environ
    assert os.environ["STEPGRAPH_NORM_HANDOFF"] == "1"
    assert fused_decode.NO_PDL_ENV is None and fused_decode.NORM_HANDOFF is True
    assert fused_decode.REFERENCE_ROWS == range(2, 5)
    assert fused_decode.HANDOFF_MIN_BUCKET == 2 and step_attention.ATTENTION_PDL is None
    assert step_attention.FOLD_MERGE is None
    assert splits.MIN_SPLIT_KEYS == splits.MIN_SPLIT_KEYS_DEFAULT
    assert splits.CAP2_MIN_SPLIT_KEYS == splits.CAP2_MIN_SPLIT_KEYS_DEFAULT
    ab.apply({}, saved)  # the end of the run: the original environment
    assert "STEPGRAPH_REFERENCE_ROWS" not in os.environ
    assert fused_decode.REFERENCE_ROWS == range(0)


def test_apply_rereads_the_cublas_handoff_and_the_table_switches(monkeypatch):
    from stepgraph.kernels import proj_tiles

    ab = load_ab()
    for name in ("STEPGRAPH_CUBLAS_HANDOFF", "STEPGRAPH_SEPARATE_NORM", "STEPGRAPH_PROJ_CUBLAS",
                 "STEPGRAPH_REFERENCE_BUCKETS"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    eight = (6144, 4096, 4)  # a shipped reference bucket (the table has none since run J9)
    shipped = proj_tiles._TABLES
    monkeypatch.setattr(proj_tiles, "_TABLES", (*shipped[:2], {eight}))
    monkeypatch.setattr(fused_mlp, "CUBLAS_HANDOFF", fused_mlp.CUBLAS_HANDOFF)
    saved: dict = {}
    try:
        ab.apply({"STEPGRAPH_CUBLAS_HANDOFF": "0", "STEPGRAPH_SEPARATE_NORM": "qkv_rope:64",
                  "STEPGRAPH_PROJ_CUBLAS": "gate_up_silu:16",
                  "STEPGRAPH_REFERENCE_BUCKETS": "none"}, saved)  # fmt: skip
        assert fused_mlp.CUBLAS_HANDOFF is False
        assert not proj_tiles.reference_bucket(*eight)
        assert proj_tiles.SEPARATE_ANY == {("qkv_rope", 64)}
        assert proj_tiles.CUBLAS_ANY == {("gate_up_silu", 16)}
        assert proj_tiles.separate_norm("qkv_rope", 64, 3072, 2048)
        ab.apply({}, saved)
        assert fused_mlp.CUBLAS_HANDOFF is True and proj_tiles.reference_bucket(*eight)
        assert proj_tiles.SEPARATE_ANY == set() == proj_tiles.CUBLAS_ANY
        assert not proj_tiles.separate_norm("qkv_rope", 64, 3072, 2048)
    finally:
        for name in ("STEPGRAPH_SEPARATE_NORM", "STEPGRAPH_PROJ_CUBLAS",
                     "STEPGRAPH_REFERENCE_BUCKETS"):  # fmt: skip
            os.environ.pop(name, None)
        proj_tiles._TABLES = shipped
        proj_tiles.reload_env_tiles()


def test_apply_switches_the_swept_tiles_per_variant(tmp_path, monkeypatch):
    """``STEPGRAPH_PROJ_TILES`` per variant: its tiles in the table while the variant runs (a
    CUBLAS key among them tried as a tile), the table as shipped again after it."""
    from stepgraph.kernels import proj_tiles
    from stepgraph.kernels.tile_table import Tile

    ab = load_ab()
    monkeypatch.delenv(proj_tiles.TILES_ENV, raising=False)
    for name in ("NO_PDL_ENV", "NORM_HANDOFF", "REFERENCE_ROWS"):
        monkeypatch.setattr(fused_decode, name, getattr(fused_decode, name))
    gu, qkv64 = ("gate_up_silu_normed", 16384, 2048, 16), ("qkv_rope", 3072, 2048, 64)
    shipped = proj_tiles.TILES[gu]
    assert qkv64 in proj_tiles.CUBLAS
    path = tmp_path / "tiles.json"
    path.write_text('{"gate_up_silu_normed,16384,2048,16": [64, 128, 4, 5, 1, 1], '
                    '"qkv_rope,3072,2048,64": [16, 128, 4, 3, 4]}')  # fmt: skip
    saved: dict = {}
    try:
        ab.apply({proj_tiles.TILES_ENV: str(path)}, saved)
        assert proj_tiles.TILES[gu] == Tile(64, 128, 4, 5, 1, 1) != shipped
        assert qkv64 not in proj_tiles.CUBLAS
        assert proj_tiles.TILES[qkv64] == Tile(16, 128, 4, 3, 4)
        ab.apply({}, saved)
        assert proj_tiles.TILES[gu] == shipped and qkv64 in proj_tiles.CUBLAS
    finally:  # the shipped tables for the tests after this one, whatever happened here
        os.environ.pop(proj_tiles.TILES_ENV, None)
        proj_tiles.reload_env_tiles()
