"""One rank of the tensor-parallel greedy check; launched by ``test_parallel_gpu.py``:

    PYTHONPATH=. torchrun --standalone --nproc-per-node 2 tests/gpu/tp_worker.py --out DIR

Every rank builds the same random model (fixed seed), decodes greedily unsharded (TP=1), then
sharded over all ranks in each mode (eager, and graph / exact through ``CudaGraphRunner``), and
writes ``DIR/rank<r>.json``: the tokens of each mode, the graph runners' capture order, or the
error of a mode that raised. ``--device cpu`` (gloo, the CPU graph stand-in, no exact mode) is a
smoke run of this script on a machine without GPUs. ``launch`` runs it from a test.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import traceback
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from stepgraph.engine import Engine
from stepgraph.model.config import get_preset
from stepgraph.model.distributed import init_distributed
from stepgraph.model.llama import build_model, init_random
from stepgraph.model.model_runner import ModelRunner
from stepgraph.model.parallel import shard_model
from stepgraph.runner import RunnerConfig

REPO = Path(__file__).resolve().parents[2]

MAX_BS = 4
MAX_CTX = 256
PROMPT_LENS = (7, 19, 3)  # 3 requests: bucket 4 is replayed with a padding row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--kv-heads", type=int, default=None, help="override num_kv_heads")
    args = ap.parse_args()

    env = init_distributed("nccl" if args.device == "cuda" else "gloo")
    device, dtype = env.device, torch.float32
    warm = torch.ones(1, device=device)
    dist.all_reduce(warm)  # creates the communicator before anything is captured
    config = get_preset(args.preset)
    if args.kv_heads is not None:
        config = replace(config, num_kv_heads=args.kv_heads)
    full = init_random(build_model(config, device, dtype, max_positions=MAX_CTX), seed=7)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(config.vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENS]

    def runner(model) -> ModelRunner:
        return ModelRunner.from_model(
            model, device=device, dtype=dtype, max_bs=MAX_BS, max_context_len=MAX_CTX
        )

    result: dict[str, object] = {"capture_order": {}, "errors": {}}
    ref = Engine(runner(full), mode="eager")
    result["tp1"] = ref.generate(prompts, args.tokens)
    tp_model = shard_model(full, env.rank, env.world_size)
    modes = ("eager", "graph", "exact") if args.device == "cuda" else ("eager", "graph")
    cfg = RunnerConfig(max_bs=MAX_BS, show_progress=False)  # Engine sets its mode
    for mode in modes:
        try:
            engine = Engine(runner(tp_model), mode=mode, runner_config=cfg)
            result[mode] = engine.generate(prompts, args.tokens)
            if engine.runner is not None:
                result["capture_order"][mode] = list(engine.runner.capture_order)
                result[f"{mode}_graph_steps"] = engine.stats.graph_steps
            engine.shutdown()
        except Exception as e:  # recorded, so that the other modes still report
            traceback.print_exc()
            result["errors"][mode] = f"{type(e).__name__}: {e}"
    Path(args.out, f"rank{env.rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # gloo's threads can abort at interpreter exit (stepgraph.model.launch)


def launch(out: Path, *args: str, nproc: int = 2, timeout_s: float = 300.0) -> list[dict]:
    """Run this script under ``torchrun --standalone --nproc-per-node nproc``; the ranks'
    results. ``AssertionError`` with the log tail if it fails or outlives ``timeout_s`` (then
    torchrun and its ranks, a process group of their own, are killed)."""
    env = dict(os.environ)  # NCCL_* settings (NCCL_NVLS_ENABLE=0) pass through untouched
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc-per-node={nproc}", __file__, "--out", str(out), *args]
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        log, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        raise AssertionError(
            f"torchrun outlived {timeout_s} s (a rank hung):\n{log[-6000:]}"
        ) from None
    if proc.returncode:
        raise AssertionError(f"torchrun exited {proc.returncode}:\n{log[-6000:]}")
    return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(nproc)]


if __name__ == "__main__":
    main()
