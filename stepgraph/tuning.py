"""``DecodeTuning``: every measured choice of the decode step in one frozen, typed object.

Its defaults are the measured winners (docs/tuning.md lists each field with the evidence).
``ModelRunner(..., tuning=...)`` holds one and passes it down the step: the fused step, its
attention, the attention backend's split ladder (and exact mode's retuning with it) and the
kernel launchers take their choices from it as arguments. ``DecodeTuning.default()`` is the
defaults with the user's environment switches folded in (``stepgraph.env``: PDL off, TMA off, a
tiles file), read when it is called. ``stepgraph.tuning_text.with_overrides`` builds a variant
from text (``benchmarks/ab_step.py``: ``"split.wide_min_keys=128"``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import types
from collections.abc import Mapping
from dataclasses import dataclass, field

from . import env
from .kernels.decode.splits import DEFAULT_LADDER, SplitLadder
from .kernels.proj.tile_table import (
    CUBLAS,
    FP8_TILES,
    NO_PDL_BUCKETS,
    REFERENCE_BUCKETS,
    SEPARATE_NORM,
    TILES,
    Tile,
)

TRIGGER_MODES = {"wait": 1, "late": 2, "exit": 3, "early": 4, "detached": 5}  # kernels/pdl.py's
ATTENTION_PARTS = {
    "1": (True, True),
    "both": (True, True),
    "split": (True, False),
    "combine": (False, True),
}
TABLE_KERNELS = ("norm_gemv", "gemv_residual", "lm_head", "gate_up_silu", "qkv_rope")
# (n_heads, n_kv_heads, head_dim) -> the batch classes whose attention takes the fold with its
# merge where they have more than one split: Llama-3.2-1B's 16-32; Llama-3.1-8B lost at bs 16,
# so none there (docs/experiments.md#the-attention-in-one-launch).
FOLD_MERGE_TABLE: Mapping[tuple[int, int, int], range] = types.MappingProxyType(
    {(32, 8, 64): range(16, 33)}
)


def _check_range(name: str, value, none_ok: bool) -> None:
    if value is None and none_ok:
        return
    if not isinstance(value, range) or value.step != 1:
        raise ValueError(
            f"{name}={value!r} must be a range of buckets (range(lo, hi + 1))"
            + (" or None" if none_ok else "")
        )


def _check_pairs(name: str, pairs) -> None:
    for pair in pairs:
        if (
            not isinstance(pair, tuple)
            or len(pair) != 2
            or pair[0] not in TABLE_KERNELS
            or pair[1] not in (16, 32, 64)
        ):
            raise ValueError(
                f"{name}: {pair!r} must be (kernel, BLOCK_M), kernel one of {TABLE_KERNELS} "
                "and BLOCK_M one of 16, 32, 64"
            )


@dataclass(frozen=True)
class ProjTables:
    """The projections' measured tables (``kernels/proj/tile_table.py``): ``tiles`` per (kernel, n,
    k, BLOCK_M); where norm + cuBLAS won (``cublas``), where the norm as its own kernel won
    (``separate_norm``), where a model's bucket ran faster on the reference kernels
    (``reference_buckets``, keyed by its qkv weight's shape) or without PDL
    (``no_pdl_buckets``); and (kernel, BLOCK_M) pairs that take cuBLAS or the separate norm at
    every shape (``cublas_everywhere``, ``separate_norm_everywhere``: none by default)."""

    tiles: Mapping[tuple[str, int, int, int], Tile] = field(
        default_factory=lambda: types.MappingProxyType(dict(TILES))
    )
    cublas: frozenset = frozenset(CUBLAS)
    separate_norm: frozenset = frozenset(SEPARATE_NORM)
    reference_buckets: frozenset = frozenset(REFERENCE_BUCKETS)
    no_pdl_buckets: frozenset = frozenset(NO_PDL_BUCKETS)
    cublas_everywhere: frozenset = frozenset()
    separate_norm_everywhere: frozenset = frozenset()
    # FP8 weights' tiles, keyed as ``tiles`` (BLOCK_M 1 included): tile_table.FP8_TILES
    fp8_tiles: Mapping[tuple[str, int, int, int], Tile] = field(
        default_factory=lambda: types.MappingProxyType(dict(FP8_TILES))
    )

    def __post_init__(self) -> None:
        for table in ("tiles", "fp8_tiles"):
            for name, tile in getattr(self, table).items():
                if not isinstance(tile, Tile):
                    raise ValueError(f"tables.{table}[{name!r}]={tile!r} must be a Tile")
            if not isinstance(getattr(self, table), types.MappingProxyType):  # read-only
                object.__setattr__(self, table, types.MappingProxyType(dict(getattr(self, table))))
        for name in (
            "cublas",
            "separate_norm",
            "reference_buckets",
            "no_pdl_buckets",
            "cublas_everywhere",
            "separate_norm_everywhere",
        ):
            object.__setattr__(self, name, frozenset(getattr(self, name)))
        _check_pairs("tables.cublas_everywhere", self.cublas_everywhere)
        _check_pairs("tables.separate_norm_everywhere", self.separate_norm_everywhere)

    def with_tiles_file(self, path: str) -> ProjTables:
        """These tables with the tiles of ``path`` (``benchmarks/proj_sweep.py --tiles-out``,
        ``{"kernel,n,k,block_m": [tile fields]}``) added, each in place of a ``cublas`` choice
        of the same key (the sweep's tile is tried); keys ``"fp8:kernel,n,k,block_m"`` (its
        ``--quantization fp8``) go to ``fp8_tiles``."""
        with open(path) as f:
            items = json.load(f).items()
        tiles, cublas, fp8 = dict(self.tiles), set(self.cublas), dict(self.fp8_tiles)
        for key, fields in items:
            kernel, n, k, bm = key.split(",")
            if kernel.startswith("fp8:"):
                fp8[(kernel[4:], int(n), int(k), int(bm))] = Tile(*fields)
                continue
            tiles[(kernel, int(n), int(k), int(bm))] = Tile(*fields)
            cublas.discard((kernel, int(n), int(k), int(bm)))
        return dataclasses.replace(self, tiles=tiles, cublas=frozenset(cublas), fp8_tiles=fp8)


def attention_pdl_modes(spec: str) -> tuple:
    """``PdlPlacement.attention``'s text as (PDL on the split kernel, on the combine, trigger
    mode or None for the step's): ``0`` is off, (False, False, None); ``PARTS[:MODE]``, PARTS
    one of 1, both, split, combine and MODE a trigger mode (``split:exit``); or
    ``SPLIT,COMBINE``, each a mode or 0 (``detached,early``). A bad value is refused."""
    if spec == "0":
        return (False, False, None)
    modes = {"0": False, **TRIGGER_MODES}
    if "," in spec:
        split, _, combine = spec.partition(",")
        if split in modes and combine in modes:
            return (modes[split], modes[combine], None)
    else:
        parts, sep, mode = spec.partition(":")
        if parts in ATTENTION_PARTS and (not sep or mode in TRIGGER_MODES):
            return (*ATTENTION_PARTS[parts], TRIGGER_MODES[mode] if mode else None)
    raise ValueError(
        f"pdl.attention={spec!r}: expected 0, PARTS[:MODE] (PARTS one of "
        f"{sorted(ATTENTION_PARTS)}) or SPLIT,COMBINE, a MODE one of {sorted(TRIGGER_MODES)} "
        "(or 0 in SPLIT,COMBINE)"
    )


@dataclass(frozen=True)
class PdlPlacement:
    """Where the step launches with programmatic dependent launch (``kernels/pdl.py``).
    ``enabled``: PDL at all; ``trigger``: wait, late or exit in place of every launch's own mode
    (None: each keeps its own); ``rows_trigger``: the projections' mode from two rows;
    ``attention``: the attention's launches in ``attention_pdl_modes``'s text (None: the
    step's defaults, ``step_attention.default_pdl``); ``no_pdl_buckets``: the buckets whose
    projections launch without PDL, for every model (None: ``tables.no_pdl_buckets``)."""

    enabled: bool = True
    trigger: str | None = None
    rows_trigger: str = "late"
    attention: str | None = None
    no_pdl_buckets: range | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ValueError(f"pdl.enabled={self.enabled!r} must be a bool")
        if self.trigger not in (None, "wait", "late", "exit"):
            raise ValueError(f"pdl.trigger={self.trigger!r}: expected one of exit, late, wait")
        if self.rows_trigger not in ("wait", "late", "exit"):
            raise ValueError(
                f"pdl.rows_trigger={self.rows_trigger!r}: expected one of exit, late, wait"
            )
        if self.attention is not None:
            attention_pdl_modes(self.attention)
        _check_range("pdl.no_pdl_buckets", self.no_pdl_buckets, True)

    @property
    def attention_modes(self) -> tuple | None:
        """``attention`` parsed (``attention_pdl_modes``), None where unset."""
        return None if self.attention is None else attention_pdl_modes(self.attention)


@dataclass(frozen=True)
class NormHandoff:
    """The norm handoff (``kernels/proj/norm_handoff.py``): on from bucket ``min_bucket``, and into
    a cuBLAS qkv or LM head too (``cublas``: the 1 / RMS applied after the GEMM)."""

    enabled: bool = True
    min_bucket: int = 2
    cublas: bool = True

    def __post_init__(self) -> None:
        for name in ("enabled", "cublas"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"handoff.{name}={getattr(self, name)!r} must be a bool")
        if type(self.min_bucket) is not int or self.min_bucket < 1:
            raise ValueError(f"handoff.min_bucket={self.min_bucket!r} must be an int >= 1")


@dataclass(frozen=True)
class ArgmaxFold:
    """Greedy tokens inside the LM head's launch from two rows (``fold``; one row keeps two
    launches), the reduce holding ``per_thread`` partials a thread."""

    fold: bool = True
    per_thread: int = 8

    def __post_init__(self) -> None:
        if not isinstance(self.fold, bool):
            raise ValueError(f"argmax.fold={self.fold!r} must be a bool")
        if type(self.per_thread) is not int or self.per_thread < 1:
            raise ValueError(f"argmax.per_thread={self.per_thread!r} must be an int >= 1")


@dataclass(frozen=True)
class DecodeTuning:
    """Every measured choice of the decode step (docs/tuning.md). ``reference_rows``: buckets
    the fused step runs on the reference kernels; ``fold_merge``: the attention's fold-merge
    classes for every shape (None: ``fold_merge_table``); ``l2_prefetch_bytes``: what a
    projection program asks L2 for before its PDL wait (0: none); ``tma``: the tiles' TMA
    stream; ``staging_copy``: a captured step reads its staged inputs from a device copy, not
    pinned memory; ``token_mirror``: a staged runner's graph stores the feed (the fused step's
    greedy ids) to pinned host memory itself, and the engine reads its tokens there instead of
    copying them after the replay (``runner/token_mirror.py``); ``attention_variant``: a
    ``KernelVariant`` name for every attention shape (None: ``flash_decode.DEFAULT_VARIANTS``)."""

    tables: ProjTables = field(default_factory=ProjTables)
    pdl: PdlPlacement = PdlPlacement()
    split: SplitLadder = DEFAULT_LADDER
    handoff: NormHandoff = NormHandoff()
    reference_rows: range = range(0)
    fold_merge: range | None = None
    fold_merge_table: Mapping[tuple[int, int, int], range] = field(
        default_factory=lambda: FOLD_MERGE_TABLE
    )
    argmax: ArgmaxFold = ArgmaxFold()
    l2_prefetch_bytes: int = 16384
    tma: bool = True
    staging_copy: bool = False
    token_mirror: bool = True
    attention_variant: str | None = None

    def __post_init__(self) -> None:
        for name, kind in (
            ("tables", ProjTables),
            ("pdl", PdlPlacement),
            ("split", SplitLadder),
            ("handoff", NormHandoff),
            ("argmax", ArgmaxFold),
        ):
            if not isinstance(getattr(self, name), kind):
                raise ValueError(f"{name} must be a {kind.__name__}, got {getattr(self, name)!r}")
        _check_range("reference_rows", self.reference_rows, False)
        _check_range("fold_merge", self.fold_merge, True)
        if type(self.l2_prefetch_bytes) is not int or self.l2_prefetch_bytes < 0:
            raise ValueError(f"l2_prefetch_bytes={self.l2_prefetch_bytes!r} must be an int >= 0")
        for name in ("tma", "staging_copy", "token_mirror"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be a bool")
        if self.attention_variant is not None:
            from .kernels.decode.decode_inputs import KernelVariant

            try:
                KernelVariant.from_name(self.attention_variant)
            except Exception as e:  # noqa: BLE001 - named by the field
                raise ValueError(f"attention_variant={self.attention_variant!r}: {e}") from None

    @staticmethod
    def default() -> DecodeTuning:
        """The measured defaults with the user's switches (``stepgraph.env``) folded in, read
        now: ``STEPGRAPH_PDL=0``, ``STEPGRAPH_TMA=0``, ``STEPGRAPH_PROJ_TILES``."""
        path = env.proj_tiles_path()
        stamp = os.stat(path).st_mtime_ns if path else None
        return _default(env.pdl(), env.tma(), path, stamp)


@functools.cache
def _default(pdl: bool, tma: bool, path: str | None, _stamp) -> DecodeTuning:
    tables = ProjTables().with_tiles_file(path) if path else ProjTables()
    return DecodeTuning(tables=tables, pdl=PdlPlacement(enabled=pdl), tma=tma)


def default_tuning(tuning: DecodeTuning | None = None) -> DecodeTuning:
    """``tuning``, or ``DecodeTuning.default()`` where None (a launcher called directly)."""
    return tuning if tuning is not None else DecodeTuning.default()


__all__ = [
    "FOLD_MERGE_TABLE",
    "TRIGGER_MODES",
    "ArgmaxFold",
    "DecodeTuning",
    "NormHandoff",
    "PdlPlacement",
    "ProjTables",
    "SplitLadder",
    "attention_pdl_modes",
    "default_tuning",
]
