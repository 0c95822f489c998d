"""`stepgraph bench` mode ``engine``: what a user of ``Engine`` gets per decode step, end to end,
beside the GPU step of the other modes at the same points.

At each point ``(bs, context)`` the overlapped ``Engine`` (mode exact on CUDA, graph on the
CPU stand-in; the same kernels and buckets) serves ``bs`` requests whose prompts end
``E2E_NEW_TOKENS`` short of ``context``, eos ignored, and every ``engine.step()`` is timed on
the host. A decode-only step (no prefill in it, all ``bs`` requests decoding) costs, in steady
state, what one step of the loop costs the user: the batch built on the host, the replay,
sampling, the token copies. The row is the median of those steps (``E2E_NEW_TOKENS`` of them,
and more while the batch prefills: ``new_tokens_for``), after one untimed run of the same point
(Triton compiles, caches). Points past ``E2E_MAX_CONTEXT`` are skipped: their
prompts would take longer to prefill than the rest of the bench."""

from __future__ import annotations

import statistics
import time

import torch

from ..model.model_runner import ModelRunner
from .modes import ModeResult
from .workload import Point

E2E_NEW_TOKENS = 32
E2E_MAX_CONTEXT = 4096


def decode_step_ms(engine, prompts: list[list[int]], new_tokens: int) -> float:
    """Median host ms of the engine's decode-only steps serving ``prompts`` to the end."""
    rids = [engine.add_request(p, new_tokens, ignore_eos=True) for p in prompts]
    times = []
    while engine.has_unfinished:
        prefilled = engine.stats.prefill_tokens
        t0 = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - t0
        full = len(engine.running) == len(prompts) and not engine.waiting
        if engine.stats.prefill_tokens == prefilled and full:
            times.append(dt * 1e3)
    engine.drain()
    for rid in rids:
        engine.finished.pop(rid)
    return statistics.median(times) if times else float("nan")


def new_tokens_for(point: Point, max_prefill_tokens: int) -> int:
    """New tokens a request of ``point`` asks for: ``E2E_NEW_TOKENS`` decode-only steps after
    the whole batch is in. The first requests decode while the last ones prefill (at most
    ``max_prefill_tokens`` prompt tokens a step), so they ask for that many steps more; at bs
    64, 4096 keys, 32 new tokens alone finished the first requests before the last had started,
    and no step ran all 64 (the row was NaN)."""
    new = E2E_NEW_TOKENS
    while new < point.context and new - E2E_NEW_TOKENS < -(
        -point.bs * (point.context - new) // max_prefill_tokens
    ):
        new += 1
    return new


def run_engine(
    mr: ModelRunner, points: list[Point], seed: int = 0, max_prefill_tokens: int | None = None
) -> ModeResult:
    """The ``engine`` rows (module docstring)."""
    from ..engine import Engine
    from ..runner import RunnerConfig

    result, engine = ModeResult("engine", {}), None
    try:
        sizes = sorted({p.bs for p in points})
        config = RunnerConfig(capture_bs=sizes, show_progress=False)
        mode = "exact" if mr.device.type == "cuda" else "graph"  # exact edits CUDA graph nodes
        kw = {} if max_prefill_tokens is None else dict(max_prefill_tokens=max_prefill_tokens)
        engine = Engine(mr, mode, config, max_running=max(sizes), **kw)
        result.capture_seconds = engine.runner.stats.capture.seconds if engine.runner else None
        g = torch.Generator().manual_seed(seed)
        for p in points:
            # the last requests prefill while the first decode: at the decoding steps' cap
            with_decode = engine.max_prefill_tokens_with_decode or engine.max_prefill_tokens
            new = new_tokens_for(p, min(engine.max_prefill_tokens, with_decode))
            if p.context > E2E_MAX_CONTEXT or p.context <= new:
                continue
            shape = (p.bs, p.context - new)
            prompts = torch.randint(1, mr.config.vocab_size, shape, generator=g).tolist()
            decode_step_ms(engine, prompts, new)  # untimed: compiles, warms caches
            result.ms_per_token[p] = decode_step_ms(engine, prompts, new)
    except Exception as e:  # reported as a failed row, never dropped
        result.error = f"{type(e).__name__}: {e}"[:300]
    finally:
        if engine is not None:
            engine.shutdown()
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return result


__all__ = ["E2E_MAX_CONTEXT", "E2E_NEW_TOKENS", "decode_step_ms", "new_tokens_for", "run_engine"]
