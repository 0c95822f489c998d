"""Soak: 100,000 generated tokens through one exact-mode engine, with continuous
batching, bucket switching and requests joining and leaving; memory must not grow.

    PYTHONPATH=. python benchmarks/soak.py                 # llama-3.2-1b preset, bf16, 100k tokens
    PYTHONPATH=. python benchmarks/soak.py --short --json out/soak.json     # scripts/gpu-check

Reports GPU memory allocated and reserved (the graph pool is part of reserved), the capture
pool and host RSS after warm-up (capture plus the first tenth of the tokens) and at the end.
Targets: growth under 1 MiB on the GPU and under 10 MiB on the host.

Then the last ``--last`` requests are checked: the engine drains, they run as the soak's final
segment (arrivals at recorded steps), and the same segment is replayed in an eager engine over
the same weights. Same batches, same geometry (exact retunes the split count to the live KV
length, as eager chooses it), so the tokens must be equal. Exit status 1 on any miss.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time

import torch

from stepgraph.engine import Engine
from stepgraph.model import ModelRunner
from stepgraph.runner import RunnerConfig

GPU_GROWTH_LIMIT = 2**20  # bytes
HOST_GROWTH_LIMIT = 10 * 2**20


def host_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def memory(engine: Engine) -> dict[str, int]:
    gc.collect()
    torch.cuda.synchronize()
    return {
        "gpu_allocated": torch.cuda.memory_allocated(),
        "gpu_reserved": torch.cuda.memory_reserved(),
        "pool_bytes": engine.runner.stats.capture.pool_bytes,
        "host_rss": host_rss_bytes(),
    }


class Workload:
    """Random requests: prompts 1..max_prompt tokens, 1..max_new new tokens, a few arriving
    before each step so the running batch wanders across the buckets."""

    def __init__(self, seed: int, vocab: int, max_prompt: int, max_new: int, max_bs: int):
        self.rng = random.Random(seed)
        self.vocab, self.max_prompt, self.max_new, self.max_bs = vocab, max_prompt, max_new, max_bs

    def request(self) -> tuple[list[int], int]:
        n = self.rng.randint(1, self.max_prompt)
        return [self.rng.randrange(1, self.vocab) for _ in range(n)], self.rng.randint(
            1, self.max_new
        )

    def arrivals(self, live: int) -> int:
        """Requests to add now: bursts while the batch is small, a trickle when it is full."""
        if live < self.max_bs // 4:
            return self.rng.randint(0, self.max_bs // 2)
        return self.rng.choice([0, 0, 0, 1, 2]) if live < self.max_bs else 0


def run_tokens(engine: Engine, work: Workload, target: int) -> int:
    """Serve random requests until ``target`` tokens are generated; return the count."""
    made = 0
    while made < target:
        for _ in range(work.arrivals(len(engine.running) + len(engine.waiting))):
            engine.add_request(*work.request())
        made += len(engine.step())
        for rid in [r for r in engine.finished]:
            del engine.finished[rid]  # consumed: the soak must not hold every output
    return made


def run_segment(engine: Engine, schedule: list[tuple[int, list[int], int]]) -> list[list[int]]:
    """Add ``schedule``'s requests at their steps (from an idle engine); run to the end."""
    assert not engine.has_unfinished
    rids, step, todo = [], 0, list(schedule)
    while todo or engine.has_unfinished:
        while todo and todo[0][0] == step:
            _, prompt, n = todo.pop(0)
            rids.append(engine.add_request(prompt, n))
        engine.step()
        step += 1
    return [engine.finished.pop(rid).output for rid in rids]


def segment_schedule(work: Workload, n: int) -> list[tuple[int, list[int], int]]:
    """``n`` requests: a burst at step 0, then 0 to max_bs/4 more before each later step, so
    they join and leave a running batch (arrivals beyond the free pages wait their turn)."""
    schedule, step = [], 0
    while len(schedule) < n:
        k = work.max_bs // 2 if step == 0 else work.rng.randint(0, work.max_bs // 4)
        schedule += [(step, *work.request()) for _ in range(min(k, n - len(schedule)))]
        step += 1
    return schedule


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-3.2-1b")
    p.add_argument("--tokens", type=int, default=100_000)
    p.add_argument("--short", action="store_true", help="10,000 tokens, 40 checked requests")
    p.add_argument("--last", type=int, default=100, help="requests rerun eagerly at the end")
    p.add_argument("--max-bs", type=int, default=32)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.short:
        args.tokens, args.last = 10_000, 40
    if not torch.cuda.is_available():
        print("soak: needs an NVIDIA GPU")
        return 2
    t0 = time.perf_counter()
    mr = ModelRunner.from_preset(
        args.model,
        "cuda",
        torch.bfloat16,
        args.seed,
        max_bs=args.max_bs,
        max_context_len=args.context,
    )
    # max_running = the largest bucket: every decode step replays a graph, none runs eagerly
    config = RunnerConfig(max_bs=args.max_bs, show_progress=False)
    engine = Engine(mr, "exact", config, max_running=args.max_bs)
    work = Workload(args.seed, mr.config.vocab_size, args.context // 2, 128, args.max_bs)
    warm = max(args.tokens // 10, 2000)  # every bucket, split count and kernel seen
    made = run_tokens(engine, work, warm)
    before = memory(engine)
    t1 = time.perf_counter()
    trace = [round(before["host_rss"] / 2**20, 1)]  # host RSS (MiB) after each fifth: a leak
    for _ in range(5):  # keeps climbing, a cache that fills once flattens out
        made += run_tokens(engine, work, (args.tokens - warm) // 5)
        trace.append(round(host_rss_bytes() / 2**20, 1))
    while engine.has_unfinished:  # drain: the checked segment starts from an idle engine
        made += len(engine.step())
        engine.finished.clear()
    schedule = segment_schedule(work, args.last)
    exact_out = run_segment(engine, schedule)
    made += sum(len(o) for o in exact_out)
    seconds = time.perf_counter() - t1
    after = memory(engine)
    free = engine.prefix_cache.num_available  # free, or cached and unreferenced
    assert not engine.has_unfinished and free == mr.kv_cache.num_pages - 1

    eager_mr = ModelRunner.from_model(
        mr.model,
        device="cuda",
        dtype=torch.bfloat16,
        max_bs=args.max_bs,
        max_context_len=args.context,
    )
    eager_out = run_segment(Engine(eager_mr, "eager", max_running=args.max_bs), schedule)
    differ = sum(a != b for a, b in zip(exact_out, eager_out))
    growth = {k: after[k] - before[k] for k in before}
    sizes = sorted(engine.stats.batch_sizes)
    summary = {
        "tokens": made,
        "tok_per_s": round((made - warm) / seconds),
        "batch_sizes_seen": f"{sizes[0]}..{sizes[-1]} ({len(sizes)} sizes)",
        "graph_steps": engine.stats.graph_steps,
        "eager_steps": engine.stats.eager_steps,
        "gpu_growth_bytes": growth["gpu_allocated"],
        "gpu_reserved_growth_bytes": growth["gpu_reserved"],
        "host_rss_growth_mib": round(growth["host_rss"] / 2**20, 2),
        "host_rss_mib_trace": trace,
        "last_requests_checked": len(schedule),
        "last_requests_differ": differ,
    }
    for name, mem in (("after warm-up", before), ("at the end", after)):
        print(
            f"{name:>13}: GPU allocated {mem['gpu_allocated'] / 2**20:9.2f} MiB, reserved "
            f"{mem['gpu_reserved'] / 2**20:9.2f} MiB, pool {mem['pool_bytes'] / 2**20:7.2f} MiB, "
            f"host RSS {mem['host_rss'] / 2**20:8.1f} MiB"
        )
    failures = []
    if growth["gpu_allocated"] >= GPU_GROWTH_LIMIT:  # reserved is reported: eager prefills of
        # new lengths may reserve allocator segments once, which is not a leak
        failures.append(f"GPU memory grew by {growth['gpu_allocated']} B allocated")
    if growth["host_rss"] >= HOST_GROWTH_LIMIT:
        failures.append(f"host RSS grew by {summary['host_rss_growth_mib']} MiB")
    if differ:
        failures.append(f"{differ} of the last {len(schedule)} requests differ from eager")
    summary["ok"] = not failures
    print(
        f"soak {args.model}: {made} tokens in {time.perf_counter() - t0:.0f} s "
        f"({summary['tok_per_s']} tok/s after warm-up); {json.dumps(summary)}"
    )
    print("OK" if not failures else "FAIL: " + "; ".join(failures))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "before": before, "after": after}, f, indent=1)
    return 0 if not failures else 1


if __name__ == "__main__":
    raise SystemExit(main())
