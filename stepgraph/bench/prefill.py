"""`stepgraph bench --prefill`: packed prefill, eager vs piecewise graphs; then packed prefill of
1, 8 and 32 prompts of 512 tokens against transformers' batched forward (``prefill_packed``).

For each total of ``PREFILL_TOKENS`` four prompts of uneven lengths fill exactly that many tokens;
``ModelRunner.prefill`` (one prompt at a time) and ``PiecewisePrefill.prefill`` (one packed
batch, everything but attention replayed) are timed with CUDA events (medians), and their
logits compared. Capture seconds and pool MiB cover every piecewise shape of every region.
Targets (reported on CUDA, not enforced): >= 1.5x faster at <= 64 tokens, never > 3% slower at
2048. On the CPU no GPU target or floor is printed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from ..errors import ConfigError
from .prefill_packed import CPU_POINTS, PACKED_POINTS, format_packed, run_packed
from .prefill_packed import rows_json as packed_json

PREFILL_TOKENS = (16, 64, 256, 2048)
PROMPTS_PER_BATCH = 4
SHARES = (0.4, 0.3, 0.2)  # of the tokens, for the first three prompts; the last takes the rest
CPU_TOKENS = (8, 32)  # the CPU smoke run (tiny preset)
SMALL_TOKENS, SMALL_SPEEDUP = 64, 1.5  # target: >= 1.5x at <= 64 tokens
LARGE_SLOWDOWN = 1.03  # target: piecewise never > 3% slower at the largest batch


@dataclass
class PrefillRow:
    tokens: int
    lengths: list[int]
    eager_ms: float
    piecewise_ms: float
    speedup: float
    max_abs_logit_diff: float
    same_argmax: bool


def prompt_lengths(total: int, n: int = PROMPTS_PER_BATCH) -> list[int]:
    """``n`` uneven lengths >= 1 summing to ``total`` (the last takes the rest).

    >>> prompt_lengths(64)
    [26, 19, 13, 6]
    """
    lens = [max(1, round(total * s)) for s in SHARES[: n - 1]]
    return [*lens, total - sum(lens)]


def _time_ms(fn: Callable[[], object], device: torch.device, iters: int) -> float:
    if device.type == "cuda":
        from .timing import cuda_time_ms

        return cuda_time_ms(fn, warmup=5, iters=iters)
    fn()
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def run_prefill(args: argparse.Namespace) -> int:
    from ..model.prefill.piecewise_prefill import PiecewisePrefill, PrefillShapes
    from .constants import DTYPES
    from .workload import build_model_runner

    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print(
            "stepgraph bench --prefill: no CUDA GPU is visible; run it on a GPU machine, or "
            "smoke-test it with `stepgraph bench --prefill --device cpu`.",
            file=sys.stderr,
        )
        return 2
    for flag in ("modes", "plot"):  # decode-bench flags with no prefill meaning: refuse them
        if getattr(args, flag, None) is not None:
            raise ConfigError(
                f"--{flag} does not apply to --prefill (it times eager vs piecewise prefill, "
                f"one table); drop --{flag}, or drop --prefill for the decode bench."
            )
    model = args.model or ("llama-3.2-1b" if cuda else "tiny")
    if not cuda:
        from ..cli_args import model_config
        from .cpu import set_cpu_threads

        print(set_cpu_threads(getattr(args, "threads", None), model_config(model)))
    totals = PREFILL_TOKENS if cuda else CPU_TOKENS
    dtype_name = args.dtype or ("bfloat16" if cuda else "float32")
    dtype = DTYPES[dtype_name]
    points = PACKED_POINTS if cuda else CPU_POINTS
    max_bs = max(PROMPTS_PER_BATCH, *(b for b, _ in points))
    mr = build_model_runner(model, args.device, dtype, max_bs, max(totals) + 64)
    device = mr.device
    config = PrefillShapes() if cuda else PrefillShapes(totals, (1, 2, 4))
    t0 = time.perf_counter()
    piecewise = PiecewisePrefill(mr, config)
    capture_wall_s = time.perf_counter() - t0
    cap = piecewise.stats.capture
    iters = max(args.iters, 20) if cuda else args.iters  # CPU: exactly --iters samples
    rows = []
    g = torch.Generator().manual_seed(0)
    for total in totals:
        lens = prompt_lengths(total)
        prompts = [torch.randint(1, mr.config.vocab_size, (n,), generator=g).tolist() for n in lens]
        pages = [mr.kv_cache.reserve(n) for n in lens]
        ref = mr.prefill(prompts, pages).clone()
        got = piecewise.prefill(prompts, pages).clone()
        eager_ms = _time_ms(lambda p=prompts, q=pages: mr.prefill(p, q), device, iters)
        graphs = piecewise.stats.graph_batches
        pw_ms = _time_ms(lambda p=prompts, q=pages: piecewise.prefill(p, q), device, iters)
        if piecewise.stats.graph_batches == graphs:
            print(f"warning: {total} tokens ran eagerly (no shape holds {lens})", file=sys.stderr)
        rows.append(
            PrefillRow(
                total,
                lens,
                eager_ms,
                pw_ms,
                eager_ms / pw_ms,
                float((got - ref).abs().max()),
                bool((got.argmax(-1) == ref.argmax(-1)).all()),
            )
        )
        for p in pages:
            mr.kv_cache.release(p)
    small = [r.speedup for r in rows if r.tokens <= SMALL_TOKENS]
    large = rows[-1]
    targets = {
        f"speedup_at_<={SMALL_TOKENS}_tokens>={SMALL_SPEEDUP}": bool(small)
        and min(small) >= SMALL_SPEEDUP,
        f"at_{large.tokens}_tokens_not_>3%_slower": large.piecewise_ms
        <= large.eager_ms * LARGE_SLOWDOWN,
    }
    print(f"\nstepgraph bench --prefill: {model} ({dtype_name}, {device})")
    print(
        f"{'tokens':>7} {'lengths':<20} {'eager ms':>9} {'piecewise ms':>13} {'speedup':>8}"
        f" {'max|dlogit|':>12} {'argmax':>7}"
    )
    for r in rows:
        print(
            f"{r.tokens:>7} {','.join(map(str, r.lengths)):<20} {r.eager_ms:>9.3f} "
            f"{r.piecewise_ms:>13.3f} {r.speedup:>7.2f}x {r.max_abs_logit_diff:>12.4f} "
            f"{'same' if r.same_argmax else 'DIFF':>7}"
        )
    print(
        f"capture: {len(cap.buckets)} graphs ({len(piecewise.runners)} regions x "
        f"{len(piecewise.runners[0].shapes)} shapes) in {cap.seconds:.2f} s "
        f"({capture_wall_s:.2f} s wall), pool {cap.pool_bytes / 2**20:.1f} MiB"
    )
    time_packed = lambda fn: _time_ms(fn, device, iters)  # noqa: E731
    from ..model.prefill.graph_prefill import GraphPrefill

    graph = GraphPrefill(mr) if cuda else GraphPrefill(mr, (16, 64), max_chunks=4)
    packed, hf_error = run_packed(mr, points, time_packed, piecewise, with_hf=cuda, graph=graph)
    graph.shutdown()
    print(f"\npacked prefill, one forward of every prompt ({model}):")
    print(format_packed(packed, hf_error, floor=cuda))
    if cuda:  # the CPU stand-in re-runs every region eagerly: no GPU floor or target applies
        for name, ok in targets.items():
            print(f"target {name}: {'met' if ok else 'MISSED'}")
    if args.json:
        meta = {
            "model": model,
            "dtype": dtype_name,
            "device": torch.cuda.get_device_name() if cuda else "cpu",
            "torch": torch.__version__,
            "token_buckets": list(config.token_buckets),
            "batch_sizes": list(config.batch_sizes),
            "targets_are_for": "cuda",  # on the CPU: null (no GPU target applies there)
        }
        capture = {
            "graphs": len(cap.buckets),
            "regions": len(piecewise.runners),
            "seconds": cap.seconds,
            "wall_seconds": capture_wall_s,
            "pool_mib": cap.pool_bytes / 2**20,
            # the regions share one pool: the last runner's count after capture covers them all
            "pool_held_mib": _mib(piecewise.runners[-1].stats.pool_held_bytes),
            "outside_mib": cap.outside_bytes / 2**20,  # warm-up leftovers: shared outputs
            "ledger": cap.ledger(),  # seconds and MiB per graph, regions in order
        }
        with open(args.json, "w") as f:
            rows_json = [asdict(r) for r in rows]
            out = {"meta": meta, "rows": rows_json, "capture": capture}
            out["targets"] = targets if cuda else None
            out["packed"] = packed_json(packed)
            out["packed_hf_error"] = hf_error
            json.dump(out, f, indent=1)
    piecewise.shutdown()
    return 0


def _mib(nbytes: int | None) -> float | None:
    return None if nbytes is None else nbytes / 2**20


__all__ = ["PREFILL_TOKENS", "PrefillRow", "prompt_lengths", "run_prefill"]
