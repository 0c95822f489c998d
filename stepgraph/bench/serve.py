"""`stepgraph bench --serve`: requests through the ``Engine`` as a server sees them, measured as
`vllm bench serve` measures them (``serve_metrics.py``), beside the GPU-only step time of the
same batches and the transformers peers on the same requests and weights (``serve_peers.py``).

The loop queues each request when its arrival time has passed, then runs one ``engine.step()``
and stamps every token it returned with ``time.perf_counter()`` taken right after the step
(the tokens are on the host by then). With nothing to run and the next arrival in the future it
sleeps until then. A request's arrival is its scheduled time, so a request that arrives during
a step waits for that step, as it would on a server.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import sys
import time
from dataclasses import dataclass, field

import torch

from ..errors import StepGraphError
from .serve_args import LATENCY_INPUT, LATENCY_OUTPUT, check_serve_args, check_serve_memory
from .serve_metrics import RequestTiming, StepRecord

# Before the clock starts every prompt runs once through the engine with this many new tokens:
# Triton compiles the prefill kernels per chunk shape on first use. Measured on the H200
# (llama-3.2-1b, 64 requests, 8192-token chunks): with a 2-prompt warm-up the 2nd and 3rd
# prefill steps (chunks continuing a cached prefix) took ~800 ms each, the 4th and 5th 35 ms.
WARMUP_TOKENS = 2
EMPTY_STEPS_LIMIT = 10_000  # consecutive steps without a token before the loop gives up


@dataclass
class ServeRun:
    """What one pass of the loop measured."""

    timings: list[RequestTiming]
    outputs: list[list[int]]
    steps: list[StepRecord]
    start: float  # perf_counter seconds at which the arrival schedule starts
    duration_s: float  # start -> last token
    engine_stats: dict = field(default_factory=dict)


def make_engine(
    mr,
    mode: str,
    max_running: int,
    max_prefill_tokens: int,
    prefill=None,
    prefix_caching=True,
    with_decode: int = 2048,
):
    """The engine, with ``max_prefill_tokens`` and ``with_decode`` (its
    ``max_prefill_tokens_with_decode``, 0: no cap) where its constructor takes them."""
    from ..engine import Engine

    kw: dict = {"max_running": max_running, "prefill": prefill, "prefix_caching": prefix_caching}
    params = inspect.signature(Engine).parameters
    if "max_prefill_tokens" in params:
        kw["max_prefill_tokens"] = max_prefill_tokens
    if "max_prefill_tokens_with_decode" in params:
        kw["max_prefill_tokens_with_decode"] = with_decode or None
    return Engine(mr, mode=mode, **kw)


def _jsonable(x):
    if isinstance(x, dict):  # Counters keyed by batch size, or by (bs, tokens) tuples
        return {k if isinstance(k, (str, int)) else str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x if isinstance(x, (str, int, float, bool, type(None))) else str(x)


def _stats(engine) -> dict:
    """``engine.stats`` as plain data (its fields change as the engine grows; take them all)."""
    stats = getattr(engine, "stats", None)
    return _jsonable(dataclasses.asdict(stats)) if dataclasses.is_dataclass(stats) else {}


def serve(
    engine, prompts: list[list[int]], output_len: int, arrivals: list[float], max_running: int
) -> ServeRun:
    """Run ``prompts`` (arrival times non-decreasing, seconds after the start) to completion."""
    n = len(prompts)
    timings = [RequestTiming(0.0, len(p)) for p in prompts]
    outputs: list[list[int]] = [[] for _ in prompts]
    index: dict[int, int] = {}  # engine request id -> request
    steps: list[StepRecord] = []
    added = started = done = empty = 0
    prev_end = None  # end of the last step, unless the loop was idle since
    t0 = time.perf_counter()
    while added < n or engine.has_unfinished:
        now = time.perf_counter()
        while added < n and t0 + arrivals[added] <= now:
            index[engine.add_request(prompts[added], output_len, ignore_eos=True)] = added
            timings[added].arrival = t0 + arrivals[added]
            added += 1
        if not engine.has_unfinished:  # idle: sleep until the next arrival, no spinning
            time.sleep(max(0.0, t0 + arrivals[added] - time.perf_counter()))
            prev_end = None
            continue
        decoding, pending = started - done, added - started
        call = time.perf_counter()
        pairs = engine.step()
        end = time.perf_counter()
        first = 0
        for rid, token in pairs:
            i = index[rid]
            if not outputs[i]:
                first += 1
            outputs[i].append(token)
            timings[i].token_times.append(end)
            if len(outputs[i]) == output_len:
                done += 1
                engine.finished.pop(rid, None)  # kept here; the engine's dict stays small
        started += first
        only = pending == 0 or decoding >= max_running  # nothing could be prefilling
        steps.append(StepRecord(end, end - (prev_end or call), first, len(pairs) - first, only))
        prev_end = end
        empty = 0 if pairs else empty + 1
        if empty > EMPTY_STEPS_LIMIT:
            raise StepGraphError(
                f"{EMPTY_STEPS_LIMIT} engine steps in a row returned no token with "
                f"{added - done} requests unfinished; the engine is stuck."
            )
    wrong = [(i, len(o)) for i, o in enumerate(outputs) if len(o) != output_len]
    if wrong:
        raise StepGraphError(
            f"requests {wrong[:4]} (index, tokens) did not produce exactly {output_len} tokens "
            "with eos ignored; the engine stopped them early."
        )
    duration = max(t.token_times[-1] for t in timings) - t0
    return ServeRun(timings, outputs, steps, t0, duration, _stats(engine))


def step_times(engine, mr, sizes: list[int], context: int, iters: int) -> list[dict]:
    """The decode step alone at each batch size, ``context`` tokens per request: graph replays
    back to back (CUDA-event median, as `stepgraph bench`), host-timed on the CPU stand-in."""
    from .cpu import host_ms
    from .modes import time_step
    from .workload import Point, decode_batch

    runner = getattr(engine, "runner", None)
    rows = []
    for bs in sizes:
        batch, pages = decode_batch(mr, Point(bs, context))
        try:
            graph = runner is not None and runner.can_run(batch)
            run = runner.replay if graph else mr.forward
            fused = mr.fused_tokens(bs) is not None  # greedy tokens come out of the step
            step = (
                (lambda b=batch, f=run: f(b)) if fused else (lambda b=batch, f=run: f(b).argmax(-1))
            )
            ms = time_step(step, iters) if mr.device.type == "cuda" else host_ms(step, iters)
        finally:
            for req_pages in pages:
                mr.kv_cache.release(req_pages)
        how = "graph replay" if graph else "eager forward"
        rows.append({"bs": bs, "context": context, "step_ms": ms, "how": how})
    return rows


@dataclass
class EngineRuns:
    """One engine's pass over the workload and the latency case, with their GPU step times."""

    main: ServeRun
    gpu_main: list[dict]
    latency: ServeRun | None
    gpu_latency: list[dict]
    warmup_s: float
    hits: float  # the timed run's prefix-cache hit rate


def engine_runs(args, plan, mr, prompts, arrivals, lat_prompt, out_len) -> EngineRuns:
    """An engine over ``mr`` as the flags ask: an untimed warm-up, the workload, its decode
    steps alone, then the latency case where planned; the engine is shut down after."""
    from .serve_metrics import used_batch_sizes

    caching = not args.no_prefix_caching
    budgets = args.max_prefill_tokens, plan.prefill, caching, args.max_prefill_tokens_with_decode
    t = time.perf_counter()
    _say("capturing the engine's graphs (a first run also compiles its kernels)")
    engine = make_engine(mr, plan.mode, plan.max_running, *budgets)
    _say(f"engine ready in {time.perf_counter() - t:.1f} s; warming up on every prompt once")
    latency, gpu_latency = None, []
    try:
        t = time.perf_counter()
        engine.generate(prompts, WARMUP_TOKENS, ignore_eos=True)  # untimed: compiles
        if plan.latency:
            engine.generate(lat_prompt, WARMUP_TOKENS, ignore_eos=True)
        warmup_s = time.perf_counter() - t
        engine.prefix_cache.clear()  # the warm-up's prompts are the timed ones: start cold
        engine.stats = type(engine.stats)()  # count the timed run only
        _say(f"serving {len(prompts)} requests")
        main = serve(engine, prompts, out_len, arrivals, plan.max_running)
        context = round(sum(map(len, prompts)) / len(prompts) + out_len / 2)
        hits = engine.stats.hit_rate
        engine.prefix_cache.clear()  # step_times reserves pages of its own
        gpu_main = step_times(engine, mr, used_batch_sizes(main.steps), context, args.iters)
        if plan.latency:
            engine.prefix_cache.clear()
            engine.stats = type(engine.stats)()
            latency = serve(engine, lat_prompt, LATENCY_OUTPUT, [0.0], plan.max_running)
            context = LATENCY_INPUT + LATENCY_OUTPUT // 2
            gpu_latency = step_times(engine, mr, [1], context, args.iters)
    finally:
        engine.shutdown()
    return EngineRuns(main, gpu_main, latency, gpu_latency, warmup_s, hits)


def quantized_line(report: dict, quantized: dict, quant: str) -> str:
    """One line: the quantized run's throughput and TTFT against the model dtype's."""
    m, q = report["metrics"], quantized["metrics"]
    ratio = q["output_throughput"] / m["output_throughput"] if m["output_throughput"] else 0.0
    return (
        f"{quant.upper()} weights: {q['output_throughput']:.0f} output tok/s, TTFT p50 "
        f"{q['median_ttft_ms']:.1f} ms; {report['meta']['dtype']}: "
        f"{m['output_throughput']:.0f} tok/s, {m['median_ttft_ms']:.1f} ms "
        f"({ratio:.2f}x the throughput)"
    )


def _say(text: str) -> None:
    print(f"stepgraph bench --serve: {text}", file=sys.stderr, flush=True)


def run_serve(args: argparse.Namespace) -> int:
    from ..cli_args import model_config
    from .constants import DTYPES
    from .serve_metrics import arrival_times, random_prompts
    from .serve_report import (
        build_report,
        plot_requests,
        print_report,
        request_records,
        write_report,
    )
    from .workload import build_model_runner

    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print(
            "stepgraph bench --serve: no CUDA GPU is visible; run it on a GPU machine, or "
            "smoke-test it with `stepgraph bench --serve --device cpu`.",
            file=sys.stderr,
        )
        return 2
    model = args.model or ("llama-3.2-1b" if cuda else "tiny")
    config = model_config(model)
    plan = check_serve_args(args, config, model)
    if not cuda:
        from .cpu import set_cpu_threads

        print(set_cpu_threads(args.threads, config))
    if args.workload != "random":
        from .serve_prefix import run_prefix_bench

        return run_prefix_bench(args, plan, config, model, make_engine, serve)
    vocab, out_len = config.vocab_size, args.output_len
    prompts = random_prompts(args.num_requests, args.input_len, args.range_ratio, vocab, args.seed)
    arrivals = arrival_times(args.num_requests, args.request_rate, args.seed)
    lat_prompt = random_prompts(1, LATENCY_INPUT, 0.0, vocab, args.seed + 1)
    max_context = max(map(len, prompts)) + out_len
    if plan.latency:
        max_context = max(max_context, LATENCY_INPUT + LATENCY_OUTPUT)
    _say(
        f"building {model} and the engine ({plan.mode}, {plan.prefill} prefill, max running "
        f"{plan.max_running})"
    )
    dtype = DTYPES[args.dtype or ("bfloat16" if cuda else "float32")]
    check_serve_memory(args, config, plan, dtype, max_context)
    quant = getattr(args, "quantization", None)
    work = (prompts, arrivals, lat_prompt, out_len)

    def build(quantization=None):
        mr = build_model_runner(
            model,
            args.device,
            dtype,
            plan.max_running,
            max_context,
            page_size=plan.page_size,
            quantization=quantization,
        )
        if cuda:
            mr.set_kernels(args.kernels or "fused")
        return mr

    def report_of(mr, run: EngineRuns, peers: dict, weights: str | None = None) -> dict:
        """The run's report (``weights``: a quantization, named in its meta), printed with its
        hit rate."""
        report = build_report(
            args, plan, mr, run.main, run.gpu_main, run.latency, run.gpu_latency, peers,
            run.warmup_s,
        )  # fmt: skip
        if weights:
            report["meta"]["weights"] = weights
        print_report(report)
        caching = "off" if args.no_prefix_caching else "on"
        print(f"prefix caching {caching}: hit rate {run.hits:.1%}")
        return report

    mr = build()
    run = engine_runs(args, plan, mr, *work)
    peers = {}
    if "hf-cb" in plan.peers:
        from .serve_peers import hf_continuous_batching

        _say(f"hf-cb: transformers generate_batch on the same {len(prompts)} requests")
        peers["hf-cb"] = hf_continuous_batching(mr, prompts, out_len)
    if "hf-static-compile" in plan.peers:
        from .serve_peers import hf_static_latency

        _say("hf-static-compile: the latency case (compiles first, about a minute)")
        peers["hf-static-compile"] = hf_static_latency(mr, lat_prompt[0], LATENCY_OUTPUT)
    report = report_of(mr, run, peers)
    if quant:  # the same weights in FP8 (the same seed, quantized on load), after the peers
        del mr
        if cuda:
            torch.cuda.empty_cache()
        _say(f"the same requests on the same weights in {quant.upper()}")
        mr8 = build(quant)
        run8 = engine_runs(args, plan, mr8, *work)
        report8 = report_of(mr8, run8, {}, quant)
        report["quantized"] = {**report8, "requests": request_records(run8.main)}
        print(quantized_line(report, report8, quant))
    if args.json:
        write_report(args.json, report, run.main)
        print(f"wrote {args.json}")
    if args.plot:
        plot_requests(args.plot, report, run.main, peers.get("hf-cb"))
        print(f"wrote {args.plot}")
    return 0


__all__ = [
    "EngineRuns",
    "ServeRun",
    "engine_runs",
    "make_engine",
    "quantized_line",
    "run_serve",
    "serve",
    "step_times",
]
