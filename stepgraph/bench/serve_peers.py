"""The peers of `stepgraph bench --serve`, on the same weights and the same requests: transformers'
continuous batching (``generate_batch``) on the whole workload, and transformers' static cache
(which it compiles) on the one-request latency case. A peer that is missing or fails comes
back with ``skipped`` set to the reason; nothing here raises.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..model.model_runner import ModelRunner
from .peers import _generate_seconds, build_hf_model
from .serve_metrics import RequestTiming

SERVE_PEERS = ("hf-cb", "hf-static-compile")
CB_WARMUP_REQUESTS, CB_WARMUP_TOKENS = 2, 4  # one small untimed call first: kernels, allocator


@dataclass
class PeerRun:
    peer: str
    seconds: float | None = None  # wall time of the timed call(s)
    timings: list[RequestTiming] = field(default_factory=list)  # per request, where exposed
    outputs: list[list[int]] = field(default_factory=list)
    setup_seconds: float | None = None  # hf-cb: call -> first request queued (its per-call set-up)
    ttft_ms: float | None = None  # hf-static-compile: generate of one new token
    tpot_ms: float | None = None  # hf-static-compile: (t(n) - t(1)) / (n - 1)
    skipped: str | None = None
    note: str = ""


def _reason(e: BaseException) -> str:
    return " ".join(f"{type(e).__name__}: {e}".split())[:300]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def hf_continuous_batching(mr: ModelRunner, prompts: list[list[int]], output_len: int) -> PeerRun:
    """``model.generate_batch`` on every prompt at once, greedy, eos disabled (-1), timed from
    the call to its return; per-token timestamps (``record_timestamps``) give its TTFT/TPOT/ITL
    from the moment it queued each request (``created_time``, after its per-call set-up)."""
    run = PeerRun("hf-cb")
    model = None
    try:
        import transformers
        from transformers import GenerationConfig

        model = build_hf_model(mr)
        if not hasattr(model, "generate_batch"):
            run.skipped = f"transformers {transformers.__version__} has no generate_batch (5.x)"
            return run

        def config(n: int) -> GenerationConfig:
            return GenerationConfig(
                max_new_tokens=n, do_sample=False, eos_token_id=-1, pad_token_id=0
            )

        model.generate_batch(
            prompts[:CB_WARMUP_REQUESTS], config(CB_WARMUP_TOKENS), progress_bar=False
        )
        _sync(mr.device)
        t0 = time.perf_counter()
        out = model.generate_batch(
            prompts, config(output_len), record_timestamps=True, progress_bar=False
        )
        _sync(mr.device)
        run.seconds = time.perf_counter() - t0
        results = list(out.values())  # in the order of the inputs
        failed = [r.error for r in results if r.error is not None]
        if len(results) != len(prompts) or failed:
            run.skipped = (
                f"generate_batch returned {len(results) - len(failed)} of {len(prompts)} "
                f"requests; first error: {failed[0] if failed else 'missing results'}"
            )[:300]
            return run
        run.outputs = [list(r.generated_tokens) for r in results]
        short = sum(len(o) != output_len for o in run.outputs)
        if short:
            run.note = f"{short} requests did not generate exactly {output_len} tokens"
        if all(r.timestamps for r in results):
            run.timings = [
                RequestTiming(r.created_time, len(p), list(r.timestamps))
                for r, p in zip(results, prompts)
            ]
            run.setup_seconds = min(r.created_time for r in results) - t0
    except Exception as e:  # reported as skipped, never fatal
        run.skipped = _reason(e)
    finally:
        del model
        _free(mr.device)
    return run


def hf_static_latency(mr: ModelRunner, prompt: list[int], output_len: int) -> PeerRun:
    """``generate`` with the static cache (compiled by transformers) on one prompt: each length
    run once untimed (compiles), then the best of two. TTFT = t(1 new token); TPOT =
    (t(output_len) - t(1)) / (output_len - 1), vLLM's definition on the same request."""
    run = PeerRun("hf-static-compile")
    model = None
    try:
        model = build_hf_model(mr)
        ids = torch.tensor([prompt], device=mr.device)
        kw = {"cache_implementation": "static"}
        with torch.no_grad():
            t0 = time.perf_counter()
            for n in (1, output_len):
                _generate_seconds(model, ids, n, **kw)
            warm = time.perf_counter() - t0
            t1 = min(_generate_seconds(model, ids, 1, **kw) for _ in range(2))
            tn = min(_generate_seconds(model, ids, output_len, **kw) for _ in range(2))
        run.seconds, run.ttft_ms = tn, t1 * 1e3
        run.tpot_ms = (tn - t1) / (output_len - 1) * 1e3
        run.note = f"first calls (compile) {warm:.1f} s"
    except Exception as e:
        run.skipped = _reason(e)
    finally:
        del model
        _free(mr.device)
    return run


__all__ = ["SERVE_PEERS", "PeerRun", "hf_continuous_batching", "hf_static_latency"]
