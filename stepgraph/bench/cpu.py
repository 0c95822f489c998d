"""`stepgraph bench --device cpu`: the whole pipeline on the CPU stand-in, timed honestly.

What it can and cannot show: on a CPU, "graph" is the ``CpuGraphBackend`` stand-in, which
re-runs the same forward on the static buffers (there are no kernel launches to save), so graph
costs what eager costs plus the copy into the static buffers. It checks that the runner works
and gives eager's tokens; the speed-up of graphs needs CUDA graphs on a GPU.

Threads: the tiny model's ops are a few microseconds each; with several OpenMP threads on a
small machine the threads spin against each other. Measured on 2 shared cores: 81-104 ms per
step with torch's default threads, 1.0-1.4 ms with one. So the bench sets one thread unless
``--threads`` or ``OMP_NUM_THREADS`` says otherwise, and prints the choice.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from ..errors import ConfigError
from .constants import CPU_MODES
from .report import Row, plot, write_json
from .workload import Point, build_model_runner, decode_batch, fill_kv_random

EXPLAIN = (
    "eager = ModelRunner.forward each step; graph = CudaGraphRunner on the CPU stand-in, which "
    "re-runs that same forward on static buffers: a CPU has no kernel launches for a graph to "
    "save, so expect graph = eager + the input copy here, and the speed-up only on a GPU"
)


def set_cpu_threads(threads: int | None) -> str:
    """Set torch's intra-op threads for a CPU run; return the one line that says so."""
    cores = os.cpu_count() or 1
    if threads is not None:
        why = "--threads"
    elif os.environ.get("OMP_NUM_THREADS"):
        threads, why = torch.get_num_threads(), "OMP_NUM_THREADS"
    else:
        threads = 1
        why = "default: a tiny model's ops are too small to split, extra threads only contend"
    torch.set_num_threads(threads)
    return f"torch threads: {threads} of {cores} cores ({why}; change with --threads N)"


def cpu_modes(modes: str | None) -> list[str]:
    """``--modes`` on the CPU: eager and graph only; anything else is refused by name."""
    if modes is None:
        return list(CPU_MODES)
    chosen = [m for m in modes.split(",") if m]
    other = [m for m in chosen if m not in CPU_MODES]
    if other or not chosen:
        raise ConfigError(
            f"--modes {modes}: {other or 'nothing'} cannot run with --device cpu (exact edits "
            "CUDA graph nodes, compile and the HF peers are timed with CUDA events); choose from "
            f"{','.join(CPU_MODES)} on the CPU, or run on a GPU."
        )
    return chosen


def host_ms(step, iters: int) -> float:
    """Median wall-clock ms of ``step()`` over ``iters`` calls, after two warm-up calls."""
    for _ in range(2):
        step()
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        step()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def run_cpu(args: argparse.Namespace, sizes: list[int], contexts: list[int]) -> int:
    from ..engine import Engine
    from ..runner import CudaGraphRunner, RunnerConfig

    modes = cpu_modes(args.modes)
    model = args.model or "tiny"
    print(f"stepgraph bench --device cpu: {model}, float32, {args.iters} timed steps per point")
    print(set_cpu_threads(args.threads))
    print(EXPLAIN)
    mr = build_model_runner(model, "cpu", torch.float32, max(sizes), max(contexts) + 64)
    fill_kv_random(mr)  # random K/V: attention reads real-looking data, never zeros
    points = [Point(bs, ctx) for bs in sizes for ctx in contexts]
    rows: list[Row] = []
    for mode in modes:
        runner = None
        if mode == "graph":
            # one bucket per requested batch size: the stand-in gains nothing from the default
            # ladder, and --batch-sizes 100000 would otherwise capture ~6,000 buckets
            buckets = tuple(sorted(set(sizes)))
            runner = CudaGraphRunner(mr, RunnerConfig(capture_bs=buckets, show_progress=False))
        for p in points:
            batch, pages = decode_batch(mr, p)
            fwd = mr.forward if runner is None else runner.replay
            ms = host_ms(lambda b=batch, f=fwd: f(b).argmax(-1), args.iters)
            for req_pages in pages:
                mr.kv_cache.release(req_pages)
            cap = runner.stats.capture if runner is not None else None
            rows.append(
                Row(
                    mode, p.bs, p.context, ms, p.bs / ms * 1e3, None,
                    cap.seconds if cap else None, cap.pool_bytes / 2**20 if cap else None,
                    "CPU stand-in" if runner is not None else "",
                )
            )  # fmt: skip
        if runner is not None:
            runner.shutdown()
    eager = {(r.bs, r.context): r.ms_per_token for r in rows if r.mode == "eager"}
    print(f"{'mode':<7}{'bs':>4}{'ctx':>7}{'ms/step':>10}{'tok/s':>9}{'vs eager':>10}")
    for r in rows:
        base = eager.get((r.bs, r.context))
        ratio = f"{base / r.ms_per_token:9.2f}x" if base else f"{'-':>10}"
        print(
            f"{r.mode:<7}{r.bs:>4}{r.context:>7}{r.ms_per_token:>10.3f}"
            f"{r.tokens_per_s:>9.0f}{ratio}"
        )
    same = True
    if set(CPU_MODES) <= set(modes):  # the tokens check: the same prompts through the engine
        outputs = {}
        for mode in CPU_MODES:
            engine = Engine(mr, mode=mode)
            vocab, ctx = mr.config.vocab_size, max(contexts)
            prompts = [[(7 * i + j) % (vocab - 1) + 1 for j in range(ctx - i)] for i in sizes]
            outputs[mode] = engine.generate(prompts, max_new_tokens=8, ignore_eos=True)
            engine.shutdown()
        same = outputs["eager"] == outputs["graph"]
        print(f"graph tokens identical to eager: {same}")
    meta = {"model": model, "dtype": "float32", "device": "cpu", "torch": torch.__version__}
    meta.update(threads=torch.get_num_threads(), iters=args.iters, tokens_match=same)
    if args.json:
        write_json(args.json, rows, meta)
        print(f"wrote {args.json}")
    if args.plot:
        plot(args.plot, rows)
        print(f"wrote {args.plot}")
    return 0 if same else 1


__all__ = ["EXPLAIN", "cpu_modes", "host_ms", "run_cpu", "set_cpu_threads"]
