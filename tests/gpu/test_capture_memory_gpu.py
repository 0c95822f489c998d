"""Decode capture memory on the GPU: logits go straight into the shared output, the ledger
adds up to the allocator's own count of the pool, and replay equals eager at every bucket
(with and without pinned staging)."""

from __future__ import annotations

import pytest
import torch

from stepgraph.graph_pool import GraphPool
from stepgraph.model.model_runner import ModelRunner
from stepgraph.runner import CudaGraphRunner, RunnerConfig

MAX_BS, CONTEXT, STEP_TOL = 64, 256, 0.1


@pytest.fixture(scope="module")
def mr():
    return ModelRunner.from_preset(
        "llama-3.2-1b",
        "cuda",
        torch.bfloat16,
        seed=3,
        num_layers=2,
        max_bs=MAX_BS,
        max_context_len=CONTEXT,
    )


@pytest.mark.parametrize("staged", [False, True])
def test_replay_equals_eager_at_every_bucket(mr, staged):
    cfg = RunnerConfig(max_bs=MAX_BS, show_progress=False, pinned_staging=staged)
    runner = CudaGraphRunner(mr, cfg, pool=GraphPool())  # a fresh pool: the ledger is all of it
    cap = runner.stats.capture
    assert cap.pool_held_bytes is not None
    assert abs(cap.pool_bytes - cap.pool_held_bytes) <= 2 * 2**20, cap.ledger_table()
    shared = runner.output_buffers[MAX_BS]
    g = torch.Generator().manual_seed(5)
    for bs in runner.capture_bs:
        for n in {bs, max(1, bs - 1)}:  # full bucket and one padded row
            toks = torch.randint(1, mr.config.vocab_size, (n,), generator=g).tolist()
            pos = torch.randint(0, CONTEXT - 1, (n,), generator=g).tolist()
            pages = [mr.kv_cache.reserve(CONTEXT) for _ in range(n)]
            batch = mr.decode_batch(toks, pos, pages)
            ref = mr.forward(batch).clone()  # eager; the replay then writes the same K/V
            got = runner.replay(batch)
            assert got.data_ptr() == shared.data_ptr() and got.dtype == torch.float32
            diff = (got - ref).abs().max().item()
            assert diff <= STEP_TOL, f"bs {n} (bucket {bs}) staged={staged}: |diff| {diff:.3f}"
            for p in pages:
                mr.kv_cache.release(p)
    print(f"staged={staged}\n{cap.ledger_table()}\npool held {cap.pool_held_bytes / 2**20:.1f}")
    runner.shutdown()


@pytest.mark.cuda
def test_fp8_weights_hold_at_most_one_chunk_of_pool_over_bf16s_over_the_default_buckets():
    """The 36 default buckets to bs 512 of the 1B in graph mode: FP8 projections past 64 rows
    dequantize a chunk of weight at a time (``fp8_dequant.dequant_linear``), so FP8's pool is
    at most one chunk over bf16's (a whole dequantized gate-up weight, 64 MiB, held 58 more).
    And neither pool holds bucket 512's head output in bf16 (125 MiB, which was most of the
    pool): cuBLAS writes the float32 logits into the shared output itself."""
    from stepgraph.bench.workload import build_model_runner
    from stepgraph.kernels.proj.fp8_dequant import CHUNK_BYTES

    pools = {}
    for quant in (None, "fp8"):
        model = build_model_runner(
            "llama-3.2-1b", "cuda", torch.bfloat16, 512, 2048, quantization=quant
        )
        runner = CudaGraphRunner(
            model, RunnerConfig(max_bs=512, mode="graph", show_progress=False), pool=GraphPool()
        )
        assert len(runner.capture_bs) == 36
        pools[quant] = runner.stats.capture.pool_bytes
        vocab = model.config.vocab_size
        runner.shutdown()
        del model, runner
        torch.cuda.empty_cache()
    print({q: f"{b / 2**20:.1f} MiB" for q, b in pools.items()})
    assert pools["fp8"] <= pools[None] + CHUNK_BYTES, pools
    assert pools[None] < 512 * vocab * 2, pools
