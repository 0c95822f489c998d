"""``DecodeTuning`` variants from text: ``with_overrides(tuning, {"split.wide_min_keys": "128"})``
(``benchmarks/ab_step.py``'s ``--variant``), each value parsed for its field and checked by the
field itself."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from .tuning import DecodeTuning


def parse_buckets(name: str, text: str) -> range | None:
    """A bucket range from text: ``LO-HI`` (buckets LO..HI), ``none`` (no bucket, ``range(0)``)
    or ``table`` (None: the table's)."""
    text = text.strip().lower()
    if text == "table":
        return None
    try:
        lo, _, hi = text.partition("-")
        return range(0) if text == "none" else range(int(lo), int(hi) + 1)
    except ValueError:
        raise ValueError(f"{name}={text!r}: give LO-HI (e.g. 2-32), none or table") from None


def parse_pairs(name: str, text: str) -> frozenset:
    """``kernel:BLOCK_M`` pairs from text (``qkv_rope:16,gate_up_silu:32``); ``all`` is every
    pair of qkv_rope and gate_up_silu."""
    if text.strip() == "all":
        return frozenset((k, bm) for k in ("qkv_rope", "gate_up_silu") for bm in (16, 32, 64))
    items = (i.strip().partition(":") for i in text.split(","))
    try:
        return frozenset((kernel, int(bm)) for kernel, _, bm in items if kernel)
    except ValueError:
        raise ValueError(f"{name}={text!r}: give kernel:BLOCK_M pairs, e.g. qkv_rope:16") from None


def _parse(name: str, current, text: str):
    """``text`` as a value of field ``name`` whose present value is ``current``."""
    if name in ("reference_rows", "fold_merge", "pdl.no_pdl_buckets"):
        return parse_buckets(name, text)
    if name.endswith("_everywhere"):
        return parse_pairs(name, text)
    if name in ("tables.reference_buckets", "tables.no_pdl_buckets"):
        if text.strip() != "none":
            raise ValueError(f"{name}={text!r}: only none (no model's) is taken from text")
        return frozenset()
    if isinstance(current, bool):
        if text.strip().lower() not in ("0", "1", "true", "false"):
            raise ValueError(f"{name}={text!r}: give 0 or 1")
        return text.strip().lower() in ("1", "true")
    if isinstance(current, int):
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"{name}={text!r}: give an integer") from None
    if name == "tables.tiles_file":
        return text
    if current is None or isinstance(current, str):
        return None if text.strip() in ("", "none") else text.strip()
    raise ValueError(f"{name} cannot be set from text")


def with_overrides(tuning: DecodeTuning, overrides: Mapping[str, str]) -> DecodeTuning:
    """``tuning`` with fields replaced from text: ``{"split.wide_min_keys": "128",
    "pdl.enabled": "0", "reference_rows": "2-4", "tables.tiles_file": "tiles.json"}`` (a
    nested field by its dotted path; ``tables.tiles_file`` adds a sweep's tiles). Every value
    goes through the fields' checks; an unknown name is refused by name."""
    for name, text in overrides.items():
        if name == "tables.tiles_file":
            tables = tuning.tables.with_tiles_file(text)
            tuning = dataclasses.replace(tuning, tables=tables)
            continue
        head, _, leaf = name.partition(".")
        names = {f.name for f in dataclasses.fields(DecodeTuning)}
        if head not in names:
            raise ValueError(
                f"{name!r}: DecodeTuning has no field {head!r}; one of {sorted(names)}"
            )
        if not leaf:
            value = _parse(name, getattr(tuning, head), text)
            tuning = dataclasses.replace(tuning, **{head: value})
            continue
        inner = getattr(tuning, head)
        if not dataclasses.is_dataclass(inner) or leaf not in {
            f.name for f in dataclasses.fields(inner)
        }:
            raise ValueError(f"{name!r}: {head} has no field {leaf!r}")
        value = _parse(name, getattr(inner, leaf), text)
        tuning = dataclasses.replace(tuning, **{head: dataclasses.replace(inner, **{leaf: value})})
    return tuning


__all__ = ["parse_buckets", "parse_pairs", "with_overrides"]
