"""An eager decode step runs its GEMMs at the rows of the graph bucket it would replay in.

cuBLAS picks a GEMM's kernel, and with it the reduction order of every row, by the row count
(it did on an H100 for Qwen2.5-0.5B's shapes: 33 rows eager against the graph of 48 differed).
So the reference path pads the row-wise parts of the step (embedding, norms, projections, the
head) to ``kernel_class(bs)`` rows and runs the attention on the live rows, and the fused
step runs its cuBLAS pieces (qkv and the LM head where ``prefer_cublas``) the same way: exact
mode then replays what eager ran. Here every matrix multiply of a step is recorded with its
row count, on the CPU."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from stepgraph.bench.workload import Point, build_model_runner, decode_batch, fill_kv_random
from stepgraph.kernels.proj.proj_tiles import block_m
from stepgraph.model.decode import fused_decode, step_plan
from stepgraph.model.llama import at_rows, pad_rows
from stepgraph.runner import CudaGraphRunner, RunnerConfig

GEMMS = {"aten::mm", "aten::addmm", "aten::linear", "aten::matmul", "aten::bmm"}


class GemmRows(TorchDispatchMode):
    """The rows of every matrix multiply by one of ``model``'s weights dispatched inside (the
    projections and the head; not the CPU attention's own products)."""

    def __init__(self, model) -> None:
        super().__init__()
        self.weights = {p.data_ptr() for p in model.parameters() if p.dim() == 2}
        self.rows: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name in GEMMS:
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            if any(t.data_ptr() in self.weights for t in tensors):
                x = args[1] if name == "aten::addmm" else args[0]
                self.rows.append(x.shape[0])
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def mr():
    runner = build_model_runner("tiny", "cpu", torch.float32, max_bs=32, max_context=64)
    fill_kv_random(runner)
    return runner


def eager(mr, bs: int, seed: int):
    batch, pages = decode_batch(mr, Point(bs, 20), seed=seed)
    try:
        with GemmRows(mr.model) as spy:
            logits = mr.forward(batch).clone()
    finally:
        for p in pages:
            mr.kv_cache.release(p)
    return logits, spy.rows


def test_pad_rows_and_at_rows():
    x = torch.randn(3, 5)
    assert pad_rows(x, 3) is x and pad_rows(x, 2) is x
    p = pad_rows(x, 8)
    assert p.shape == (8, 5) and torch.equal(p[:3], x) and not p[3:].any()
    ids = pad_rows(torch.tensor([7, 8]), 4)
    assert ids.tolist() == [7, 8, 0, 0] and ids.dtype == torch.int64
    seen = []
    out = at_rows(lambda t: (seen.append(t.shape[0]), t * 2)[1], x, 8)
    assert seen == [8] and out.shape == (3, 5) and torch.equal(out, x * 2)
    assert at_rows(lambda t: (seen.append(t.shape[0]), t)[1], x, 3) is x and seen[-1] == 3


@pytest.mark.parametrize("bs", [1, 2, 3, 5, 7, 8, 9, 17, 31, 32])
def test_every_gemm_of_an_eager_reference_step_runs_at_its_bucket(mr, bs):
    """Live sizes between buckets (3 in 4, 5 and 7 in 8, 9 in 16, 17 and 31 in 32) and at
    them; the logits are the live rows', equal to the same step's at its bucket's rows."""
    bucket = fused_decode.kernel_class(bs, mr.attn_backend)
    logits, rows = eager(mr, bs, seed=bs)
    assert logits.shape == (bs, mr.config.vocab_size)
    # qkv, o, gate-up, down per layer, then the head; every one at the bucket's rows
    assert len(rows) == 4 * mr.config.num_layers + 1 and set(rows) == {bucket}, (bs, rows)


@pytest.mark.parametrize("bs", [3, 9])
def test_an_eager_step_between_buckets_pads_its_rows_once(mr, monkeypatch, bs):
    """The model pads the ids and positions to the bucket and keeps the padding rows to the
    head, so nothing past the attention pads again: ``pad_rows`` sees the ids, the positions
    and each layer's attention output (the attention runs on the live rows), never the final
    hidden state; the logits are those of a full bucket's live rows."""
    from stepgraph.model import llama

    padded = []
    real = llama.pad_rows
    monkeypatch.setattr(llama, "pad_rows", lambda x, r: padded.append(x.dim()) or real(x, r))
    logits, rows = eager(mr, bs, seed=bs)
    assert padded == [1, 1] + [2] * mr.config.num_layers  # ids, positions; each attention
    assert logits.shape == (bs, mr.config.vocab_size) and set(rows) == {
        fused_decode.kernel_class(bs, mr.attn_backend)
    }
    monkeypatch.setattr(llama, "pad_rows", real)
    bucket = fused_decode.kernel_class(bs, mr.attn_backend)
    full, _ = eager(mr, bucket, seed=bs)  # the same seed: its first bs rows are this batch's
    assert torch.equal(full[:bs], logits)


def test_padding_rows_write_no_kv(mr):
    """A batch of 5 padded to 8: the K/V cache changes at the 5 live rows' slots and nowhere
    else (the padding rows never reach the attention, scratch page 0 included)."""
    caches = (*mr.kv_cache.k_caches, *mr.kv_cache.v_caches)
    batch, pages = decode_batch(mr, Point(5, 20), seed=11)
    try:
        before = [t.clone() for t in caches]
        mr.forward(batch)
        live = set(batch.out_cache_loc.tolist())
        for a, b in zip(caches, before):
            slots = a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:])
            changed = (slots[0] != slots[1]).flatten(1).any(1).nonzero().flatten().tolist()
            assert changed and set(changed) <= live, (changed, live)
    finally:
        for p in pages:
            mr.kv_cache.release(p)


def test_eager_equals_the_graph_of_its_bucket_on_the_stand_in(mr):
    runner = CudaGraphRunner(mr, RunnerConfig(max_bs=32, show_progress=False))
    try:
        for bs in (3, 5, 9, 17):
            batch, pages = decode_batch(mr, Point(bs, 20), seed=100 + bs)
            try:
                kv = [t.clone() for t in (*mr.kv_cache.k_caches, *mr.kv_cache.v_caches)]
                want = mr.forward(batch).clone()
                for dst, src in zip((*mr.kv_cache.k_caches, *mr.kv_cache.v_caches), kv):
                    dst.copy_(src)
                with GemmRows(mr.model) as spy:
                    got = runner.replay(batch)
                assert torch.equal(got, want), bs
                assert set(spy.rows) == {fused_decode.kernel_class(bs, mr.attn_backend)}
            finally:
                for p in pages:
                    mr.kv_cache.release(p)
    finally:
        runner.shutdown()


def test_the_fused_steps_cublas_pieces_run_at_the_bucket(mr, monkeypatch):
    """qkv and the LM head on cuBLAS at bucket 32 (this test's table, both with the norm
    handoff and without): their GEMMs at 32 rows for 17 live ones; the logits equal the
    same rows inside a full batch of 32."""
    shapes = {
        n: tuple(w.shape)
        for n, w in (
            ("qkv", mr.model.layers[0].self_attn.qkv_proj.weight),
            ("lm_head", mr.model.lm_head.weight),
        )
    }
    cublas = {("qkv_rope", *shapes["qkv"], 32), ("lm_head", *shapes["lm_head"], 32)}
    monkeypatch.setattr(
        step_plan,
        "prefer_cublas",
        lambda kernel, m, n, k, e=2, tables=None: (kernel, n, k, block_m(m)) in cublas,
    )
    monkeypatch.setattr(step_plan, "measured", lambda *a: True)
    for bs in (17, 32):
        batch, pages = decode_batch(mr, Point(bs, 20), seed=bs)
        try:
            mr.attn_backend.init_forward_metadata(batch)
            with GemmRows(mr.model) as spy:
                logits = fused_decode.fused_decode_step(
                    mr.model, mr.attn_backend, batch.input_ids, batch.positions
                )
        finally:
            for p in pages:
                mr.kv_cache.release(p)
        assert logits.shape == (bs, mr.config.vocab_size)
        # qkv from cuBLAS in every layer and the head: all at 32 rows
        assert len(spy.rows) == mr.config.num_layers + 1 and set(spy.rows) == {32}, spy.rows
