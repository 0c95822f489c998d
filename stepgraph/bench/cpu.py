"""`stepgraph bench --device cpu`: the whole pipeline on the CPU stand-in, timed honestly.

What it can and cannot show: on a CPU, "graph" is the ``CpuGraphBackend`` stand-in, which
re-runs the same forward on the static buffers (there are no kernel launches to save), so graph
costs what eager costs plus the copy into the static buffers. It checks that the runner works
and gives eager's tokens; the speed-up of graphs needs CUDA graphs on a GPU.

Threads: the tiny model's ops are a few microseconds each; with several OpenMP threads on a
small machine the threads spin against each other, up to 80x slower a step on 2 shared cores
(docs/experiments.md#one-cpu-thread-for-the-tiny-model). So the bench sets one thread unless
``--threads`` or ``OMP_NUM_THREADS`` says otherwise, and prints the choice.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from .constants import CPU_MODES, DTYPES
from .report import Row, plot, write_json
from .workload import Point, build_model_runner, decode_batch, fill_kv_random

EXPLAIN = (
    "eager = ModelRunner.forward each step; graph = CudaGraphRunner on the CPU stand-in, which "
    "re-runs that same forward on static buffers: a CPU has no kernel launches for a graph to "
    "save, so expect graph = eager + the input copy here, and the speed-up only on a GPU"
)


SMALL_HIDDEN = 256  # a model this narrow (the tiny presets: 64) has ops too small to split


def set_cpu_threads(threads: int | None, config=None) -> str:
    """Set torch's intra-op threads for a CPU run; return the one line that says so. The
    default is one thread; the reason given depends on the model (``config``, when known)."""
    cores = os.cpu_count() or 1
    if threads is not None:
        why = "--threads"
    elif os.environ.get("OMP_NUM_THREADS"):
        threads, why = torch.get_num_threads(), "OMP_NUM_THREADS"
    else:
        threads = 1
        if config is not None and config.hidden_size <= SMALL_HIDDEN:
            why = "default: a tiny model's ops are too small to split, extra threads only contend"
        else:
            why = "default: one thread; a model of this size may run faster on more cores"
    torch.set_num_threads(threads)
    return f"torch threads: {threads} of {cores} cores ({why}; change with --threads N)"


FUSED_NOTE = (
    "--kernels fused: the fused kernels are Triton GPU kernels; on the CPU every step runs the "
    "reference kernels (torch ops)"
)
SLOW_STEP_S = 1.0  # a step slower than this: say how long the point will take (stderr)


def cpu_modes(modes: str | None) -> list[str]:
    """``--modes`` on the CPU: eager and graph only (eager first: the table's "vs eager"
    column needs it); anything else is refused by name (``bench.args.bench_modes``)."""
    from .args import bench_modes

    chosen = bench_modes(modes, "cpu") or list(CPU_MODES)
    return sorted(dict.fromkeys(chosen), key=lambda m: m != "eager")


TOKEN_CHECK_NEW = 8  # new tokens per prompt of the tokens check


def token_check_prompts(sizes: list[int], context: int, config) -> list[list[int]]:
    """The prompts of the tokens check: one per batch size ``bs``, of ``context - bs`` tokens,
    at least one (``--contexts 1``, or a batch size >= the context) and at most what leaves
    room for ``TOKEN_CHECK_NEW`` tokens within ``max_position_embeddings``."""
    vocab, longest = config.vocab_size, config.max_position_embeddings - TOKEN_CHECK_NEW + 1
    lengths = [min(max(1, context - bs), longest) for bs in sizes]
    return [[(7 * i + j) % (vocab - 1) + 1 for j in range(n)] for i, n in zip(sizes, lengths)]


def host_ms(step, iters: int, on_slow=None) -> float:
    """Median wall-clock ms of ``step()`` over ``iters`` calls, after two warm-up calls.
    ``on_slow(seconds)`` is called when the first warm-up call took over ``SLOW_STEP_S``."""
    t0 = time.perf_counter()
    step()
    if on_slow is not None and time.perf_counter() - t0 > SLOW_STEP_S:
        on_slow(time.perf_counter() - t0)
    step()
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        step()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def _quiet(*args, **kwargs) -> None:
    """``print`` of a rank other than 0: every rank runs, rank 0 reports."""


def run_cpu(args: argparse.Namespace, sizes: list[int], contexts: list[int]) -> int:
    from ..engine import Engine
    from ..model.launch import finish, is_main_rank
    from ..runner import CudaGraphRunner, RunnerConfig

    modes = cpu_modes(args.modes)
    model, tp = args.model or "tiny", getattr(args, "tp", 1)
    from ..cli_args import model_config

    threads = set_cpu_threads(args.threads, model_config(model))
    dtype = getattr(args, "dtype", None) or "float32"
    mr = build_model_runner(model, "cpu", DTYPES[dtype], max(sizes), max(contexts) + 64, tp=tp)
    say = print if is_main_rank() else _quiet
    ranks = f", tensor parallel x{tp} (gloo; rank 0 prints)" if tp > 1 else ""
    say(f"stepgraph bench --device cpu: {model}, {dtype}, {args.iters} timed steps a point{ranks}")
    say(threads)
    if args.kernels == "fused":
        say(FUSED_NOTE)
    say(EXPLAIN)
    fill_kv_random(mr)  # random K/V: attention reads real-looking data, never zeros
    points = [Point(bs, ctx) for bs in sizes for ctx in contexts]
    rows: list[Row] = []
    eager: dict[tuple[int, int], float] = {}
    say(f"{'mode':<7}{'bs':>4}{'ctx':>7}{'ms/step':>10}{'tok/s':>9}{'vs eager':>10}")
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

            def slow(s, p=p, mode=mode):
                say(
                    f"  {mode} bs={p.bs} ctx={p.context}: {s:.1f} s a step, {args.iters + 1} "
                    "more steps for this point",
                    file=sys.stderr,
                    flush=True,
                )

            ms = host_ms(lambda b=batch, f=fwd: f(b).argmax(-1), args.iters, slow)
            for req_pages in pages:
                mr.kv_cache.release(req_pages)
            cap = runner.stats.capture if runner is not None else None
            rows.append(
                Row(
                    mode,
                    p.bs,
                    p.context,
                    ms,
                    p.bs / ms * 1e3,
                    None,
                    cap.seconds if cap else None,
                    cap.pool_bytes / 2**20 if cap else None,
                    "CPU stand-in" if runner is not None else "",
                )
            )
            if mode == "eager":
                eager[(p.bs, p.context)] = ms
            base = eager.get((p.bs, p.context))
            ratio = f"{base / ms:9.2f}x" if base else f"{'-':>10}"
            say(
                f"{mode:<7}{p.bs:>4}{p.context:>7}{ms:>10.3f}{p.bs / ms * 1e3:>9.0f}{ratio}",
                flush=True,
            )
        if runner is not None:
            runner.shutdown()
    meta = {"model": model, "dtype": dtype, "device": "cpu", "torch": torch.__version__}
    meta.update(threads=torch.get_num_threads(), iters=args.iters, tp=tp)
    if tp > 1:
        from .collectives import allreduce_us_per_step
        from .timing import host_call_ms

        ar = meta["allreduce_us_per_step"] = allreduce_us_per_step(mr, sizes, time_ms=host_call_ms)
        say(
            f"tensor parallel x{tp}: all-reduce time per step (us) by bs: {ar} eager, timed on "
            "the host; inside a graph it is measured on GPUs only (the CPU stand-in re-runs the "
            "forward, its all-reduces with it)"
        )
    same = True
    if set(CPU_MODES) <= set(modes):  # the tokens check: the same prompts through the engine
        outputs = {}
        prompts = token_check_prompts(sizes, max(contexts), mr.config)
        for mode in CPU_MODES:
            engine = Engine(mr, mode=mode)
            outputs[mode] = engine.generate(prompts, TOKEN_CHECK_NEW, ignore_eos=True)
            engine.shutdown()
        same = outputs["eager"] == outputs["graph"]
        say(f"graph tokens identical to eager: {same}")
    meta["tokens_match"] = same
    if args.json and is_main_rank():
        write_json(args.json, rows, meta)
        say(f"wrote {args.json}")
    if args.plot and is_main_rank():
        title = (
            f"stepgraph bench on the CPU: {model}, {dtype}, {torch.get_num_threads()} thread(s)"
            f"{f', tp {tp}' if tp > 1 else ''}\ngraph = the CPU stand-in (re-runs the eager "
            "forward: no kernel launches to save, no speed-up expected); no bandwidth floor"
        )
        plot(args.plot, rows, title=title)
        say(f"wrote {args.plot}")
    finish()
    return 0 if same else 1


__all__ = [
    "EXPLAIN",
    "FUSED_NOTE",
    "SMALL_HIDDEN",
    "cpu_modes",
    "host_ms",
    "run_cpu",
    "set_cpu_threads",
    "TOKEN_CHECK_NEW",
    "token_check_prompts",
]
