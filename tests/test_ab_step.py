"""``benchmarks/ab_step.py``'s variants on the CPU: the ``name:field=V;group.field=V2`` grammar
(values may hold commas and ``=``), that a variant is a ``DecodeTuning`` with exactly its fields
changed (each variant from the defaults, none from the one before), that a bad field is refused
by name, that a variant's runner carries its tuning down to the backend's ladder, and that a
sweep's tiles file serves its variant alone. No module is patched."""

from __future__ import annotations

import dataclasses
import importlib.util
import pathlib

import pytest

from stepgraph.kernels.decode.splits import SplitLadder
from stepgraph.kernels.proj import proj_tiles
from stepgraph.kernels.proj.tile_table import TILES, Tile
from stepgraph.model import ModelRunner
from stepgraph.model.decode import fused_decode, step_attention
from stepgraph.tuning import DecodeTuning

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load_ab():
    spec = importlib.util.spec_from_file_location("ab_step", ROOT / "benchmarks" / "ab_step.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_parse_variant():
    ab = load_ab()
    assert ab.parse_variant("base:") == ("base", {})
    assert ab.parse_variant("x:tables.cublas_everywhere=qkv_rope:16,lm_head:32;tma=0") == (
        "x",
        {"tables.cublas_everywhere": "qkv_rope:16,lm_head:32", "tma": "0"},
    )
    assert ab.parse_variant("y: reference_rows = 2-4 ;") == ("y", {"reference_rows": "2-4"})


def test_variants_are_tunings_from_the_defaults():
    ab = load_ab()
    base = DecodeTuning()
    first = ab.variant_tuning(
        {
            "pdl.no_pdl_buckets": "2-64",
            "handoff.enabled": "0",
            "handoff.min_bucket": "8",
            "pdl.attention": "1",
            "fold_merge": "8-32",
            "split.min_keys": "128",
            "split.cap2_min_keys": "512",
        },
        base,
    )
    assert first.pdl.no_pdl_buckets == range(2, 65) and first.handoff.enabled is False
    assert first.handoff.min_bucket == 8
    assert first.pdl.attention_modes == (True, True, None)
    assert first.fold_merge == range(8, 33) and first.split.min_keys == 128
    assert first.split.cap2_min_keys == 512
    second = ab.variant_tuning({"reference_rows": "2-4"}, base)  # the first undone
    assert second == dataclasses.replace(base, reference_rows=range(2, 5))
    assert second.pdl.no_pdl_buckets is None and second.handoff.enabled is True
    assert second.handoff.min_bucket == 2 and second.pdl.attention is None
    assert second.fold_merge is None and second.split == SplitLadder()
    assert ab.variant_tuning({}, base) == base  # the defaults, unchanged by the variants
    # the step's decisions follow each variant's tuning
    assert fused_decode.no_pdl(3072, 2048, 8, 2, first) and not fused_decode.no_pdl(
        3072, 2048, 8, 2, second
    )
    assert step_attention.merges((32, 8, 64), 8, first)
    assert not step_attention.merges((32, 8, 64), 8, second)


def test_a_bad_variant_is_refused_by_name():
    ab = load_ab()
    with pytest.raises(ValueError, match="split.min_keys=100 must be a positive multiple of 64"):
        ab.variant_tuning({"split.min_keys": "100"})
    with pytest.raises(ValueError, match="DecodeTuning has no field 'nope'"):
        ab.variant_tuning({"nope": "1"})
    with pytest.raises(ValueError, match="split has no field 'least'"):
        ab.variant_tuning({"split.least": "64"})
    with pytest.raises(ValueError, match="reference_rows='2_4'"):
        ab.variant_tuning({"reference_rows": "2_4"})


def test_the_cublas_handoff_and_the_table_overrides():
    ab = load_ab()
    eight = (6144, 4096, 4)  # a reference bucket (the shipped table has none)
    base = dataclasses.replace(
        DecodeTuning(),
        tables=dataclasses.replace(DecodeTuning().tables, reference_buckets={eight}),
    )
    assert proj_tiles.reference_bucket(*eight, tables=base.tables)
    t = ab.variant_tuning(
        {
            "handoff.cublas": "0",
            "tables.separate_norm_everywhere": "qkv_rope:64",
            "tables.cublas_everywhere": "gate_up_silu:16",
            "tables.reference_buckets": "none",
        },
        base,
    )
    assert t.handoff.cublas is False
    assert not proj_tiles.reference_bucket(*eight, tables=t.tables)
    assert t.tables.separate_norm_everywhere == {("qkv_rope", 64)}
    assert t.tables.cublas_everywhere == {("gate_up_silu", 16)}
    assert proj_tiles.separate_norm("qkv_rope", 64, 3072, 2048, tables=t.tables)
    assert proj_tiles.prefer_cublas("gate_up_silu", 16, 16384, 2048, tables=t.tables)
    back = ab.variant_tuning({}, base)
    assert back.handoff.cublas is True and proj_tiles.reference_bucket(*eight, tables=back.tables)
    assert back.tables.separate_norm_everywhere == set() == back.tables.cublas_everywhere
    assert not proj_tiles.separate_norm("qkv_rope", 64, 3072, 2048, tables=back.tables)


def test_the_swept_tiles_serve_their_variant_alone(tmp_path):
    """``tables.tiles_file`` per variant: its tiles in that variant's tables (a ``cublas`` key
    among them tried as a tile), the shipped tables in every other."""
    ab = load_ab()
    gu, qkv64 = ("gate_up_silu_normed", 16384, 2048, 16), ("qkv_rope", 3072, 2048, 64)
    base = DecodeTuning()
    assert qkv64 in base.tables.cublas
    path = tmp_path / "tiles.json"
    path.write_text(
        '{"gate_up_silu_normed,16384,2048,16": [64, 128, 4, 5, 1, 1], '
        '"qkv_rope,3072,2048,64": [16, 128, 4, 3, 4]}'
    )
    swept = ab.variant_tuning({"tables.tiles_file": str(path)}, base)
    assert swept.tables.tiles[gu] == Tile(64, 128, 4, 5, 1, 1) != TILES[gu]
    assert qkv64 not in swept.tables.cublas and swept.tables.tiles[qkv64] == Tile(16, 128, 4, 3, 4)
    assert proj_tiles.tile_for("gate_up_silu_normed", 16, 16384, 2048, 2, swept.tables) == Tile(
        64, 128, 4, 5, 1, 1
    )
    other = ab.variant_tuning({}, base)
    assert other.tables.tiles[gu] == TILES[gu] and qkv64 in other.tables.cublas


def test_a_variant_runner_carries_its_tuning_to_the_ladder():
    ab = load_ab()
    mr = ModelRunner.from_preset("tiny", max_bs=2, max_context_len=256)
    wide = ab.variant_tuning({"split.min_keys": "256"}, DecodeTuning())
    vr = ab.variant_runner(mr, wide, 2)
    assert vr.model is mr.model and vr.tuning is wide and vr.attn_backend.tuning is wide
    assert vr.attn_backend.split_keys is not mr.attn_backend.split_keys
    assert vr.attn_backend.split_keys(4096, 8, 1, 132) >= 256


def test_engine_times_each_batch_size_on_the_variants_runner():
    """``--engine``: per bs a positive median of the engine's decode-only steps, over the
    variant's own runner, which carries the variant's tuning and the same weights."""
    import torch

    from stepgraph.bench.workload import build_model_runner

    ab = load_ab()
    mr = build_model_runner("tiny", "cpu", torch.float32, 4, 128)
    vr = ab.variant_runner(mr, ab.variant_tuning({"token_mirror": "0"}), 4)
    assert not vr.tuning.token_mirror and vr.model is mr.model
    ms = ab.engine_ms(vr, [1, 4], 96)
    assert sorted(ms) == [1, 4] and all(0 < t < 1e4 for t in ms.values())
