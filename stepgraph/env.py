"""The one module that reads the environment: the few switches a user may need, each read when
its accessor is called (never at import), so a process sees a change at its next call.

- ``STEPGRAPH_PDL=0``: no programmatic dependent launch anywhere. Set it on a driver or GPU
  where PDL misbehaves, or to profile the kernels one after another.
- ``STEPGRAPH_TMA=0``: the tensor-core tiles stream their weights with pointer loads, not
  TMA. Set it where TMA descriptors fail (an old driver or Triton), or to compare.
- ``STEPGRAPH_PROJ_TILES=path``: a JSON file of tiles from ``benchmarks/proj_sweep.py
  --tiles-out``, added over the shipped table. Set it to run a new GPU's or model's sweep.
- ``STEPGRAPH_API_KEY``: the key ``stepgraph serve`` asks clients for (unset: no key).

Every other choice of the decode step is a field of ``stepgraph.tuning.DecodeTuning``, passed
explicitly (``ModelRunner(..., tuning=...)``); ``DecodeTuning.default()`` folds these in.
"""

from __future__ import annotations

import os

PDL = "STEPGRAPH_PDL"
TMA = "STEPGRAPH_TMA"
PROJ_TILES = "STEPGRAPH_PROJ_TILES"
API_KEY = "STEPGRAPH_API_KEY"
SWITCHES = (PDL, TMA, PROJ_TILES, API_KEY)


def pdl() -> bool:
    """False where ``STEPGRAPH_PDL=0``: no kernel launches with PDL."""
    return os.environ.get(PDL, "1") != "0"


def tma() -> bool:
    """False where ``STEPGRAPH_TMA=0``: the tiles take the pointer loop, not TMA."""
    return os.environ.get(TMA, "1") != "0"


def proj_tiles_path() -> str | None:
    """``STEPGRAPH_PROJ_TILES``: a sweep's tiles file to add over the shipped table, or None."""
    return os.environ.get(PROJ_TILES) or None


def api_key() -> str | None:
    """``STEPGRAPH_API_KEY``: the server's key (None or empty: no key asked)."""
    return os.environ.get(API_KEY) or None


__all__ = [
    "API_KEY",
    "PDL",
    "PROJ_TILES",
    "SWITCHES",
    "TMA",
    "api_key",
    "pdl",
    "proj_tiles_path",
    "tma",
]
