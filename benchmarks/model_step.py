"""One decode step of the reference model by linear policy and kernels (llama-3.2-1b preset,
bf16, random weights, page size 64, context 512), replayed from a CUDA graph, at bs 1 and 8.

    PYTHONPATH=. python3 benchmarks/model_step.py --json $OUT/model_step.json

1. Each projection shape alone (weights rotated over enough copies to defeat the 50 MB L2, many
   calls captured in one graph): cuBLAS (F.linear) against the Triton GEMV at a few tile
   configs; microseconds per call and GB/s of weight bytes. The winner per (shape, bs) picks
   the GEMV policy "best" ({shape: largest measured bs it wins at}).
2. The whole step, three linear policies (cuBLAS everywhere, GEMV everywhere, best) on the
   reference kernels, then the fused kernels (``--kernels fused``): ms per
   step (CUDA events, median; ``replay(b).argmax(-1)`` as ``stepgraph bench`` times it), the
   bandwidth floor ((weights + live KV) / the read-stream bandwidth measured in the same run,
   ``bench.timing.read_bandwidth``) and the fractions of it and of the GPU's specification
   bandwidth, kernels per step and the top-15 kernels by total time from torch.profiler over a
   few replays.
A short table is printed last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict

import torch
import torch.nn.functional as F

from stepgraph.bench.floor import share, spec_gbps
from stepgraph.bench.timing import (
    copy_bandwidth_gbps,
    cuda_time_ms,
    graph_call_us,
    read_bandwidth,
)
from stepgraph.bench.workload import (
    Point,
    build_model_runner,
    decode_batch,
    fill_kv_random,
    kv_bytes,
    weight_bytes,
)
from stepgraph.kernels.proj.gemv import gemv, gemv_blocks
from stepgraph.runner import CudaGraphRunner, RunnerConfig

MODEL, DTYPE, PAGE_SIZE, CONTEXT = "llama-3.2-1b", torch.bfloat16, 64, 512
BATCH_SIZES = (1, 8)
ROTATE_BYTES = 256 << 20  # weight copies per shape add up to this (L2 is 50 MB)
PROFILE_REPLAYS = 5
TOP_K = 15
# GEMV tiles swept per batch size: (BLOCK_N, BLOCK_K, num_warps); the default joins them
GEMV_CONFIGS = {
    1: [(4, 2048, 4), (8, 1024, 4), (16, 512, 4), (32, 256, 4), (8, 1024, 8)],
    8: [(4, 256, 4), (2, 512, 4), (8, 128, 4), (4, 256, 8)],
}


def graph_time_us(fns: list, repeats: int = 3) -> float:
    """Median µs per call of ``fns`` (called in turn, ``repeats`` times) captured in one graph."""
    return graph_call_us(fns, repeats=repeats, iters=15)


def time_shapes(mr, gbps: float) -> tuple[list[dict], dict]:
    """Each projection shape alone, cuBLAS vs GEMV configs; returns rows and the best policy."""
    shapes = sorted(
        {
            (m.out_features, m.in_features)
            for m in mr.model.modules()
            if isinstance(m, torch.nn.Linear)
        }
    )
    rows, policy = [], {}
    g = torch.Generator(device=mr.device).manual_seed(0)
    for n, k in shapes:
        nbytes = n * k * 2
        copies = max(1, min(32, ROTATE_BYTES // nbytes))
        ws = [
            torch.randn(n, k, device=mr.device, generator=g).to(DTYPE) * k**-0.5
            for _ in range(copies)
        ]
        wins_up_to, wins_so_far = 0, True
        for bs in BATCH_SIZES:
            x = torch.randn(bs, k, device=mr.device, generator=g).to(DTYPE)
            ref = F.linear(x, ws[0]).double()
            cublas = graph_time_us([lambda x=x, w=w: F.linear(x, w) for w in ws])
            configs = [gemv_blocks(bs, n, k), *GEMV_CONFIGS[bs]]
            best = (float("inf"), None)
            for cfg in dict.fromkeys(configs):  # default first, no repeats
                bn, bk, nw = cfg
                kw = dict(block_n=bn, block_k=bk, num_warps=nw)
                err = ((gemv(x, ws[0], **kw).double() - ref).norm() / ref.norm()).item()
                if not err < 2e-2:  # a wrong kernel is reported, never timed
                    rows.append(dict(shape=[n, k], bs=bs, config=list(cfg), error=err))
                    continue
                us = graph_time_us([lambda x=x, w=w, kw=kw: gemv(x, w, **kw) for w in ws])
                best = min(best, (us, cfg))
            row = dict(
                shape=[n, k],
                bs=bs,
                cublas_us=cublas,
                gemv_us=best[0],
                gemv_config=list(best[1] or ()),
                weight_mb=nbytes / 1e6,
                cublas_gbps=nbytes / cublas / 1e3,
                gemv_gbps=nbytes / best[0] / 1e3,
                floor_us=nbytes / gbps / 1e3,
            )
            rows.append(row)
            if best[0] < cublas and wins_so_far:
                wins_up_to = bs  # the GEMV wins at every measured bs up to this one
            else:
                wins_so_far = False
        policy[(n, k)] = wins_up_to
        del ws
        torch.cuda.empty_cache()
    return rows, policy


def profile_step(step, replays: int = PROFILE_REPLAYS) -> dict:
    """Kernels per step and the top kernels by total device time (grouped by name)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            step()
        torch.cuda.synchronize()
    total, count = defaultdict(float), defaultdict(int)
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            total[e.name] += e.time_range.elapsed_us()
            count[e.name] += 1
    top = sorted(total, key=total.get, reverse=True)[:TOP_K]
    return dict(
        kernels_per_step=sum(count.values()) / replays,
        device_us_per_step=sum(total.values()) / replays,
        top=[
            dict(name=n[:90], us_per_step=total[n] / replays, calls_per_step=count[n] / replays)
            for n in top
        ],
    )


def time_policy(
    mr, name: str, policy, floor_ms: dict, kernels: str = "reference", spec_ms: dict | None = None
) -> dict:
    mr.model.use_gemv(policy)
    mr.set_kernels(kernels)  # "fused": one-row steps run model/decode/fused_decode.py
    cfg = RunnerConfig(max_bs=max(BATCH_SIZES), capture_bs=BATCH_SIZES, show_progress=False)
    t0 = time.perf_counter()
    runner = CudaGraphRunner(mr, cfg)
    out = dict(policy=name, capture_s=time.perf_counter() - t0, points={})
    try:
        for bs in BATCH_SIZES:
            batch, pages = decode_batch(mr, Point(bs, CONTEXT))
            if mr.fused_tokens(bs) is not None:  # greedy tokens come out of the step
                step = lambda b=batch: runner.replay(b)  # noqa: E731
            else:
                step = lambda b=batch: runner.replay(b).argmax(-1)  # noqa: E731
            ms = [cuda_time_ms(step, warmup=5, iters=20, inner=5) for _ in range(2)]
            prof = {}
            try:
                prof = profile_step(step)
            except Exception as e:  # the timing stands without the profile
                prof = dict(error=f"{type(e).__name__}: {e}"[:200])
            out["points"][bs] = dict(
                ms=statistics.median(ms),
                ms_runs=ms,
                floor_ms=floor_ms[bs],
                fraction_of_floor=floor_ms[bs] / statistics.median(ms),
                fraction_of_spec=share((spec_ms or {}).get(bs), statistics.median(ms)),
                **prof,
            )
            for p in pages:
                mr.kv_cache.release(p)
    finally:
        runner.shutdown()
        mr.model.use_gemv(None)
        torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> dict:
    global BATCH_SIZES
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the full results here")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="skip the shape sweep and the GEMV policies: cuBLAS (the reference "
        "kernels) against the fused step only",
    )
    ap.add_argument(
        "--batch-sizes",
        default=",".join(map(str, BATCH_SIZES)),
        help="the steps' batch sizes (up to 64; default %(default)s)",
    )
    args = ap.parse_args(argv)
    BATCH_SIZES = tuple(int(b) for b in args.batch_sizes.split(","))
    t_start = time.perf_counter()
    torch.manual_seed(0)
    reads = read_bandwidth()  # the floor's bandwidth: a read-only stream, before the model
    gbps, copy_gbps = max(reads.values()), copy_bandwidth_gbps()
    spec = spec_gbps(torch.cuda.get_device_name())
    mr = build_model_runner(
        MODEL, "cuda", DTYPE, max_bs=max(32, *BATCH_SIZES), max_context=1024, page_size=PAGE_SIZE
    )
    fill_kv_random(mr)
    step_bytes = {bs: weight_bytes(mr) + kv_bytes(mr, Point(bs, CONTEXT)) for bs in BATCH_SIZES}
    floor_ms = {bs: n / gbps / 1e6 for bs, n in step_bytes.items()}
    spec_ms = {bs: n / spec / 1e6 for bs, n in step_bytes.items()} if spec else {}
    shape_rows, best = ([], {}) if args.quick else time_shapes(mr, gbps)
    policies = [("cublas", None)]
    if not args.quick:
        policies += [("gemv-all", "all"), ("gemv-best", best)]
    steps = [time_policy(mr, name, pol, floor_ms, spec_ms=spec_ms) for name, pol in policies]
    # the fused step (every bs up to FUSED_MAX_BS; tensor-core tiles from 2 rows)
    # (no GEMV policy: the step's reference rows are ``DecodeTuning.reference_rows``)
    steps.append(time_policy(mr, "fused", None, floor_ms, kernels="fused", spec_ms=spec_ms))
    result = dict(
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        read_gbps=gbps,
        read_gbps_by_stream=reads,
        copy_gbps=copy_gbps,
        spec_gbps=spec,
        model=MODEL,
        context=CONTEXT,
        shapes=shape_rows,
        gemv_best={f"{n}x{k}": v for (n, k), v in best.items()},
        steps=steps,
        seconds=time.perf_counter() - t_start,
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)

    for s in steps:
        for bs, p in s["points"].items():
            print(f"\n[{s['policy']} bs={bs}] top kernels (µs/step, calls/step):")
            for t in p.get("top", []):
                print(f"  {t['us_per_step']:8.1f} {t['calls_per_step']:5.0f}  {t['name']}")
    spec_text = f"{spec:.0f} GB/s" if spec else "– (unknown GPU)"
    print(
        f"\nread stream {gbps:.0f} GB/s (the floor), copy {copy_gbps:.0f} GB/s, "
        f"specification {spec_text}; {result['seconds']:.0f} s in all"
    )
    print(
        f"{'shape (N x K)':>15} {'bs':>3} {'cuBLAS us':>9} {'GB/s':>5} {'GEMV us':>8} "
        f"{'GB/s':>5} {'floor us':>8}  GEMV tile"
    )
    for r in shape_rows:
        if "error" in r:
            print(f"{r['shape']} bs={r['bs']} config {r['config']}: WRONG, rel err {r['error']}")
            continue
        n, k = r["shape"]
        print(
            f"{f'{n} x {k}':>15} {r['bs']:>3} {r['cublas_us']:9.2f} {r['cublas_gbps']:5.0f} "
            f"{r['gemv_us']:8.2f} {r['gemv_gbps']:5.0f} {r['floor_us']:8.2f}  "
            f"{r['gemv_config']}"
        )
    print(f"GEMV policy 'best' {{shape: max bs}}: {result['gemv_best']}")
    print(
        f"{'policy':>10} {'bs':>3} {'ms/step':>8} {'floor ms':>8} {'% floor':>7} {'% spec':>7} "
        f"{'kernels':>7}"
    )
    for s in steps:
        for bs, p in s["points"].items():
            of_spec = p["fraction_of_spec"]
            spec_cell = f"{100 * of_spec:6.1f}%" if of_spec else f"{'–':>7}"
            print(
                f"{s['policy']:>10} {bs:>3} {p['ms']:8.3f} {p['floor_ms']:8.3f} "
                f"{100 * p['fraction_of_floor']:6.1f}% {spec_cell} "
                f"{p.get('kernels_per_step', -1):7.0f}"
            )
    return result


if __name__ == "__main__":
    main()
