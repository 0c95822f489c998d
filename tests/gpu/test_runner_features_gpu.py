"""Runner features on a real GPU, each checked on logits and on the KV cache:

- ``reinstantiate()`` in exact mode: the fresh exec gets every edit pushed again;
- exact mode at batch sizes above 8 (buckets 16 and 32, padded and full);
- ``packed_inputs=False`` (one copy per field, no unpack inside the graph);
- a real CUDA capture failure (a host sync) becomes ``CaptureError``; nothing stays allocated,
  and the same runner captures again once the model is fixed;
- ``shutdown()`` frees the static buffers, the shared output and the pool's memory.

K/V of the step are compared with eager's (the new token's slots within bf16 noise, every other
slot bit for bit, scratch page 0 excepted: padded rows write there by design).

Nothing touches CUDA at import time: without a GPU the module imports and every test skips.
"""

from __future__ import annotations

import gc

import pytest
import torch

from stepgraph.bench.workload import fill_kv_random
from stepgraph.errors import CaptureError
from stepgraph.graph_pool import GraphPool
from stepgraph.model import ModelRunner
from stepgraph.runner import CudaGraphRunner, RunnerConfig
from stepgraph.toy_model import ToyModelRunner

DEV = "cuda"
MAX_CONTEXT = 4096
STEP_TOL = 0.1  # max |logit diff| (std ~1), graph vs eager: bf16 GEMMs of padded row counts
KV_TOL = dict(atol=0.05, rtol=0.05)  # the new token's bf16 K/V, graph vs eager


def _model(max_bs: int, seed: int = 5) -> ModelRunner:
    mr = ModelRunner.from_preset(
        "llama-3.2-1b",
        DEV,
        torch.bfloat16,
        seed=seed,
        num_layers=2,
        max_bs=max_bs,
        max_context_len=MAX_CONTEXT,
    )
    fill_kv_random(mr, seed=seed + 1)  # never zeros: every slot holds a distinct value
    return mr


def _caches(mr: ModelRunner) -> list[torch.Tensor]:
    return [*mr.kv_cache.k_caches, *mr.kv_cache.v_caches]


def _eager(mr: ModelRunner, batch) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Eager logits and the K/V they leave; the caches are restored afterwards."""
    before = [c.clone() for c in _caches(mr)]
    logits = mr.forward(batch).clone()
    after = [c.clone() for c in _caches(mr)]
    for c, c0 in zip(_caches(mr), before):
        c.copy_(c0)
    return logits, after


def _batch(mr: ModelRunner, lens: list[int], seed: int):
    """Requests of ``lens`` tokens (this step's included), fresh pages, random tokens."""
    g = torch.Generator().manual_seed(seed)
    pages = [mr.kv_cache.reserve(n) for n in lens]
    toks = torch.randint(1, mr.config.vocab_size, (len(lens),), generator=g).tolist()
    batch = mr.decode_batch(toks, [n - 1 for n in lens], pages)
    batch.max_seq_len = max(lens)
    return batch, pages


def _check_step(mr, batch, got, want, kv_want, what: str) -> None:
    diff = (got - want).abs().max().item()
    assert diff <= STEP_TOL, f"{what}: |logit diff| {diff:.3f}"
    new = torch.zeros(_caches(mr)[0].shape[:2], dtype=torch.bool, device=DEV).flatten()
    new[batch.out_cache_loc] = True
    new[: mr.kv_cache.page_size] = False  # scratch page 0: padded rows write there
    old = ~new
    old[: mr.kv_cache.page_size] = False
    for i, (have, ref) in enumerate(zip(_caches(mr), kv_want)):
        have, ref = have.flatten(0, 1), ref.flatten(0, 1)
        torch.testing.assert_close(have[new].float(), ref[new].float(), **KV_TOL, msg=what)
        assert torch.equal(have[old], ref[old]), f"{what}: cache {i} changed outside the step"


def test_reinstantiate_in_exact_mode_pushes_every_edit_again():
    mr = _model(max_bs=4)
    cfg = RunnerConfig(capture_bs=(1, 4), mode="exact", show_progress=False)
    runner = CudaGraphRunner(mr, cfg)
    # the ledger counts each bucket's plan of its attention nodes in its seconds
    ledger = runner.stats.capture
    assert all(0 < b.plan_seconds < b.seconds for b in ledger.buckets)
    assert ledger.phases()["plan"] == sum(b.plan_seconds for b in ledger.buckets)
    cases = [([700], 1), ([300, 2500, 90, 1200], 2), ([4096], 3)]  # below the buckets' splits
    try:
        for lens, seed in cases:
            batch, pages = _batch(mr, lens, seed)
            want, kv_want = _eager(mr, batch)
            first = runner.replay(batch).clone()
            _check_step(mr, batch, first, want, kv_want, f"exact {lens}")
            if len(lens) == 1:  # bs == bucket == 1: the same split count as eager, bit for bit
                assert torch.equal(first, want)
            edits = runner.stats.node_edits
            runner.reinstantiate()  # a fresh exec holds the captured split counts again
            again = runner.replay(batch).clone()
            # the plans were invalidated, so every node was pushed again: the same geometry,
            # hence the same bits, as before re-instantiation (a stale plan would skip the
            # push and replay the captured split count)
            assert runner.stats.node_edits > edits
            assert torch.equal(again, first), f"{lens}: replay after reinstantiate differs"
            _check_step(mr, batch, again, want, kv_want, f"exact {lens} reinstantiated")
            for p in pages:
                mr.kv_cache.release(p)
    finally:
        runner.shutdown()


@pytest.mark.parametrize("packed_inputs", [True, False])
def test_exact_mode_above_eight_requests(packed_inputs):
    mr = _model(max_bs=32)
    cfg = RunnerConfig(
        capture_bs=(1, 8, 16, 32), mode="exact", show_progress=False, packed_inputs=packed_inputs
    )
    runner = CudaGraphRunner(mr, cfg)
    g = torch.Generator().manual_seed(11)
    try:
        for bs, top in [(12, 600), (16, 3000), (9, 4096), (24, 200), (32, 1500), (17, 64)]:
            lens = torch.randint(1, top + 1, (bs,), generator=g).tolist()
            lens[0] = top  # the longest request sets the split count
            batch, pages = _batch(mr, lens, seed=bs * top)
            want, kv_want = _eager(mr, batch)
            got = runner.replay(batch)
            _check_step(mr, batch, got, want, kv_want, f"exact bs={bs} t_kv={top}")
            for p in pages:
                mr.kv_cache.release(p)
        assert runner.stats.node_edits > 0
    finally:
        runner.shutdown()


def test_unpacked_inputs_replay_equals_eager_at_every_bucket():
    mr = _model(max_bs=16)
    cfg = RunnerConfig(max_bs=16, show_progress=False, packed_inputs=False)
    runner = CudaGraphRunner(mr, cfg)
    g = torch.Generator().manual_seed(12)
    try:
        for bs in [1, 2, 3, 4, 7, 8, 16, 9, 5, 1]:  # up and down across every bucket
            lens = torch.randint(1, 1025, (bs,), generator=g).tolist()
            batch, pages = _batch(mr, lens, seed=100 + bs)
            assert batch.input_ids.is_contiguous() and batch.block_table.is_contiguous()
            want, kv_want = _eager(mr, batch)
            runner.output_buffers[16].fill_(float("nan"))
            got = runner.replay(batch)
            _check_step(mr, batch, got, want, kv_want, f"unpacked bs={bs}")
            for p in pages:
                mr.kv_cache.release(p)
        assert runner.stats.packed_here == 0
    finally:
        runner.shutdown()


def _toy(**kw) -> ToyModelRunner:
    return ToyModelRunner(
        hidden=64,
        num_layers=3,
        num_pages=400,
        page_size=16,
        max_pages_per_request=8,
        device=DEV,
        seed=kw.pop("seed", 17),
        **kw,
    )


def _pool_segment_bytes(pool: GraphPool) -> int:
    """Bytes of the allocator's segments that belong to ``pool`` (its own count)."""
    if pool.handle is None:
        return 0
    return sum(
        seg["total_size"]
        for seg in torch.cuda.memory_snapshot()
        if tuple(seg.get("segment_pool_id", ())) == tuple(pool.handle)
    )


def _settle() -> int:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated()


def _toy_step(mr, runner, bs: int, seed: int) -> None:
    batch = mr.random_batch(bs, torch.Generator().manual_seed(seed))
    want, want_state = mr.eager_reference(batch)
    got = runner.replay(batch)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for have, ref in zip(mr.kv, want_state):  # padded rows wrote only into scratch page 0
        torch.testing.assert_close(have[mr.page_size :], ref[mr.page_size :])


def test_shutdown_frees_static_buffers_output_and_pool():
    mr = _toy()
    pool = GraphPool()
    cfg = RunnerConfig(max_bs=32, show_progress=False)
    warm = CudaGraphRunner(mr, cfg, pool=pool)  # first use of both streams: library workspaces
    _toy_step(mr, warm, 7, seed=9)
    warm.shutdown()
    mr.attn_backend.seq_lens = mr.attn_backend.block_table = None
    del warm
    base = _settle()
    runner = CudaGraphRunner(mr, cfg, pool=pool)
    _toy_step(mr, runner, 19, seed=1)
    held = _pool_segment_bytes(pool)
    live = torch.cuda.memory_allocated() - base
    assert held > 0 and live > 0
    runner.shutdown()
    mr.attn_backend.seq_lens = mr.attn_backend.block_table = None  # the model's own references
    after = _settle()
    print(f"runner held {live} B allocated and a {held} B pool; {after - base} B after shutdown")
    assert after == base, f"{after - base} B still allocated after shutdown()"
    assert _pool_segment_bytes(pool) == 0
    # the pool is reusable: a new runner captures into it and replays correctly
    again = CudaGraphRunner(mr, cfg, pool=pool)
    _toy_step(mr, again, 5, seed=2)
    again.shutdown()


def test_a_real_capture_failure_is_a_capture_error_and_recapture_works():
    mr = _toy(seed=23)
    pool = GraphPool()
    cfg = RunnerConfig(max_bs=8, show_progress=False)
    warm = CudaGraphRunner(mr, cfg, pool=pool)  # first use of the stream: library workspaces
    warm.shutdown()
    del warm
    runner = CudaGraphRunner(mr, cfg, pool=pool, capture=False)
    mr.attn_backend.seq_lens = mr.attn_backend.block_table = None
    base = _settle()
    mr.sync_in_forward = True  # int(seq_lens.max()) inside the forward: a device->host sync
    with pytest.raises(CaptureError, match=r"(?s)batch size 8\b.*eagerly") as info:
        runner.capture()
    cause = repr(info.value.__cause__) + repr(info.value.__context__)
    print(f"capture failed as expected: {info.value}\ncause: {cause}")
    assert runner.graphs == {} and runner.output_buffers == {} and runner.capture_order == []
    del info
    mr.attn_backend.seq_lens = mr.attn_backend.block_table = None
    after = _settle()
    print(f"pool segments after the failure: {_pool_segment_bytes(pool)} B")
    assert after == base, f"{after - base} B still allocated after the failed capture"
    mr.sync_in_forward = False  # fixed: the same runner captures and replays
    runner.capture()
    assert runner.capture_order == [8, 4, 2, 1]
    for bs, seed in [(3, 4), (8, 5), (1, 6), (6, 7)]:
        _toy_step(mr, runner, bs, seed)
    runner.shutdown()
