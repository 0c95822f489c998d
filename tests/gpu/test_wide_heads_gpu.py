"""Heads wider than 64 take the wide ladder (``splits.WIDE_MIN_SPLIT_KEYS``) in eager decode, and
exact mode retunes its graphs with the same ladder (``attn_backend.split_keys``, handed to the
runner's updater): the logits and greedy token of the fused step at one row, 2 layers of the
llama-3.1-8b shape (head_dim 128), bf16, random weights, bit for bit at each step of the ladder,
at it and one past it. Where the two ladders part (128-255 keys: 2 splits against 1), an
updater on the head_dim-64 ladder would replay another split count than eager's.

Nothing touches CUDA at import time: without a GPU the module imports and every test skips.
"""

from __future__ import annotations

import pytest
import torch

from stepgraph.bench.workload import Point, decode_batch, fill_kv_random
from stepgraph.kernels.decode import splits
from stepgraph.model import ModelRunner
from stepgraph.runner import CudaGraphRunner, RunnerConfig

DEV = "cuda"
MAX_CONTEXT = 1024


@pytest.fixture(scope="module")
def mr():
    runner = ModelRunner.from_preset(
        "llama-3.1-8b",
        DEV,
        torch.bfloat16,
        seed=5,
        num_layers=2,
        max_bs=1,
        max_context_len=MAX_CONTEXT,
        page_size=64,
    )
    fill_kv_random(runner)
    return runner


def test_the_backend_takes_the_wide_ladder(mr):
    backend = mr.attn_backend
    assert backend.head_dim == 128
    assert backend.split_keys is splits.ladder_for(128) is not splits.fa_split_keys
    assert backend.splits_for(127, 1) == 1 and backend.splits_for(128, 1) == 2
    # then one split a 64-key tile: 3 from 129, 4 from 193, 5 from 257
    assert [backend.splits_for(t, 1) for t in (129, 192, 193, 256, 257)] == [3, 3, 4, 4, 5]
    narrow = splits.num_splits_for(200, backend.num_kv_heads, 1, backend.num_sms, 64)
    assert narrow == 1  # the head_dim-64 ladder would take one split there


def test_exact_equals_eager_at_every_step_of_the_wide_ladder(mr):
    runner = CudaGraphRunner(mr, RunnerConfig(max_bs=1, mode="exact", show_progress=False))
    caches = (*mr.kv_cache.k_caches, *mr.kv_cache.v_caches)
    before = [c.clone() for c in caches]
    try:
        seen = set()
        contexts = (1, 127, 128, 129, 200, 255, 256, 257, 511, 512, 1000)
        cap = splits.ladder_cap(mr.attn_backend.num_kv_heads, 1, mr.attn_backend.num_sms)
        # by hand: one split below 2 x 64 keys, then ceil(t / 64) up to the cap
        want = {1 if t < 128 else min(cap, -(-t // 64)) for t in contexts}
        for context in contexts:
            batch, pages = decode_batch(mr, Point(1, context), seed=context)
            try:
                eager = mr.forward(batch).clone()
                token = mr.fused_tokens(1).clone()
                mr.greedy_tokens.fill_(-1)
                replayed = runner.replay(batch)
                assert torch.equal(replayed, eager), context
                assert torch.equal(mr.fused_tokens(1), token), context
                seen.add(mr.attn_backend.splits_for(context, 1))
            finally:
                for p in pages:
                    mr.kv_cache.release(p)
                for c, c0 in zip(caches, before):
                    c.copy_(c0)
        assert seen == want and len(want) >= 7, seen
    finally:
        runner.shutdown()
