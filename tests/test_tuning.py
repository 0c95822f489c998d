"""``stepgraph.tuning.DecodeTuning`` and ``stepgraph.env``: the defaults are the measured
winners the step ran before it had one object; every field refuses a bad value by its name;
the env switches are read when called (not at import) and fold into ``DecodeTuning.default()``;
a ``ModelRunner`` carries its tuning to the backend's ladder and to exact mode's updater; and
no module but ``stepgraph/env.py`` reads a ``STEPGRAPH_`` variable."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from stepgraph import env
from stepgraph.kernels.decode.splits import SplitLadder, fa_split_keys
from stepgraph.kernels.proj import tile_table
from stepgraph.tuning import (
    FOLD_MERGE_TABLE,
    ArgmaxFold,
    DecodeTuning,
    NormHandoff,
    PdlPlacement,
    ProjTables,
)
from stepgraph.tuning_text import with_overrides

ROOT = Path(__file__).resolve().parents[1]


def test_the_defaults_are_the_measured_winners():
    t = DecodeTuning()
    assert dict(t.tables.tiles) == tile_table.TILES and t.tables.cublas == tile_table.CUBLAS
    assert t.tables.separate_norm == tile_table.SEPARATE_NORM
    assert t.tables.reference_buckets == tile_table.REFERENCE_BUCKETS == set()
    assert t.tables.no_pdl_buckets == tile_table.NO_PDL_BUCKETS == set()
    assert t.tables.cublas_everywhere == t.tables.separate_norm_everywhere == set()
    assert t.pdl == PdlPlacement(True, None, "late", None, None)
    assert t.split == SplitLadder(128, 384, 64, 4)
    assert t.handoff == NormHandoff(True, 2, True)
    assert t.reference_rows == range(0) and t.fold_merge is None
    assert dict(t.fold_merge_table) == {(32, 8, 64): range(16, 33)} == dict(FOLD_MERGE_TABLE)
    assert t.argmax == ArgmaxFold(True, 8)
    assert (t.l2_prefetch_bytes, t.tma, t.staging_copy, t.attention_variant) == (
        16384,
        True,
        False,
        None,
    )


def test_frozen_and_read_only():
    t = DecodeTuning()
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.tma = False  # type: ignore[misc]
    with pytest.raises(TypeError):
        t.tables.tiles[("qkv_rope", 1, 1, 16)] = tile_table.Tile(16, 16)  # type: ignore[index]


@pytest.mark.parametrize(
    "make, field",
    [
        (lambda: DecodeTuning(l2_prefetch_bytes=-1), "l2_prefetch_bytes"),
        (lambda: DecodeTuning(tma=1), "tma"),
        (lambda: DecodeTuning(staging_copy="yes"), "staging_copy"),
        (lambda: DecodeTuning(reference_rows=[2, 3]), "reference_rows"),
        (lambda: DecodeTuning(reference_rows=range(2, 8, 2)), "reference_rows"),
        (lambda: DecodeTuning(attention_variant="fast"), "attention_variant"),
        (lambda: DecodeTuning(split=(128, 384, 64, 4)), "split"),
        (lambda: PdlPlacement(enabled=0), "pdl.enabled"),
        (lambda: PdlPlacement(rows_trigger="early"), "pdl.rows_trigger"),
        (lambda: PdlPlacement(no_pdl_buckets=8), "pdl.no_pdl_buckets"),
        (lambda: NormHandoff(min_bucket=0), "handoff.min_bucket"),
        (lambda: NormHandoff(cublas=None), "handoff.cublas"),
        (lambda: ArgmaxFold(per_thread=0), "argmax.per_thread"),
        (lambda: SplitLadder(programs_per_sm=0), "split.programs_per_sm"),
        (lambda: ProjTables(tiles={("qkv_rope", 1, 1, 16): (16, 16)}), "tables.tiles"),
        (lambda: ProjTables(cublas_everywhere={("qkv_rope", 8)}), "tables.cublas_everywhere"),
    ],
)
def test_a_bad_field_is_refused_by_name(make, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        make()


def test_limits_at_the_limit_and_one_past():
    assert NormHandoff(min_bucket=1).min_bucket == 1
    assert ArgmaxFold(per_thread=1).per_thread == 1
    assert DecodeTuning(l2_prefetch_bytes=0).l2_prefetch_bytes == 0
    assert SplitLadder(min_keys=64).min_keys == 64
    for bad in (65, 63):
        with pytest.raises(ValueError, match="split.min_keys"):
            SplitLadder(min_keys=bad)


def test_env_accessors_read_at_call_time(monkeypatch):
    for name in env.SWITCHES:
        monkeypatch.delenv(name, raising=False)
    assert env.pdl() and env.tma() and env.proj_tiles_path() is None and env.api_key() is None
    monkeypatch.setenv(env.PDL, "0")
    monkeypatch.setenv(env.TMA, "0")
    monkeypatch.setenv(env.API_KEY, "secret")
    assert not env.pdl() and not env.tma() and env.api_key() == "secret"
    monkeypatch.setenv(env.PDL, "1")
    assert env.pdl()
    monkeypatch.setenv(env.API_KEY, "")
    assert env.api_key() is None
    assert len(env.SWITCHES) <= 6


def test_default_folds_the_user_switches_in(monkeypatch, tmp_path):
    for name in env.SWITCHES:
        monkeypatch.delenv(name, raising=False)
    assert DecodeTuning.default() == DecodeTuning()
    monkeypatch.setenv(env.PDL, "0")
    monkeypatch.setenv(env.TMA, "0")
    t = DecodeTuning.default()
    assert t.pdl.enabled is False and t.tma is False
    assert dataclasses.replace(t, pdl=PdlPlacement(), tma=True) == DecodeTuning()
    path = tmp_path / "tiles.json"
    path.write_text(json.dumps({"lm_head,128256,2048,64": [128, 64, 4, 4, 1, 2]}))
    monkeypatch.setenv(env.PROJ_TILES, str(path))
    key = ("lm_head", 128256, 2048, 64)
    tables = DecodeTuning.default().tables
    assert tables.tiles[key] == tile_table.Tile(128, 64, 4, 4, 1, 2)
    assert key not in tables.cublas and key in tile_table.CUBLAS  # the shipped table untouched
    monkeypatch.delenv(env.PDL)
    monkeypatch.delenv(env.TMA)
    monkeypatch.delenv(env.PROJ_TILES)
    assert DecodeTuning.default() == DecodeTuning()


def test_with_overrides_replaces_exactly_the_named_fields():
    base = DecodeTuning()
    t = with_overrides(
        base,
        {
            "split.wide_min_keys": "128",
            "pdl.enabled": "0",
            "reference_rows": "2-4",
            "attention_variant": "n32w2s3-kt",
            "l2_prefetch_bytes": "0",
            "fold_merge": "table",
        },
    )
    assert t == dataclasses.replace(
        base,
        split=SplitLadder(wide_min_keys=128),
        pdl=PdlPlacement(enabled=False),
        reference_rows=range(2, 5),
        attention_variant="n32w2s3-kt",
        l2_prefetch_bytes=0,
    )
    assert with_overrides(base, {"fold_merge": "none"}).fold_merge == range(0)
    with pytest.raises(ValueError, match="pdl.enabled='maybe': give 0 or 1"):
        with_overrides(base, {"pdl.enabled": "maybe"})
    with pytest.raises(ValueError, match="l2_prefetch_bytes='16k': give an integer"):
        with_overrides(base, {"l2_prefetch_bytes": "16k"})


def test_a_runner_carries_its_tuning_to_the_ladder_and_exact_mode():
    from stepgraph.graph_update.exec_updater import default_exec_updater
    from stepgraph.model import ModelRunner

    wide = DecodeTuning(split=SplitLadder(min_keys=256))
    mr = ModelRunner.from_preset("tiny", max_bs=2, max_context_len=256, tuning=wide)
    assert mr.tuning is wide and mr.attn_backend.tuning is wide
    ladder = mr.attn_backend.split_keys
    assert ladder is not fa_split_keys and ladder(4096, 2, 1, 132) >= 256
    assert mr.attn_backend.splits_for(300, 1) == 1  # one split below 512 keys
    updater = default_exec_updater(mr)
    assert updater.split_keys is ladder  # exact mode retunes with the ladder eager takes
    plain = ModelRunner.from_preset("tiny", max_bs=2, max_context_len=256)
    assert plain.tuning == DecodeTuning.default() and plain.attn_backend.split_keys is fa_split_keys


def test_only_env_reads_stepgraph_switches():
    """No module of the package but ``env.py`` reads a ``STEPGRAPH_`` name from the
    environment: the other choices are ``DecodeTuning`` fields, passed down the step."""
    read = re.compile(
        r"(os\.environ|os\.getenv|environ\.get)[^\n]*STEPGRAPH_|STEPGRAPH_\w*\s*"
        r"[\"']?\s*\]?\s*in os\.environ"
    )
    names = re.compile(r"[\"']STEPGRAPH_\w+[\"']")
    offenders = []
    for path in sorted((ROOT / "stepgraph").rglob("*.py")):
        if path.name == "env.py" and path.parent.name == "stepgraph":
            continue
        text = path.read_text()
        if read.search(text) or (names.search(text) and "environ" in text):
            offenders.append(str(path.relative_to(ROOT)))
    assert offenders == []
    switches = set(re.findall(r"STEPGRAPH_\w+", (ROOT / "stepgraph" / "env.py").read_text()))
    assert switches == {
        "STEPGRAPH_PDL",
        "STEPGRAPH_TMA",
        "STEPGRAPH_PROJ_TILES",
        "STEPGRAPH_API_KEY",
    }
