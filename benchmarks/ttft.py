"""Time to first token of one request, with the engine's defaults, and the prefill behind it.

    python benchmarks/ttft.py --json out/ttft.json                 # llama-3.2-1b, bf16, CUDA
    python benchmarks/ttft.py --device cpu --model tiny --prompt-len 100 --requests 5

The engine is built as ``stepgraph serve`` builds it: ``Engine(mr)`` with its defaults (mode
"exact" on CUDA, the padded prefill from graphs), then ``warm_up``. Then, one request at a time,
a random prompt of ``--prompt-len`` tokens (a new one each time: the prefix cache never hits):

- ``first_new_length``: TTFT of the first request of a prompt length the engine has not served
  since start-up (``--new-len``), and ``second_new_length``: of the second of that length;
- ``ttft_ms``: the median of ``--requests`` requests of ``--prompt-len`` tokens.

``--host``: the host's share alone, on a stand-in of (near) zero device time (the tiny preset,
one layer; a decode forward and a padded prefill forward that write nothing, as
``benchmarks/engine_host.py``): µs from ``add_request`` to the first token by phase, for the
step that prefills and the step that lands the token (``engine/phase_timer.py``).

TTFT is measured on the host from ``add_request`` to the step that returns the request's first
token (the overlapped loop: the step after its prefill lands it). Each request then runs to
``--new-tokens`` and is drained before the next. Also timed: the prefill of one
``--prompt-len`` prompt alone through the engine's prefiller (``prefill_ms``, synchronized),
the same through the unpadded ``ModelRunner.extend`` (``unpadded_prefill_ms``), and the graph
of the prompt's token bucket padded to several chunk counts (``prefill_ms_by_max_chunks``: the
extend grid and the logit rows grow with it; the engine's lone chunk runs at 1).
Targets (the issue, H200, llama-3.2-1b, bf16): TTFT <= 5 ms for 512
tokens, the first of a new length within 1.1x of the second, the 1 x 512 prefill <= 2.5 ms.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from stepgraph.bench.constants import DTYPES
from stepgraph.engine import Engine
from stepgraph.engine.warm import warm_up
from stepgraph.model.launch import build_model_runner
from stepgraph.model.prefill.extend_batch import PrefillChunk
from stepgraph.model.prefill.graph_prefill import GraphPrefill

HERE = Path(__file__).resolve().parent


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def say(line: str) -> None:
    print(f"ttft: {line}", file=sys.stderr, flush=True)


def ttft(engine: Engine, prompt: list[int], new_tokens: int) -> float:
    """Seconds from ``add_request`` to the step that returns the first token; the request then
    runs to the end and every page goes back."""
    t0 = time.perf_counter()
    rid = engine.add_request(prompt, new_tokens, ignore_eos=True)
    took = None
    while took is None:
        if any(r == rid for r, _ in engine.step()):
            took = time.perf_counter() - t0
    while engine.has_unfinished:
        engine.step()
    engine.drain()
    engine.finished.clear()
    return took


def time_prefill(fn, device: torch.device, iters: int) -> float:
    """Median ms of ``fn()`` over ``iters`` synchronized calls (after two untimed)."""
    out = []
    for i in range(iters + 2):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        if i >= 2:
            out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def prefill_times(engine: Engine, prompt: list[int], iters: int, chunk_counts: list[int]) -> dict:
    """The prompt's prefill alone: the engine's prefiller, unpadded, and its bucket's graph at
    each of ``chunk_counts`` chunks a bucket."""
    mr = engine.model_runner
    pages = mr.kv_cache.reserve(len(prompt))
    chunk = [PrefillChunk(prompt, 0, pages)]
    res = {
        "prefiller": type(engine.prefiller).__name__,
        "prefill_ms": time_prefill(lambda: engine.prefiller.extend(chunk), mr.device, iters),
        "unpadded_prefill_ms": time_prefill(lambda: mr.extend(chunk), mr.device, iters),
        "prefill_ms_by_max_chunks": {},
    }
    prefiller = engine.prefiller
    if isinstance(prefiller, GraphPrefill):
        res["token_buckets"] = prefiller.token_buckets
        res["max_chunks"] = prefiller.max_chunks
        res["chunk_buckets"] = prefiller.chunk_buckets
        res["capture_s"] = round(prefiller.stats.capture.seconds, 3)
        res["pool_mib"] = round(prefiller.stats.capture.pool_bytes / 2**20, 1)
        bucket = min(t for t in prefiller.token_buckets if t >= len(prompt))
        for b in chunk_counts:
            gp = GraphPrefill(mr, [bucket], max_chunks=b, chunk_buckets=[b])
            res["prefill_ms_by_max_chunks"][b] = time_prefill(
                lambda gp=gp: gp.extend(chunk), mr.device, iters
            )
            gp.shutdown()
    mr.kv_cache.release(pages)
    return res


def host_path(device: str, prompt_len: int, requests: int) -> dict:
    """Host µs of one request's path to its first token on a stand-in of no device work."""
    from stepgraph.engine.phase_timer import PHASES, PhaseTimer
    from stepgraph.runner import RunnerConfig

    spec = importlib.util.spec_from_file_location("engine_host", HERE / "engine_host.py")
    engine_host = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(engine_host)
    mr = engine_host.stand_in_runner(device, 8, prompt_len + 64)
    GraphPrefill._forward = lambda self, t: self._out  # the padded forward: no kernel at all
    mode = "graph"
    config = RunnerConfig(max_bs=8, show_progress=False, pinned_staging=True)
    engine = Engine(mr, mode, config)
    rng = random.Random(0)
    add, steps, firsts = [], [PhaseTimer(), PhaseTimer()], []
    for i in range(requests + 3):
        prompt = [rng.randrange(1, mr.config.vocab_size) for _ in range(prompt_len)]
        t0 = time.perf_counter_ns()
        rid = engine.add_request(prompt, 4, ignore_eos=True)
        t1 = time.perf_counter_ns()
        landed, k = False, 0
        while not landed:
            engine.timer = steps[min(k, 1)] if i >= 3 else None
            landed = any(r == rid for r, _ in engine.step())
            k += 1
        t2 = time.perf_counter_ns()
        engine.timer = None
        if i >= 3:
            add.append((t1 - t0) / 1e3)
            firsts.append((t2 - t0) / 1e3)
        while engine.has_unfinished:
            engine.step()
        engine.drain()
        engine.finished.clear()
    engine.shutdown()
    out = {"device": str(mr.device), "mode": mode, "prompt_len": prompt_len}
    out["add_request_us"] = round(statistics.median(add), 2)
    for name, timer in zip(("prefill_step", "landing_step"), steps):
        us = timer.per_step_us()
        out[name] = {p: round(us[p], 2) for p in (*PHASES, "total")}
    out["to_first_token_us"] = round(statistics.median(firsts), 2)
    return out


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    t0 = time.perf_counter()
    mr = build_model_runner(
        args.model,
        device,
        DTYPES[args.dtype],
        seed=0,
        max_bs=args.max_bs,
        max_context_len=args.context,
    )
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    weights_s = time.perf_counter() - t0
    say(f"weights in {weights_s:.1f} s")
    t0 = time.perf_counter()
    engine = Engine(mr)  # the defaults: mode, prefill, budgets, prefix caching
    build_s = time.perf_counter() - t0
    say(f"engine ({engine.mode}, {engine.prefill} prefill) built in {build_s:.1f} s")
    t0 = time.perf_counter()
    warm_up(engine)
    warm_s = time.perf_counter() - t0
    say(f"warm-up in {warm_s:.1f} s")
    rng = random.Random(args.seed)
    vocab = mr.config.vocab_size
    prompt = lambda n: [rng.randrange(1, vocab) for _ in range(n)]  # noqa: E731
    first = ttft(engine, prompt(args.new_len), args.new_tokens)
    second = ttft(engine, prompt(args.new_len), args.new_tokens)
    say(f"new length {args.new_len}: first {first * 1e3:.2f} ms, second {second * 1e3:.2f} ms")
    times = [ttft(engine, prompt(args.prompt_len), args.new_tokens) for _ in range(args.requests)]
    say(f"TTFT of {args.prompt_len} tokens: median {statistics.median(times) * 1e3:.2f} ms")
    chunk_counts = [int(c) for c in args.chunk_counts.split(",") if c]
    result = {
        "model": args.model,
        "dtype": args.dtype,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "mode": engine.mode,
        "prefill": engine.prefill,
        "prompt_len": args.prompt_len,
        "requests": args.requests,
        "weights_s": round(weights_s, 2),
        "engine_build_s": round(build_s, 2),
        "decode_capture_s": round(engine.runner.stats.capture.seconds, 3) if engine.runner else 0,
        "warm_up_s": round(warm_s, 2),
        "ttft_ms": statistics.median(times) * 1e3,
        "ttft_ms_min": min(times) * 1e3,
        "ttft_ms_all": [round(t * 1e3, 3) for t in times],
        "new_len": args.new_len,
        "first_new_length_ms": first * 1e3,
        "second_new_length_ms": second * 1e3,
        "first_over_second": first / second,
    }
    result |= prefill_times(engine, prompt(args.prompt_len), args.iters, chunk_counts)
    engine.shutdown()
    return result


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cuda = torch.cuda.is_available()
    ap.add_argument("--device", default="cuda" if cuda else "cpu")
    ap.add_argument("--model", default="llama-3.2-1b")
    ap.add_argument("--dtype", default="bfloat16" if cuda else "float32", choices=sorted(DTYPES))
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-len", type=int, default=300, help="a prompt length not yet served")
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--iters", type=int, default=20, help="timed prefills of each kind")
    ap.add_argument("--max-bs", type=int, default=64)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--chunk-counts", default="1,8,16,32,64", help="max_chunks to time (or '')")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the result here")
    ap.add_argument("--host", action="store_true", help="the host's share on a stand-in")
    args = ap.parse_args(argv)
    if args.host:
        result = host_path(args.device, args.prompt_len, args.requests)
        print(json.dumps(result, indent=1))
        return result
    result = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))
    print(
        f"\nTTFT, one {args.prompt_len}-token request ({result['mode']}, {result['prefill']} "
        f"prefill): median {result['ttft_ms']:.2f} ms over {args.requests}; first request of "
        f"a new length {result['first_new_length_ms']:.2f} ms, the second "
        f"{result['second_new_length_ms']:.2f} ms ({result['first_over_second']:.2f}x); "
        f"1 x {args.prompt_len} prefill {result['prefill_ms']:.3f} ms "
        f"(unpadded {result['unpadded_prefill_ms']:.3f} ms)"
    )
    return result


if __name__ == "__main__":
    main()
