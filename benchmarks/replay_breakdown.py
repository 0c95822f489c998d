"""Where the host time of one ``runner.replay`` goes, measured in place (each part timed inside
the same sequence the runner runs, not alone), on the toy model of runner_overhead.py.

    PYTHONPATH=. python benchmarks/replay_breakdown.py [--json out/breakdown.json]

Each part's median microseconds over 300 replays at bs=1, each issued into an empty launch
queue, beside a bare ``graph.replay()`` and a bare one-row device copy.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from runner_overhead import make_model, random_batch  # noqa: E402  (same directory)

from stepgraph.batch import pack_batch
from stepgraph.runner import CudaGraphRunner, RunnerConfig
from stepgraph.runner.input_checks import check_values


def parts_of_one_replay(runner: CudaGraphRunner, batch, repeats: int = 300) -> dict[str, float]:
    """The runner's replay, cut at its steps (mirrors CudaGraphRunner.replay)."""
    clock, samples = time.perf_counter, {}
    for i in range(repeats + 5):
        torch.cuda.synchronize()
        t = [clock()]
        _, bucket, t_kv = runner._check_replay(batch)
        t.append(clock())
        runner._copy_inputs(batch, bucket)
        t.append(clock())
        runner.model_runner.attn_backend.init_forward_metadata_replay_cuda_graph(
            bucket, runner._static[bucket]
        )
        t.append(clock())
        runner.graphs[bucket].replay()
        if runner._staging is not None:
            runner._staging.replayed()
        t.append(clock())
        runner.output_buffers[bucket][: batch.batch_size]
        t.append(clock())
        if i >= 5:
            names = ("check", "copy_inputs", "replay_hook", "graph_replay", "slice")
            for name, a, b in zip(names, t, t[1:]):
                samples.setdefault(name, []).append((b - a) * 1e6)
    return {k: round(statistics.median(v), 2) for k, v in samples.items()}


def bare_us(fn, repeats: int = 300) -> float:
    out = []
    for i in range(repeats + 5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if i >= 5:
            out.append((time.perf_counter() - t0) * 1e6)
    return round(statistics.median(out), 2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None)
    args = p.parse_args()
    mr = make_model()
    b1 = random_batch(mr, 1, 1)
    b1.packed = pack_batch(b1)
    b1.packed_cpu = b1.packed.cpu()
    result = {}
    for checks, staged in (("host", None), ("off", None), ("host", False)):
        runner = CudaGraphRunner(
            mr,
            RunnerConfig(
                max_bs=32, show_progress=False, check_inputs=checks, pinned_staging=staged
            ),
        )
        checks = checks if staged is None else f"{checks}_unstaged"
        runner.replay(b1)
        result[f"parts_checks_{checks}"] = parts_of_one_replay(runner, b1)
        result[f"value_checks_alone_{checks}"] = bare_us(
            lambda r=runner, c=checks: check_values(b1, r._limits, c)
        )
        graph = runner.graphs[1]
        result[f"bare_graph_replay_{checks}"] = bare_us(graph.replay)
        result[f"full_replay_{checks}"] = bare_us(lambda r=runner: r.replay(b1))
        runner.shutdown()
    row = torch.empty_like(b1.packed)
    result["bare_device_copy"] = bare_us(lambda: row.copy_(b1.packed))
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
