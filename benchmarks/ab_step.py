"""A/B of the fused decode step's tunings in one process, interleaved: one model's weights, and
for each round, variant and batch size a graph captured at that bucket alone, its median ms per
step (CUDA events after warm-up, as ``stepgraph bench`` times it), the fraction of the
bandwidth floor and the kernels a step. A variant is a ``DecodeTuning`` (``stepgraph.tuning``):
the defaults with fields replaced by ``with_overrides``, and each runs on a ``ModelRunner`` of
its own built with it over the same weights.

    PYTHONPATH=. python3 benchmarks/ab_step.py --batch-sizes 8,32 --context 512 --rounds 2 \\
        --variant base: --variant "plain:argmax.fold=0;pdl.enabled=0"

The last column compares each variant's logits with the first variant's on the same batch
(bit for bit where the variant changes no arithmetic: PDL, schedules).

Each bs is captured as a bucket of its own, so the kernel choices keyed by a default bucket
(the tables', ``reference_rows``) apply to it only where it is one (1, 2, 4, 8, 16, 32, 48,
64): bs 3 here is bucket 3, where serving replays it in bucket 4.

``--engine`` times the overlapped ``Engine`` (mode exact) instead: per round and variant one
engine over the variant's runner, and per bs the median host ms of its decode-only steps
(``stepgraph bench --modes engine``'s measure: requests whose prompts end 32 tokens short of
``--context``), for a tuning that acts outside the graph (``token_mirror``). Its last two columns
are then empty.

Rounds interleave the variants, so a drift of the GPU over the run shows as a spread between
rounds rather than as a difference between variants (bs 8 varies about 2% between calls).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from stepgraph.bench.modes import kernels_per_step, time_step
from stepgraph.bench.timing import copy_bandwidth_gbps
from stepgraph.bench.workload import (
    Point,
    build_model_runner,
    decode_batch,
    kv_bytes,
    weight_bytes,
)
from stepgraph.model import ModelRunner
from stepgraph.runner import CudaGraphRunner, RunnerConfig
from stepgraph.tuning import DecodeTuning
from stepgraph.tuning_text import with_overrides


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    """``name:field=V;group.field=V2`` -> (name, overrides); ``name:`` is the defaults."""
    name, _, body = text.partition(":")
    overrides = {}
    for item in filter(None, body.split(";")):
        key, _, value = item.partition("=")
        overrides[key.strip()] = value.strip()
    return name, overrides


def variant_tuning(overrides: dict[str, str], base: DecodeTuning | None = None) -> DecodeTuning:
    """The variant's ``DecodeTuning``: ``base`` (the defaults with the user's switches) with
    ``overrides`` applied (``stepgraph.tuning.with_overrides``; a bad one refused by name)."""
    return with_overrides(base if base is not None else DecodeTuning.default(), overrides)


def variant_runner(mr: ModelRunner, tuning: DecodeTuning, max_bs: int) -> ModelRunner:
    """A ``ModelRunner`` over ``mr``'s model (the same weights) with ``tuning``."""
    return ModelRunner.from_model(
        mr.model,
        device=mr.device,
        dtype=mr.dtype,
        max_bs=max_bs,
        max_context_len=mr.max_context_len,
        page_size=mr.page_size,
        tuning=tuning,
    )


def engine_ms(mr: ModelRunner, sizes: list[int], context: int) -> dict[int, float]:
    """Per bs, the median host ms of an exact-mode ``Engine``'s decode-only steps over ``mr``
    (``stepgraph.bench.e2e``), after one untimed pass of the same prompts."""
    from stepgraph.bench.e2e import E2E_NEW_TOKENS, decode_step_ms
    from stepgraph.engine import Engine

    config = RunnerConfig(capture_bs=sizes, show_progress=False)
    mode = "exact" if mr.device.type == "cuda" else "graph"  # the CPU stand-in edits no node
    engine = Engine(mr, mode, config, max_running=max(sizes))
    g = torch.Generator().manual_seed(0)
    out = {}
    try:
        for bs in sizes:
            shape = (bs, context - E2E_NEW_TOKENS)
            prompts = torch.randint(1, mr.config.vocab_size, shape, generator=g).tolist()
            decode_step_ms(engine, prompts, E2E_NEW_TOKENS)  # untimed: compiles, caches
            out[bs] = decode_step_ms(engine, prompts, E2E_NEW_TOKENS)
    finally:
        engine.shutdown()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-3.2-1b")
    ap.add_argument("--batch-sizes", default="8,32")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--variant", action="append", required=True, help="name:field=V;group.field=V2")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--engine", action="store_true", help="time the Engine end to end")
    ap.add_argument("--json")
    args = ap.parse_args()
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    variants = [(name, variant_tuning(o)) for name, o in map(parse_variant, args.variant)]
    mr = build_model_runner(args.model, "cuda", torch.bfloat16, max(sizes), args.context + 64)
    runners = {name: variant_runner(mr, t, max(sizes)) for name, t in variants}
    gbps = copy_bandwidth_gbps()
    wbytes = weight_bytes(mr)
    ms: dict[tuple[str, int], list[float]] = {}
    kernels: dict[tuple[str, int], float] = {}
    logits_of: dict[int, torch.Tensor] = {}  # the first variant's logits at each bs
    diff: dict[tuple[str, int], float] = {}  # each variant's max |logits - the first's|
    for _ in range(args.rounds):
        for name, _ in variants:
            vr = runners[name]
            if args.engine:
                for bs, t in engine_ms(vr, sizes, args.context).items():
                    ms.setdefault((name, bs), []).append(t)
                    kernels[(name, bs)], diff[(name, bs)] = float("nan"), float("nan")
                continue
            for bs in sizes:
                point = Point(bs, args.context)
                cfg = RunnerConfig(capture_bs=(bs,), max_bs=bs, show_progress=False)
                runner = CudaGraphRunner(vr, cfg)
                batch, pages = decode_batch(vr, point)
                try:
                    step = lambda b=batch, r=runner: r.replay(b)  # noqa: E731 - the timed call
                    ms.setdefault((name, bs), []).append(time_step(step, args.iters))
                    if (name, bs) not in kernels:
                        kernels[(name, bs)] = kernels_per_step(step)
                        logits = step().float().clone()  # same batch: same K/V, same bits
                        first = logits_of.setdefault(bs, logits)
                        diff[(name, bs)] = (logits - first).abs().max().item()
                finally:
                    runner.shutdown()
                    for p in pages:
                        vr.kv_cache.release(p)
    what = "Engine end to end" if args.engine else "graph"
    print(f"{args.model}, ctx {args.context}, {what}, copy bandwidth {gbps:.0f} GB/s")
    print(
        f"{'variant':<16}{'bs':>4}{'ms (each round)':>28}{'median':>9}{'floor':>7}{'kern':>6}"
        f"{'logits vs first':>17}"
    )
    rows = []
    for name, _ in variants:
        for bs in sizes:
            t = ms[(name, bs)]
            floor = (wbytes + kv_bytes(mr, Point(bs, args.context))) / (gbps * 1e9) * 1e3
            med = statistics.median(t)
            each = " ".join(f"{x:.3f}" for x in t)
            d = diff[(name, bs)]
            same = "-" if d != d else "same bits" if d == 0 else f"max diff {d:.2e}"
            print(
                f"{name:<16}{bs:>4}{each:>28}{med:>9.3f}{floor / med:>7.0%}"
                f"{kernels[(name, bs)]:>6.0f}{same:>17}"
            )
            rows.append(
                dict(
                    variant=name,
                    bs=bs,
                    ms=t,
                    median=med,
                    of_floor=floor / med,
                    kernels=kernels[(name, bs)],
                    logits_max_diff=d,
                )
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(model=args.model, context=args.context, gbps=gbps, rows=rows), f)


if __name__ == "__main__":
    main()
