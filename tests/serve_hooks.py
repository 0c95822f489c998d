"""Fault hooks for the engine process of the serve tests (``EngineSpec(setup=...)``, imported
in the spawned process): a request whose prompt starts with one of these ids makes every decode
step it runs in fail, slow down, end the process, or never return."""

from __future__ import annotations

import os
import time

FAULT, STALL, DIE, HANG, SLOW = 509, 508, 507, 506, 505  # the tests' other prompts: below 500
STALL_S, SLOW_S = 0.05, 0.5


def arm(engine) -> None:
    real = engine.decoder.logits

    def hooked(*a, **k):
        firsts = {r.prompt[0] for r in engine.running}
        if FAULT in firsts:
            raise RuntimeError("injected decode fault")
        if DIE in firsts:
            os._exit(3)
        if HANG in firsts:
            time.sleep(3600)
        if STALL in firsts:
            time.sleep(STALL_S)
        if SLOW in firsts:
            time.sleep(SLOW_S)
        return real(*a, **k)

    engine.decoder.logits = hooked


def require_warm(engine) -> None:
    """Run after the build's warm-up, before the engine says ready: refuse to start unless
    ``warm_up`` ran, left its requests out of every other count and nothing cached."""
    s = engine.stats
    if not s.warm_requests or s.prefill_steps or s.graph_steps or s.eager_steps:
        raise RuntimeError(f"the engine was not warmed up before ready: {s}")
    if engine.has_unfinished or engine.prefix_cache.num_cached:
        raise RuntimeError("the warm-up left requests or cached prompt pages behind")
