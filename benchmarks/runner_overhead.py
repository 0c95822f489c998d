"""What the runner costs on top of a bare graph, and what capture costs.

    PYTHONPATH=. python benchmarks/runner_overhead.py --json out/runner.json

Reports, on a toy paged model of about 200 kernels per step:
  - host time of runner.replay() at bs=1 minus a bare graph.replay()     (target <= 15 us),
    default config (pinned staging on CUDA), value checks on, and for an engine's batch
    (host rows only, ``values_checked=True``)
  - eager step time vs graph step time at bs 1, 8, 32                   (CUDA events, medians)
  - capture seconds and pool MiB: one bucket, the largest alone, all default buckets to 256
    (targets: <= 50 ms per bucket, pool(all) <= 1.2 x pool(largest alone))
  - the full capture with and without freeze_gc
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from stepgraph.batch import pack_batch
from stepgraph.bench.timing import cuda_time_ms
from stepgraph.runner import CudaGraphRunner, RunnerConfig
from stepgraph.runner.input_checks import check_values
from stepgraph.toy_model import ToyModelRunner


def make_model() -> ToyModelRunner:
    return ToyModelRunner(
        vocab=1024,
        hidden=256,
        num_layers=24,
        num_pages=4200,
        page_size=16,
        max_pages_per_request=16,
        device="cuda",
        seed=0,
    )


def random_batch(mr: ToyModelRunner, bs: int, seed: int):
    return mr.random_batch(bs, torch.Generator().manual_seed(seed))


def host_us_per_call(fn, *, repeats: int = 300) -> float:
    """Median host microseconds of one call issued into an empty launch queue (drained before
    each call), so the figure is what the CPU spends, never time spent waiting on the GPU."""
    for _ in range(5):
        fn()
    samples = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(samples)


def count_kernels(mr, batch) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        mr.forward(batch)
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type.name == "CUDA")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows: dict[str, object] = {}
    mr = make_model()

    # -- capture cost -------------------------------------------------------------------------
    def capture(**kw):
        r = CudaGraphRunner(mr, RunnerConfig(show_progress=False, **kw))
        s = r.stats.capture
        out = {
            "buckets": len(s.buckets),
            "seconds": s.seconds,
            "pool_mib": s.pool_bytes / 2**20,
            "ms_per_bucket": 1e3 * s.seconds / len(s.buckets),
        }
        r.shutdown()
        torch.cuda.empty_cache()
        return out

    rows["capture_one_bucket"] = capture(capture_bs=(1,))
    rows["capture_largest_alone"] = capture(capture_bs=(256,))
    rows["capture_all_256"] = capture(max_bs=256)
    rows["capture_all_256_no_freeze_gc"] = capture(max_bs=256, freeze_gc=False)
    rows["pool_ratio_all_vs_largest"] = rows["capture_all_256"]["pool_mib"] / max(
        rows["capture_largest_alone"]["pool_mib"], 1e-9
    )

    # -- replay overhead at bs=1 --------------------------------------------------------------
    # The default config: on CUDA the packed rows are staged in pinned memory (runner.staged).
    runner = CudaGraphRunner(mr, RunnerConfig(max_bs=32, show_progress=False))
    rows["staged_by_default"] = runner.staged
    b1 = random_batch(mr, 1, 1)
    b1.packed = pack_batch(b1)  # what an engine builds on the host and copies once
    b1.packed_cpu = b1.packed.cpu()  # the host rows it keeps: checks and staging read them
    rows["kernels_per_step"] = count_kernels(mr, b1)
    graph = runner.graphs[1]
    runner.replay(b1)
    bare = host_us_per_call(graph.replay)
    full = host_us_per_call(lambda: runner.replay(b1))  # value checks on (check_inputs="host")
    # An engine's batch: host rows only, values vouched for by the builder (values_checked)
    engine_b1 = random_batch(mr, 1, 1)
    engine_b1.packed_cpu, engine_b1.values_checked = b1.packed_cpu, True
    engine_b1.max_seq_len = int(b1.seq_lens_cpu.max())  # ModelRunner.decode_batch sets it
    engine_style = host_us_per_call(lambda: runner.replay(engine_b1))
    rows["host_us_bare_graph_replay"] = bare
    rows["host_us_runner_replay"] = full
    rows["host_us_runner_overhead"] = full - bare
    rows["host_us_runner_replay_engine_batch"] = engine_style
    rows["host_us_runner_overhead_engine_batch"] = engine_style - bare
    unstaged = CudaGraphRunner(
        mr, RunnerConfig(max_bs=32, show_progress=False, pinned_staging=False)
    )
    unstaged.replay(b1)
    rows["host_us_runner_replay_unstaged"] = host_us_per_call(lambda: unstaged.replay(b1))
    unstaged.shutdown()
    unpacked = CudaGraphRunner(
        mr, RunnerConfig(max_bs=32, show_progress=False, packed_inputs=False)
    )
    b1_fields = random_batch(mr, 1, 1)
    unpacked.replay(b1_fields)
    rows["host_us_runner_replay_unpacked"] = host_us_per_call(lambda: unpacked.replay(b1_fields))
    unpacked.shutdown()
    rows["check_inputs"] = runner.config.check_inputs
    staging = runner._staging
    rows["host_us_parts_staged"] = (
        {
            "stage": host_us_per_call(lambda: staging.stage(b1, 1)),
            "wait_check": host_us_per_call(lambda: staging._wait_for(0)),
            "copy_host_lens": host_us_per_call(lambda: runner.buffers.copy_host_lens(b1, 1)),
        }
        if staging is not None
        else None
    )
    # Where the runner's host time goes (each piece timed alone).
    bucket = runner._static[1]
    rows["host_us_parts"] = {
        "replay_hook": host_us_per_call(
            lambda: mr.attn_backend.init_forward_metadata_replay_cuda_graph(1, bucket)
        ),
        "input_checks": host_us_per_call(lambda: runner._input_problem(b1)),
        # RunnerConfig.check_inputs="host" (default): value checks of seq_lens_cpu and the
        # host rows (runner/input_checks.py); skipped for a batch with values_checked=True
        "value_checks": host_us_per_call(
            lambda: check_values(b1, runner._limits, runner.config.check_inputs)
        ),
    }
    no_checks = CudaGraphRunner(
        mr, RunnerConfig(max_bs=32, show_progress=False, check_inputs="off")
    )
    no_checks.replay(b1)
    rows["host_us_runner_replay_checks_off"] = host_us_per_call(lambda: no_checks.replay(b1))
    no_checks.shutdown()

    # -- eager vs graph step time -------------------------------------------------------------
    steps = []
    for bs in (1, 8, 32):
        batch = random_batch(mr, bs, 100 + bs)
        eager = cuda_time_ms(lambda b=batch: mr.forward(b), warmup=5, iters=30)
        graphed = cuda_time_ms(lambda b=batch: runner.replay(b), warmup=5, iters=30)
        steps.append({"bs": bs, "eager_ms": eager, "graph_ms": graphed, "speedup": eager / graphed})
    rows["step_time"] = steps

    rows["summary"] = {
        "replay_overhead_us": round(full - bare, 2),
        "replay_overhead_engine_batch_us": round(engine_style - bare, 2),
        "speedup_bs1": round(steps[0]["speedup"], 2),
        "ms_per_bucket_all": round(rows["capture_all_256"]["ms_per_bucket"], 2),
        "pool_ratio": round(rows["pool_ratio_all_vs_largest"], 3),
    }
    text = json.dumps(rows, indent=2)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    print(text)
    print(f"\nrunner overhead (toy model, {rows['kernels_per_step']} kernels/step)")
    print(
        f"  replay host overhead at bs=1: {full - bare:6.1f} us  (bare graph.replay {bare:.1f}"
        f" us, runner.replay {full:.1f} us; target <= 15)"
    )
    print(
        f"  an engine's batch (host rows, values_checked): {engine_style - bare:6.1f} us  "
        f"(runner.replay {engine_style:.1f} us; staged={rows['staged_by_default']})"
    )
    for s in steps:
        print(
            f"  bs={s['bs']:>3}: eager {s['eager_ms']:.3f} ms  graph {s['graph_ms']:.3f} ms  "
            f"x{s['speedup']:.1f}"
        )
    for k in (
        "capture_one_bucket",
        "capture_largest_alone",
        "capture_all_256",
        "capture_all_256_no_freeze_gc",
    ):
        c = rows[k]
        print(
            f"  {k:<30} {c['buckets']:>3} buckets {c['seconds']:.3f} s "
            f"({c['ms_per_bucket']:.1f} ms/bucket) pool {c['pool_mib']:.1f} MiB"
        )
    print(f"  pool(all)/pool(largest) = {rows['pool_ratio_all_vs_largest']:.2f} (target <= 1.2)")


if __name__ == "__main__":
    main()
