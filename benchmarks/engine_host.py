"""Host time of the engine's step alone: the real ``Engine`` loop over a stand-in step of (near)
zero GPU time, in µs a step by phase (``stepgraph.engine.phase_timer.PHASES``).

    python benchmarks/engine_host.py --json out/engine_host.json            # CUDA if present
    python benchmarks/engine_host.py --device cpu --batch-sizes 1,8 --steps 20

The stand-in is the tiny preset's ``ModelRunner`` whose decode forward writes nothing and
whose prefill returns preallocated logits: a captured decode graph then holds only the
runner's input launch (``runner/graph_inputs.py``), so events, pinned copies, the feed and
the staging are real on CUDA while the GPU has next to nothing to do. Each batch size runs
``bs`` requests that all decode; the phases are timed over ``--steps`` steps once every request
decodes. ``wall_us`` is the step's whole host time measured around ``Engine.step``; the
phases add up to it minus the timer's own few marks.

Targets (the issue): host time a step <= 200 µs at bs 1 and <= 350 µs at bs 64.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from stepgraph.engine import Engine
from stepgraph.engine.phase_timer import PHASES, PhaseTimer
from stepgraph.model import ModelRunner
from stepgraph.runner import RunnerConfig

PROMPT_LEN = 8
WARM_STEPS = 3  # steps before timing: prefill, the first decode, the feed in flight


def stand_in_runner(device: str, max_bs: int, context: int) -> ModelRunner:
    """The tiny preset, one layer, with a decode forward and a prefill of zero GPU work."""
    mr = ModelRunner.from_preset(
        "tiny",
        device,
        torch.float32,
        seed=0,
        num_layers=1,
        max_bs=max_bs,
        max_context_len=context,
        num_pages=max_bs * (-(-context // 16)) + 1,
    )
    vocab = mr.config.vocab_size
    logits = torch.zeros(max(max_bs, 1), vocab, dtype=torch.float32, device=mr.device)

    def forward(batch, *, out: torch.Tensor | None = None) -> torch.Tensor:
        return out if out is not None else logits[: batch.input_ids.shape[0]]

    def extend(chunks) -> torch.Tensor:
        return logits[: len(chunks)]

    mr.forward = forward  # the graph runner captures this: no kernel of the model
    mr.extend = extend  # the engine's eager prefiller is the model runner itself
    return mr


def measure(engine: Engine, bs: int, steps: int) -> dict[str, float]:
    """``bs`` requests decoding together: µs a step by phase, and the wall time a step."""
    budget = WARM_STEPS + steps + 4
    for i in range(bs):
        engine.add_request([1 + (i + k) % 100 for k in range(PROMPT_LEN)], budget, ignore_eos=True)
    for _ in range(WARM_STEPS):
        engine.step()
    timer = PhaseTimer()
    engine.timer = timer
    wall = []
    for _ in range(steps):
        t0 = time.perf_counter_ns()
        engine.step()
        wall.append(time.perf_counter_ns() - t0)
    engine.timer = None
    decoding = engine.stats.batch_sizes
    engine.abort_all()
    row = {p: round(v, 2) for p, v in timer.per_step_us().items()}
    row["wall_us"] = round(statistics.median(wall) / 1e3, 2)
    row["wall_us_mean"] = round(statistics.fmean(wall) / 1e3, 2)
    row["decode_rows_seen"] = max(decoding) if decoding else 0
    return row


def run(device: str, batch_sizes: list[int], steps: int, mode: str) -> dict:
    max_bs = max(batch_sizes)
    context = PROMPT_LEN + WARM_STEPS + steps + 8
    mr = stand_in_runner(device, max_bs, context)
    # pinned staging on the CPU stand-in too: the engine's host path is then CUDA's (host rows
    # only, the graph fetches them), not the unstaged one the stand-in has by default
    config = None
    if mode != "eager":
        config = RunnerConfig(max_bs=max_bs, show_progress=False, pinned_staging=True)
    engine = Engine(mr, mode, config)
    out = {"device": str(mr.device), "mode": mode, "steps": steps, "phases": list(PHASES)}
    out["bs"] = {str(bs): measure(engine, bs, steps) for bs in batch_sizes}
    engine.shutdown()
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch-sizes", default="1,8,32,64")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--mode", default="graph", choices=("graph", "eager"))
    ap.add_argument("--json", default=None, help="write the result here")
    args = ap.parse_args(argv)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    result = run(args.device, sizes, args.steps, args.mode)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))
    head = "".join(f"{p[:11]:>12}" for p in PHASES)
    print(f"\nhost µs a step ({result['device']}, {args.mode}, stand-in step)")
    print(f"{'bs':>4}{head}{'total':>9}{'wall':>9}")
    for bs, r in result["bs"].items():
        cells = "".join(f"{r[p]:>12.1f}" for p in PHASES)
        print(f"{bs:>4}{cells}{r['total']:>9.1f}{r['wall_us']:>9.1f}")
    return result


if __name__ == "__main__":
    main()
