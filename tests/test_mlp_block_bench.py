"""``benchmarks/mlp_block.py`` on the CPU: its code end to end at small fp16 shapes under the
interpreter (no timing), every block variant's outputs equal to the separate launches' bits, and
its environment switches restored after each variant."""

from __future__ import annotations

import importlib.util
import os
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load():
    spec = importlib.util.spec_from_file_location("mlp_block_bench", ROOT / "benchmarks" /
                                                  "mlp_block.py")  # fmt: skip
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_variant_has_the_separate_launches_bits(tmp_path, monkeypatch):
    bench = load()
    for env in bench.VARIANTS.values():
        for key in env:
            monkeypatch.delenv(key, raising=False)
    out = tmp_path / "r.json"
    rows = bench.main(["--device", "cpu", "--small", "--rows", "1,5", "--json", str(out)])
    ways = {(r["rows"], r["qkv"], r["way"]) for r in rows}  # one row: the block's own tiles
    assert ways == {(m, q, w) for m in (1, 5) for q in (False, True)
                    for w in ("separate", "block", "no-prefetch", "2-per-sm")}  # fmt: skip
    assert all(r["same_bits"] is True for r in rows if r["way"] != "separate")
    assert out.exists() and all("us" not in r for r in rows)
    assert not any(key in os.environ for env in bench.VARIANTS.values() for key in env)


def test_tile_overrides_reach_both_ways():
    """``--tile`` sets the block's tile, ``--same-tiles`` gives it to the separate launches too:
    the bits still agree (they would not if only one side took the override)."""
    bench = load()
    tiles = ["--tile", "gate_up=32,64,4,3,2,0", "--tile", "down=64,64,4,3,2,0"]
    rows = bench.main(["--device", "cpu", "--small", "--rows", "3", "--same-tiles", *tiles])
    blocks = [r for r in rows if r["way"] != "separate"]
    assert blocks and all(r["same_bits"] is True for r in blocks)
