"""`stepgraph bench`: every mode and peer, side by side, on one model in one run; with
``--quantization fp8``, our modes again on the same weights in FP8 (rows ``MODE fp8``, each
with its own floor: e4m3 weights and scales, the head in the model's dtype, the KV), and the
fidelity of FP8's next-token distributions against the model dtype's (``bench/fidelity.py``)."""

from __future__ import annotations

import argparse
import time

import torch
from tqdm.auto import tqdm

from ..cli_args import MODEL_HELP, add_device_args, add_model_args, positive_int
from .constants import CPU_MAX_BS, CPU_MODES, DTYPES, GPU_MAX_BS, GPU_MODES
from .e2e import run_engine
from .modes import OUR_MODES, run_mode
from .peers import PEERS, run_peer
from .report import Row, format_table, plot, write_json
from .serve_args import add_serve_arguments
from .workload import Point, build_model_runner, fill_kv_random, kv_bytes, weight_bytes


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_args(
        p,
        model_help=f"{MODEL_HELP} (default: llama-3.2-1b on CUDA, tiny on the CPU)",
        kernels_help="decode-step kernels on CUDA: fused (default; one-row steps) or reference "
        "(unfused)",
        tp_help="tensor-parallel ranks (torchrun --nproc-per-node N -m stepgraph bench)",
        threads=True,
        quantization_help="fp8: the same weights again in FP8 (e4m3, per channel; fp8-block: "
        "per 128x128 block), beside the model dtype in the same run: the decode step on CUDA, "
        "or with --serve the random workload (either device)",
    )
    add_device_args(
        p,
        device_help="where to run (default: cuda when a GPU is visible, else the CPU stand-in; "
        "cuda requires a GPU)",
        dtype_help="model dtype (default: bfloat16 on CUDA, float32 on the CPU)",
    )
    p.add_argument(
        "--modes",
        default=None,
        help=f"comma list of {OUR_MODES + PEERS} (default: {GPU_MODES}; CPU: "
        f"{','.join(CPU_MODES)}, the only ones it can run)",
    )
    p.add_argument(
        "--batch-sizes",
        default=None,
        help=f"default 1,8,32 (CPU: 1,2); at most {GPU_MAX_BS} (CPU: {CPU_MAX_BS})",
    )
    p.add_argument("--contexts", default=None, help="default 512,4096,32768 (CPU: 16,64)")
    p.add_argument(
        "--peer-points",
        default=None,
        choices=("small", "all"),
        help="'small' (hf-eager at bs<=8 and ctx<=4096, compile at bs=1 ctx=512) or 'all' "
        "(the decode bench on CUDA) (default: small)",
    )
    p.add_argument("--iters", type=positive_int, default=10, help="timed repetitions per point")
    p.add_argument("--json", default=None, help="write rows to this JSON file")
    p.add_argument("--plot", default=None, help="write a PNG of ms/token vs context")
    p.add_argument(
        "--prefill",
        action="store_true",
        help="time only packed prefill, eager vs piecewise graphs (stepgraph/bench/prefill.py)",
    )
    add_serve_arguments(p)  # --serve and its flags (stepgraph/bench/serve_args.py)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def peer_allowed(peer: str, points: list[Point], which: str) -> set[Point]:
    if which == "all":
        return set(points)
    if peer == "hf-eager":
        return {p for p in points if p.bs <= 8 and p.context <= 4096}
    return {p for p in points if p.bs == 1 and p.context == min(q.context for q in points)}


def check_quantization_args(args: argparse.Namespace) -> str | None:
    """``--quantization``, refused where the bench cannot run it beside the model dtype: the
    CPU stand-in (but for ``--serve``), ``--tp``, ``--prefill``, a ``--serve`` workload other
    than random."""
    quant = getattr(args, "quantization", None)
    serve, workload = getattr(args, "serve", False), getattr(args, "workload", None)
    where = [
        flag
        for flag, on in (
            ("the CPU (--device cpu, or no GPU)", args.device == "cpu" and not serve),
            ("--tp", getattr(args, "tp", 1) > 1),
            ("--prefill", getattr(args, "prefill", False)),
            (f"--workload {workload}", serve and workload not in (None, "random")),
        )
        if on
    ]
    if quant and where:
        from ..cli_args import UsageError

        raise UsageError(
            f"--quantization {quant} runs the decode step (on CUDA) or the random --serve "
            f"workload in FP8 beside the model dtype, unsharded; it does not run with "
            f"{', '.join(where)}"
        )
    return quant


def run(args: argparse.Namespace) -> int:
    quant = check_quantization_args(args)
    if getattr(args, "serve", False):
        from .serve import run_serve

        return run_serve(args)
    if getattr(args, "prefill", False):
        from .prefill import run_prefill

        return run_prefill(args)
    if args.device == "cpu":
        from .cpu import run_cpu

        return run_cpu(args, _ints(args.batch_sizes or "1,2"), _ints(args.contexts or "16,64"))
    model = args.model or "llama-3.2-1b"
    sizes = _ints(args.batch_sizes or "1,8,32")
    contexts = _ints(args.contexts or "512,4096,32768")
    modes = [m for m in (args.modes or GPU_MODES).split(",") if m]  # checked: args.py
    points = [Point(bs, ctx) for bs in sizes for ctx in contexts]
    from .floor import Bandwidth, share, spec_gbps
    from .timing import copy_bandwidth_gbps, read_bandwidth

    t0 = time.perf_counter()
    reads = read_bandwidth()  # before the model: the streams' GBs are free again after
    gpu = torch.cuda.get_device_name()
    bw = Bandwidth(max(reads.values()), spec_gbps(gpu), gpu, copy_bandwidth_gbps())
    mr = build_model_runner(
        model, "cuda", DTYPES[args.dtype], max(sizes), max(contexts) + 64, tp=args.tp
    )
    mr.set_kernels(args.kernels or "fused")
    if args.tp > 1:  # peers run unsharded only; every rank times, rank 0 reports
        modes = [m for m in modes if m in OUR_MODES and m != "engine"]  # engine: unsharded
    fill_kv_random(mr)
    wbytes = weight_bytes(mr)
    step_bytes = {(p.bs, p.context): wbytes + kv_bytes(mr, p) for p in points}
    floor_ms = {key: bw.floor_ms(n) for key, n in step_bytes.items()}
    spec_ms = {key: bw.spec_ms(n) for key, n in step_bytes.items()}
    rows: list[Row] = []
    mr8 = fid = None
    if quant:  # the same weights in FP8, its KV filled alike; fidelity before any mode runs
        from . import fidelity

        mr8 = build_model_runner(
            model, "cuda", DTYPES[args.dtype], max(sizes), max(contexts) + 64, quantization=quant
        )
        mr8.set_kernels(args.kernels or "fused")
        fill_kv_random(mr8)
        fid = fidelity.compare(mr, mr8, points)
        wbytes8 = weight_bytes(mr8)
        floor8 = {(p.bs, p.context): bw.floor_ms(wbytes8 + kv_bytes(mr8, p)) for p in points}
        spec8 = {(p.bs, p.context): bw.spec_ms(wbytes8 + kv_bytes(mr8, p)) for p in points}

    def add(mode, p, ms, capture_s=None, pool=None, note="", kernels=None, fp8=False):
        key = (p.bs, p.context)
        floor, spec = (floor8[key], spec8[key]) if fp8 else (floor_ms[key], spec_ms[key])
        rows.append(
            Row(
                f"{mode} fp8" if fp8 else mode,
                p.bs,
                p.context,
                ms,
                p.bs / ms * 1e3 if ms else None,
                share(floor, ms),
                capture_s,
                pool,
                note,
                kernels,
                share(spec, ms),
                floor if fp8 else None,
            )
        )

    from ..model.launch import finish, is_main_rank

    main_rank = is_main_rank()
    for mode in tqdm(modes, desc="stepgraph bench", unit="mode", disable=not main_rank):
        if mode in OUR_MODES:
            res = (
                run_engine(mr, points)
                if mode == "engine"
                else run_mode(mode, mr, points, args.iters)
            )
            per_bs = {q.bs: k for q, k in res.kernels_per_step.items()}
            for p in points:
                add(
                    mode,
                    p,
                    res.ms_per_token.get(p),
                    res.capture_seconds,
                    res.pool_mib,
                    res.error or "",
                    per_bs.get(p.bs),
                )
        else:
            which = args.peer_points or "small"
            res = run_peer(mode, mr, points, peer_allowed(mode, points, which))
            for p in points:
                note = res.error or res.skipped.get(p, "")
                add(mode, p, res.ms_per_token.get(p), res.compile_seconds, None, note)
    if mr8 is not None:  # our modes on the FP8 weights (peers run the model dtype only)
        for mode in tqdm(
            [m for m in modes if m in OUR_MODES],
            desc="stepgraph bench fp8",
            unit="mode",
            disable=not main_rank,
        ):
            if mode == "engine":
                res = run_engine(mr8, points)
            else:
                res = run_mode(mode, mr8, points, args.iters)
            per_bs = {q.bs: k for q, k in res.kernels_per_step.items()}
            for p in points:
                note = res.error or fid[p].text()
                add(
                    mode,
                    p,
                    res.ms_per_token.get(p),
                    res.capture_seconds,
                    res.pool_mib,
                    note,
                    per_bs.get(p.bs),
                    fp8=True,
                )
    ar = ar_graph = None
    if args.tp > 1:
        from .collectives import allreduce_in_graph, allreduce_us_per_step

        ar = allreduce_us_per_step(mr, sizes)  # eager calls, one by one
        ar_graph = allreduce_in_graph(mr, sizes, min(contexts))  # what a graph step pays
    if not main_rank:
        finish()
        return 0
    if ar is not None:
        print(f"tensor parallel x{args.tp}: all-reduce time per step (us) by bs: {ar} eager")
        for bs, r in (ar_graph or {}).items():
            print(
                f"  bs {bs}: in the graph {r['allreduce_us']} us of a {r['step_ms']} ms step "
                f"({r['allreduce_share']:.0%}; {r['allreduce_us_per_call']} us per all-reduce)"
            )
    print(
        f"\nmodel {model} ({wbytes / 1e9:.2f} GB of weights, {args.dtype}), "
        f"{time.perf_counter() - t0:.0f} s"
    )
    if mr8 is not None:
        total = fidelity.overall(fid)
        print(
            f"FP8 weights ({weight_bytes(mr8) / 1e9:.2f} GB read a step, e4m3 projections): "
            f"against {args.dtype} on the same weights over {total.rows} next-token "
            f"distributions: mean {total.text()}"
        )
    print(format_table(rows, floor_ms, bw))
    meta = {
        "model": model,
        "dtype": args.dtype,
        "read_gbps": bw.read_gbps,  # the floor's bandwidth: the best of read_gbps_by_stream
        "read_gbps_by_stream": reads,
        "spec_gbps": bw.spec_gbps,  # None: a GPU not in bench.floor.SPEC_GBPS
        "copy_gbps": bw.copy_gbps,
        "weight_bytes": wbytes,
        "gpu": gpu,
        "torch": torch.__version__,
        "tp": args.tp,
        "kernels": mr.kernels,
        "allreduce_us_per_step": ar,
        "allreduce_in_graph": ar_graph,  # step with vs without its all-reduces, replayed
    }
    if mr8 is not None:
        meta["quantization"] = quant
        meta["fp8_weight_bytes"] = weight_bytes(mr8)
        meta["fp8_fidelity"] = {
            "overall": fidelity.overall(fid).as_dict(),
            "by_point": [{"bs": p.bs, "context": p.context, **f.as_dict()} for p, f in fid.items()],
        }
    if args.json:
        write_json(args.json, rows, meta)
    if args.plot:
        title = (
            f"stepgraph bench: {model} on {meta['gpu']}{f' x{args.tp} (tp)' if args.tp > 1 else ''}"
            f", {args.dtype}, {mr.kernels} kernels"
        )
        plot(args.plot, rows, title=title, floor_ms=floor_ms)
    finish()
    return 0
