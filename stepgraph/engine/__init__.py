"""The serving path: requests, the scheduler (pure functions: admission, the prefill token
budget, chunking) and the ``Engine`` loop over a ``ModelRunner``."""

from __future__ import annotations

from .engine import Engine
from .requests import GREEDY, EngineStats, Request, Sampling

__all__ = ["Engine", "EngineStats", "GREEDY", "Request", "Sampling"]
