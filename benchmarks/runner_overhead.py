"""What the runner costs on top of a bare graph, and what capture costs.

    PYTHONPATH=. python benchmarks/runner_overhead.py --json out/runner.json
    PYTHONPATH=. python benchmarks/runner_overhead.py --replay-only      # the host figures alone
    PYTHONPATH=. python benchmarks/runner_overhead.py --device cpu       # no GPU: parts on the CPU

Reports, on a toy paged model of about 200 kernels per step:
  - host time of runner.replay() at bs=1 minus a bare graph.replay()     (target <= 15 us),
    default config (pinned staging on CUDA): a user's batch with value checks on (host rows
    and device rows; the same tensors every call, and new tensors every call), an engine's
    batch (host rows only, ``values_checked=True``), a batch of device fields only
  - the host parts of a replay, each timed alone
  - eager step time vs graph step time at bs 1, 8, 32                   (CUDA events, medians)
  - capture seconds and pool MiB: one bucket, the largest alone, all default buckets to 256
    (targets: <= 50 ms per bucket, pool(all) <= 1.2 x pool(largest alone))
  - the full capture with and without freeze_gc

``--device cpu`` runs the runner on the CPU stand-in, staged as on CUDA, with a no-op graph
(its launch only counts the staged copy, as a graph's does): the Python host path alone, part
by part, for profiling without a GPU.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time

import torch

from stepgraph.batch import pack_batch
from stepgraph.bench.timing import cuda_time_ms
from stepgraph.runner import CudaGraphRunner, RunnerConfig
from stepgraph.runner.input_checks import check_rows_fast, check_values
from stepgraph.toy_model import ToyModelRunner


def make_model(device: str = "cuda", num_layers: int = 24) -> ToyModelRunner:
    cpu = device == "cpu"  # the stand-in's graph is a no-op there: one small layer is enough
    return ToyModelRunner(
        vocab=1024,
        hidden=16 if cpu else 256,
        num_layers=1 if cpu else num_layers,
        num_pages=4200,
        page_size=16,
        max_pages_per_request=16,
        device=device,
        seed=0,
    )


def random_batch(mr: ToyModelRunner, bs: int, seed: int):
    return mr.random_batch(bs, torch.Generator().manual_seed(seed))


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def host_us_per_call(fn, *, repeats: int = 300) -> float:
    """Median host microseconds of one call issued into an empty launch queue (drained before
    each call), so the figure is what the CPU spends, never time spent waiting on the GPU."""
    for _ in range(5):
        fn()
    samples = []
    for _ in range(repeats):
        _sync()
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6)
    _sync()
    return statistics.median(samples)


def user_batch(mr: ToyModelRunner, seed: int):
    """A user's batch with its rows on the host and the device (``packed_cpu``, ``packed``),
    values unchecked: the runner checks them."""
    b = random_batch(mr, 1, seed)
    b.packed = pack_batch(b)
    b.packed_cpu = b.packed.cpu()
    return b


def cycling(batches):
    """A call that replays the next of ``batches`` each time: new tensors every call."""
    following = itertools.cycle(batches).__next__
    return lambda runner: runner.replay(following())


def interleaved_us(calls: dict, *, rounds: int = 400, warmup: int = 5) -> dict:
    """Host microseconds of each call in ``calls`` (``"bare"`` among them), each timed alone
    right after the device drained (no sync inside the timed region), in rounds that take every
    call once in a rotating order, so that a host that drifts over the run drifts for all
    alike. Per call: the median, and the median over rounds of its time minus the bare call's
    of the same round (``_over_bare``). Timed back to back instead, a call finds its code and
    the interpreter's branch history warm: a user's batch on the CPU stand-in cost 3.4-3.9 us
    so, 5.3-5.7 interleaved, 8.4 after a 100 us spin before each call."""
    names = list(calls)
    for name in names:
        for _ in range(warmup):
            calls[name]()
    samples: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            fn = calls[name]
            _sync()
            t0 = time.perf_counter()
            fn()
            samples[name].append((time.perf_counter() - t0) * 1e6)
    _sync()
    out = {}
    for name in names:
        out[name] = statistics.median(samples[name])
        if name != "bare":
            pairs = zip(samples[name], samples["bare"])
            out[f"{name}_over_bare"] = statistics.median(a - b for a, b in pairs)
    return out


def bare_launch(runner: CudaGraphRunner, bucket: int = 1):
    """The bare ``graph.replay()`` of ``bucket``, with the staged copy counted on the host as
    a replay through the runner counts it (else the runner's next call finds the device's
    count ahead and synchronizes to count back in: a CUDA call inside its timed call)."""
    launch, staging = runner.graphs[bucket].replay, runner._staging
    if staging is None:
        return launch

    def bare() -> None:
        launch()
        staging.count += 1

    return bare


def replay_host_rows(mr: ToyModelRunner, runner: CudaGraphRunner, bare_fn) -> dict:
    """Host microseconds of ``runner.replay`` at bs 1 for each kind of batch over ``bare_fn``
    (the bare launch), in interleaved rounds (``interleaved_us``), and the host parts of the
    staged path alone (pure host work, no device call: timed back to back)."""
    b1 = user_batch(mr, 1)
    engine_b1 = random_batch(mr, 1, 1)  # an engine's: host rows only, values vouched for
    engine_b1.packed_cpu, engine_b1.values_checked = b1.packed_cpu, True
    engine_b1.max_seq_len = int(b1.seq_lens_cpu.max())  # ModelRunner.decode_batch sets it
    fields_b1 = random_batch(mr, 1, 1)  # device fields only (no host rows): packed per call
    fresh = cycling([user_batch(mr, 1000 + i) for i in range(64)])
    runner.replay(b1)
    out = interleaved_us(
        {
            "bare": bare_fn,
            "user": lambda: runner.replay(b1),  # value checks on (check_inputs="host")
            "user_new_tensors": lambda: fresh(runner),
            "engine": lambda: runner.replay(engine_b1),
            "device_fields": lambda: runner.replay(fields_b1),
        }
    )
    staging, rows = runner._staging, runner._host_rows(b1)
    parts = {
        # the rows' numpy views: kept for the same tensor, taken anew for another
        "host_rows": host_us_per_call(lambda: runner._host_rows(b1)),
        "host_rows_new_tensors": host_us_per_call(
            lambda: (runner._host_rows(b1), setattr(runner, "_rows", (0, 0, None, None)))
        ),
        # RunnerConfig.check_inputs="host" (default): one vectorised compare of the host rows
        "value_checks": host_us_per_call(lambda: check_rows_fast(rows[2], rows[3], runner._limits)),
        "stage_host_lens": host_us_per_call(lambda: runner.buffers.stage_host_lens(rows[2], 1)),
        "replay_hook": host_us_per_call(
            lambda: mr.attn_backend.init_forward_metadata_replay_cuda_graph(1, runner._static[1])
        ),
        # the general path's checks, what a batch without usable host rows pays
        "general_input_checks": host_us_per_call(lambda: runner._input_problem(fields_b1, 1)),
        "general_value_checks": host_us_per_call(
            lambda: check_values(b1, runner._limits, runner.config.check_inputs)
        ),
    }
    if staging is not None:  # the slot write alone (the same slot each time: no launch)
        parts["stage_rows"] = host_us_per_call(lambda: staging.stage_rows(rows[2], 1))
    out["parts"] = parts
    return out


def cpu_main(args) -> None:
    """The host path on the CPU stand-in, staged as on CUDA, with a no-op graph."""
    torch.set_num_threads(1)
    mr = make_model("cpu")
    cfg = RunnerConfig(max_bs=32, show_progress=False, pinned_staging=True)
    runner = CudaGraphRunner(mr, cfg)
    staging = runner._staging

    def bare() -> None:  # a graph's launch as the host sees it: the staged copy counted
        staging._copied_np[0] += 1

    def bare_alone() -> None:  # counted on the host too, as ``bare_launch`` does
        bare()
        staging.count += 1

    for graph in runner.graphs.values():
        graph.launcher = lambda: bare
    runner._states.clear()  # the per-bucket state takes the no-op launch
    rows = {"device": "cpu", "replay_bs1": replay_host_rows(mr, runner, bare_alone)}
    text = json.dumps(rows, indent=2)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    print(text)


def count_kernels(mr, batch) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        mr.forward(batch)
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type.name == "CUDA")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument(
        "--replay-only", action="store_true", help="the replay host figures only (no capture)"
    )
    args = ap.parse_args()
    if args.device == "cpu":
        return cpu_main(args)
    rows: dict[str, object] = {}
    mr = make_model()
    if args.replay_only:
        return replay_only(mr, args)

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
    rows["replay_bs1"] = replay_host_rows(mr, runner, bare_launch(runner))  # every kind, parts
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
    r = rows["replay_bs1"]
    for k in ("user", "user_new_tensors", "engine", "device_fields"):
        print(f"  {k:<18} {r[k + '_over_bare']:6.1f} us over the bare replay ({r['bare']:.1f} us)")
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


def replay_only(mr: ToyModelRunner, args) -> None:
    """The replay host figures alone: on the toy of about 200 kernels, and on a graph short on
    the GPU (one layer, about 10 kernels), whose bare launch costs little and swings less."""
    runner = CudaGraphRunner(mr, RunnerConfig(max_bs=32, show_progress=False))
    rows = {
        "device": torch.cuda.get_device_name(),
        "kernels_per_step": count_kernels(mr, user_batch(mr, 1)),
        "staged_by_default": runner.staged,
        "replay_bs1": replay_host_rows(mr, runner, bare_launch(runner)),
    }
    runner.shutdown()
    short = make_model(num_layers=1)
    runner = CudaGraphRunner(short, RunnerConfig(max_bs=32, show_progress=False))
    rows["short_graph_kernels_per_step"] = count_kernels(short, user_batch(short, 1))
    rows["short_graph_replay_bs1"] = replay_host_rows(short, runner, bare_launch(runner))
    runner.shutdown()
    text = json.dumps(rows, indent=2)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    print(text)
    for key, kernels in (("replay_bs1", "kernels_per_step"), ("short_graph_replay_bs1", None)):
        r, n = rows[key], rows[kernels or "short_graph_kernels_per_step"]
        print(
            f"\nrunner.replay host time over a bare graph.replay() ({n} kernels, bare "
            f"{r['bare']:.1f} us), bs 1, median of paired rounds:"
        )
        for k in ("user", "user_new_tensors", "engine", "device_fields"):
            print(f"  {k:<18} {r[k + '_over_bare']:6.1f} us  (median {r[k]:.1f}; target <= 15)")


if __name__ == "__main__":
    main()
