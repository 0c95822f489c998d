"""The decode runner at its edges, on the CPU stand-in, each checked on outputs and KV:

- an attention backend whose replay hook writes device metadata the forward reads (so a
  skipped or misplaced hook gives wrong logits), and the hook's arguments;
- an over-wide block table, refused before any copy;
- the max-context boundary, exactly at the limit and one past it;
- the bucket each batch size replays, read from the output itself (a hand-written table).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from stepgraph.batch import pack_batch
from stepgraph.errors import ReplayError
from stepgraph.runner import CudaGraphRunner, RunnerConfig
from stepgraph.toy_model import ToyAttentionBackend, ToyModelRunner

CFG = RunnerConfig(max_bs=16, show_progress=False, warmup_iters=1)
# Hand-written: the bucket the default ladder [1, 2, 4, 8, 16] gives each batch size.
BUCKET_OF = {1: 1, 2: 2, 3: 4, 4: 4, **{b: 8 for b in range(5, 9)}, **{b: 16 for b in range(9, 17)}}


class HookBackend(ToyAttentionBackend):
    """Like sglang's backends: in graph mode the forward reads metadata the backend owns and only
    its replay hook refreshes (``lens`` here, a device copy of the lengths). Eager batches get
    their own metadata. Every hook call is logged with what it was handed.

    With packed inputs the graph itself unpacks the live rows into the static buffers, after the
    hook ran, so a hook that reads live values needs ``packed_inputs=False``; these tests use
    that (the packed runner is checked on the hook's arguments below)."""

    def __init__(self) -> None:
        super().__init__()
        self.lens: torch.Tensor | None = None  # [max_bs] int32: the graphs' metadata
        self.static_ptr: int | None = None
        self.graph_meta: tuple[torch.Tensor, torch.Tensor] | None = None  # set by hooks only
        self.replays: list[tuple[int, int, int, list[int], torch.Tensor]] = []

    def init_cuda_graph_state(self, max_bs: int) -> None:
        super().init_cuda_graph_state(max_bs)
        self.lens = torch.full((max_bs,), -7, dtype=torch.int32)  # poison until a hook writes

    def _point(self, bs: int, batch) -> None:
        self.static_ptr = batch.seq_lens.data_ptr()
        self.lens[:bs].copy_(batch.seq_lens)
        self.graph_meta = (self.lens[:bs], batch.block_table)
        self.seq_lens, self.block_table = self.graph_meta  # what a captured forward reads

    def init_forward_metadata_capture_cuda_graph(self, bs: int, batch) -> None:
        self.calls.append(("capture", bs))
        self._point(bs, batch)

    def init_forward_metadata_replay_cuda_graph(self, bs: int, batch) -> None:
        self.replays.append(
            (
                bs,
                batch.seq_lens.data_ptr(),
                batch.block_table.data_ptr(),
                list(batch.block_table.shape),
                batch.seq_lens.clone(),  # what the static buffers hold when the hook runs
            )
        )
        self._point(bs, batch)

    def init_forward_metadata(self, batch) -> None:
        if batch.seq_lens.data_ptr() == self.static_ptr:
            # a graph's static batch: the metadata the last hook prepared (graph semantics)
            self.seq_lens, self.block_table = self.graph_meta
        else:
            super().init_forward_metadata(batch)


def hook_model(seed: int) -> ToyModelRunner:
    mr = ToyModelRunner(num_pages=160, seed=seed)
    mr.attn_backend = HookBackend()
    return mr


def test_replay_hook_writes_the_metadata_the_forward_reads():
    mr = hook_model(seed=31)
    runner = CudaGraphRunner(mr, replace(CFG, packed_inputs=False))
    g = torch.Generator().manual_seed(32)
    for bs in [1, 1, 3, 3, 9, 1, 16, 5, 2, 8, 4, 12]:  # starts in the last captured bucket
        batch = mr.random_batch(bs, g)
        want, want_state = mr.eager_reference(batch)
        got = runner.replay(batch)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"bs={bs}")
        for have, ref in zip(mr.kv, want_state):
            torch.testing.assert_close(have[mr.page_size :], ref[mr.page_size :])


@pytest.mark.parametrize("packed_inputs", [True, False])
def test_replay_hook_gets_the_bucket_and_its_static_view(packed_inputs):
    mr = hook_model(seed=33)
    runner = CudaGraphRunner(mr, replace(CFG, packed_inputs=packed_inputs))
    g = torch.Generator().manual_seed(34)
    base_lens = runner.buffers.seq_lens.data_ptr()
    base_table = runner.buffers.block_table.data_ptr()
    width = runner.buffers.block_table.shape[1]
    sizes = [1, 2, 3, 4, 5, 8, 9, 16, 7, 2]
    for i, bs in enumerate(sizes):
        batch = mr.random_batch(bs, g)
        runner.replay(batch)
        assert len(mr.attn_backend.replays) == i + 1, "one replay hook call per replay"
        bucket, lens_ptr, table_ptr, shape, lens = mr.attn_backend.replays[-1]
        assert bucket == BUCKET_OF[bs]
        assert (lens_ptr, table_ptr, shape) == (base_lens, base_table, [bucket, width])
        if packed_inputs:
            continue  # the graph unpacks the live rows after the hook
        # the live rows were copied before the hook ran; padded rows hold the fill value (1)
        assert lens[:bs].tolist() == batch.seq_lens.tolist()
        assert lens[bs:].tolist() == [1] * (bucket - bs)


def _batch_with_lengths(mr: ToyModelRunner, lens: list[int], g: torch.Generator):
    batch = mr.random_batch(len(lens), g)
    t = torch.tensor(lens, dtype=torch.int32)
    batch.seq_lens, batch.seq_lens_cpu, batch.positions = t, t.clone(), t.long() - 1
    last = batch.positions
    page = batch.block_table.long().gather(1, (last // mr.page_size)[:, None])[:, 0]
    batch.out_cache_loc = page * mr.page_size + last % mr.page_size
    return batch


@pytest.mark.parametrize("packed_inputs", [True, False])
@pytest.mark.parametrize("hint", [True, False])
def test_a_request_exactly_at_the_max_context_replays(packed_inputs, hint):
    mr = ToyModelRunner(num_pages=160, seed=35)
    runner = CudaGraphRunner(mr, replace(CFG, packed_inputs=packed_inputs))
    limit = mr.max_context_len
    batch = _batch_with_lengths(mr, [5, limit, 17], torch.Generator().manual_seed(36))
    batch.max_seq_len = limit if hint else None
    want, want_state = mr.eager_reference(batch)
    torch.testing.assert_close(runner.replay(batch), want, rtol=1e-5, atol=1e-5)
    for have, ref in zip(mr.kv, want_state):
        torch.testing.assert_close(have[mr.page_size :], ref[mr.page_size :])


@pytest.mark.parametrize("packed_inputs", [True, False])
@pytest.mark.parametrize("hint", [True, False])
def test_a_request_one_past_the_max_context_is_refused_before_any_copy(packed_inputs, hint):
    mr = ToyModelRunner(num_pages=160, seed=37)
    runner = CudaGraphRunner(mr, replace(CFG, packed_inputs=packed_inputs))
    limit = mr.max_context_len
    g = torch.Generator().manual_seed(38)
    batch = _batch_with_lengths(mr, [5, limit, 17], g)
    if hint:
        batch.max_seq_len = limit + 1
    else:
        batch.seq_lens_cpu[1] = limit + 1  # the host copy decides, without a device sync
    if packed_inputs:
        batch.packed = pack_batch(batch)
    before = {k: v.clone() for k, v in vars(runner.buffers).items() if torch.is_tensor(v)}
    kv = mr.clone_state()
    # "33 tokens is longer than the 32" or "seq_lens_cpu[1] = 33 is outside [1, 33)"
    with pytest.raises(ReplayError, match=rf"\b{limit + 1}\b.*(\b{limit}\b|\[1, {limit + 1}\))"):
        runner.replay(batch)
    for k, v in vars(runner.buffers).items():
        if torch.is_tensor(v):
            assert torch.equal(v, before[k]), f"{k} was written by a refused batch"
    assert all(torch.equal(a, b) for a, b in zip(mr.kv, kv))
    assert runner.stats.replays == 0


@pytest.mark.parametrize("packed_inputs", [True, False])
def test_an_over_wide_block_table_is_refused_before_any_copy(packed_inputs):
    mr = ToyModelRunner(num_pages=160, seed=39)
    runner = CudaGraphRunner(mr, replace(CFG, packed_inputs=packed_inputs))
    g = torch.Generator().manual_seed(40)
    batch = mr.random_batch(3, g)
    width = runner.buffers.block_table.shape[1]
    extra = torch.randint(1, 160, (3, 2), generator=g, dtype=torch.int32)
    batch.block_table = torch.cat([batch.block_table, extra], dim=1)  # [3, width + 2]
    before = {k: v.clone() for k, v in vars(runner.buffers).items() if torch.is_tensor(v)}
    assert not runner.can_run(batch)
    assert runner.stats.fallbacks["bad_input"] == 1
    with pytest.raises(ReplayError, match=rf"block_table has shape \(3, {width + 2}\)"):
        runner.replay(batch)
    for k, v in vars(runner.buffers).items():
        if torch.is_tensor(v):
            assert torch.equal(v, before[k]), f"{k} was written by a refused batch"
    assert runner.stats.replays == 0
    ok = mr.random_batch(3, g)
    want, _ = mr.eager_reference(ok)
    torch.testing.assert_close(runner.replay(ok), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("field", ["input_ids", "positions", "out_cache_loc", "seq_lens"])
@pytest.mark.parametrize("shape", ["column", "scalar"])
def test_a_field_of_the_wrong_shape_is_refused_before_any_copy(field, shape):
    """A per-row field given as a column ``[bs, 1]`` or a 0-d tensor: ``ReplayError`` naming the
    field and its shape (a torch error from inside the copy before), nothing written."""
    mr = ToyModelRunner(num_pages=160, seed=41)
    runner = CudaGraphRunner(mr, replace(CFG, packed_inputs=False))
    batch = mr.random_batch(2, torch.Generator().manual_seed(42))
    value = getattr(batch, field)
    setattr(batch, field, value[:, None] if shape == "column" else value[0])
    before = {k: v.clone() for k, v in vars(runner.buffers).items() if torch.is_tensor(v)}
    got = "(2, 1)" if shape == "column" else "()"
    with pytest.raises(ReplayError, match=rf"{field} has shape \{got[:-1]}\)"):
        runner.replay(batch)
    for k, v in vars(runner.buffers).items():
        if torch.is_tensor(v):
            assert torch.equal(v, before[k]), f"{k} was written by a refused batch"


@pytest.mark.parametrize("shape", ["column", "scalar"])
def test_can_run_names_input_ids_of_the_wrong_shape(shape):
    """``input_ids`` gives the batch size: ``can_run`` raises on a column or a 0-d tensor, as on
    a batch that is not a ``ForwardBatch`` (a caller's bug, not a fallback)."""
    mr = ToyModelRunner(num_pages=160, seed=43)
    runner = CudaGraphRunner(mr, CFG)
    batch = mr.random_batch(2, torch.Generator().manual_seed(44))
    batch.input_ids = batch.input_ids[:, None] if shape == "column" else batch.input_ids[0]
    with pytest.raises(ReplayError, match=r"can_run\(\): input_ids must be a 1-D tensor"):
        runner.can_run(batch)
    assert not runner.stats.fallbacks


class BucketEcho(ToyModelRunner):
    """The toy's logits plus one column: the number of rows of the batch the forward ran on.
    A replay's output then says which bucket's graph produced it."""

    def forward(self, batch):
        logits = super().forward(batch)
        rows = torch.full((logits.shape[0], 1), float(batch.batch_size), dtype=logits.dtype)
        return torch.cat([logits, rows], dim=1)


@pytest.mark.parametrize(
    "capture_bs,bucket_of",
    [
        (None, BUCKET_OF),
        ((1, 3, 5, 12), {1: 1, 2: 3, 3: 3, 4: 5, 5: 5, **{b: 12 for b in range(6, 13)}}),
    ],
)
def test_each_batch_size_replays_its_own_bucket_read_from_the_output(capture_bs, bucket_of):
    mr = BucketEcho(num_pages=160, seed=41)
    cfg = replace(CFG, capture_bs=capture_bs) if capture_bs else CFG
    runner = CudaGraphRunner(mr, cfg)
    g = torch.Generator().manual_seed(42)
    order = list(bucket_of)
    for bs in order + order[::-1]:  # up, then down across every bucket edge
        batch = mr.random_batch(bs, g)
        want, want_state = mr.eager_reference(batch)
        got = runner.replay(batch)
        assert got.shape == (bs, want.shape[1])
        assert got[:, -1].tolist() == [float(bucket_of[bs])] * bs, f"bs={bs}"
        torch.testing.assert_close(got[:, :-1], want[:, :-1], rtol=1e-5, atol=1e-5)
        for have, ref in zip(mr.kv, want_state):
            torch.testing.assert_close(have[mr.page_size :], ref[mr.page_size :])


def test_shutdown_drops_every_reference_to_static_buffers_and_outputs():
    """After ``shutdown()`` nothing in the runner keeps its static inputs or shared output alive
    (the GPU tier checks the bytes; here, weak references to the tensors)."""
    import gc
    import weakref

    mr = ToyModelRunner(num_pages=160, seed=43)
    runner = CudaGraphRunner(mr, CFG)
    out = runner.replay(mr.random_batch(3, torch.Generator().manual_seed(44)))
    refs = [weakref.ref(t) for t in vars(runner.buffers).values() if torch.is_tensor(t)]
    refs.append(weakref.ref(runner.output_buffers[16]))
    del out
    runner.shutdown()
    mr.attn_backend.seq_lens = mr.attn_backend.block_table = None  # the model's own references
    gc.collect()
    alive = [r() for r in refs if r() is not None]
    assert not alive, f"{len(alive)} static tensors outlive shutdown(): {[a.shape for a in alive]}"
