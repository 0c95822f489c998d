"""The decode graph runner on the CPU stand-in: real static-buffer semantics, every error path."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from stepgraph.backends import CpuCapturedGraph
from stepgraph.batch import PACKED, ForwardMode, pack_batch
from stepgraph.errors import CaptureError, ConfigError, ReplayError
from stepgraph.runner import CudaGraphRunner, RunnerConfig
from stepgraph.toy_model import ToyModelRunner

CFG = RunnerConfig(max_bs=16, show_progress=False)


@pytest.fixture
def mr():
    return ToyModelRunner(num_pages=160, seed=20)


def test_capture_order_buckets_and_stats(mr):
    runner = CudaGraphRunner(mr, CFG)
    assert runner.capture_bs == [1, 2, 4, 8, 16] and runner.max_bs == 16
    assert runner.capture_order == [16, 8, 4, 2, 1]  # largest first
    assert [b.bs for b in runner.stats.capture.buckets] == [16, 8, 4, 2, 1]
    assert set(runner.graphs) == set(runner.output_buffers) == {1, 2, 4, 8, 16}
    assert mr.attn_backend.calls[0] == ("state", 16)
    assert [c for c in mr.attn_backend.calls if c[0] == "capture"] == [
        ("capture", b) for b in (16, 8, 4, 2, 1)
    ]
    assert mr.capture_mode_seen
    assert runner.compile_bs == []
    assert "captured 5 buckets" in runner.stats.capture.summary()


@pytest.mark.parametrize("packed_inputs,send_packed", [(True, True), (True, False), (False, False)])
def test_replay_equals_eager_for_every_batch_size(mr, packed_inputs, send_packed):
    runner = CudaGraphRunner(mr, replace(CFG, packed_inputs=packed_inputs))
    g = torch.Generator().manual_seed(1234)
    for bs in range(1, 17):
        batch = mr.random_batch(bs, g, packed=send_packed)
        want, want_state = mr.eager_reference(batch)
        got = runner.replay(batch)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        # The live requests' cache equals eager's: padded rows wrote only into scratch page 0.
        for have, ref in zip(mr.kv, want_state):
            torch.testing.assert_close(have[mr.page_size :], ref[mr.page_size :])
    assert runner.stats.replays == 16
    assert runner.stats.packed_here == (16 if packed_inputs and not send_packed else 0)


def test_every_bucket_writes_into_one_shared_output_buffer(mr):
    runner = CudaGraphRunner(mr, CFG)
    shared = runner.output_buffers[16]
    assert {bs: out.shape[0] for bs, out in runner.output_buffers.items()} == {
        b: b for b in (1, 2, 4, 8, 16)
    }
    g = torch.Generator().manual_seed(12)
    for bs in (9, 2, 5, 1, 16, 3):  # each bucket's replay lands in rows [:bs] of one buffer
        shared.fill_(float("nan"))
        batch = mr.random_batch(bs, g)
        want, _ = mr.eager_reference(batch)
        runner.replay(batch)
        torch.testing.assert_close(shared[:bs], want, rtol=1e-5, atol=1e-5)
        bucket = {1: 1, 2: 2, 3: 4, 5: 8, 9: 16, 16: 16}[bs]
        assert shared[bs:bucket].isfinite().all()  # the bucket's padded rows: written too
        assert shared[bucket:].isnan().all()  # rows past the bucket: untouched


def test_output_is_a_static_view_overwritten_by_next_replay(mr):
    runner = CudaGraphRunner(mr, CFG)
    g = torch.Generator().manual_seed(7)
    a, b = mr.random_batch(3, g), mr.random_batch(3, g)
    want_a, _ = mr.eager_reference(a)
    out_a = runner.replay(a)
    torch.testing.assert_close(out_a, want_a, rtol=1e-5, atol=1e-5)
    want_b, _ = mr.eager_reference(b)
    out_b = runner.replay(b)
    torch.testing.assert_close(out_b, want_b, rtol=1e-5, atol=1e-5)
    # a's result was overwritten in place by b's, as the docstring warns
    torch.testing.assert_close(out_a, want_b, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(want_a, want_b)


@pytest.mark.parametrize("packed_inputs", [True, False])
def test_padding_rows_are_reset_after_a_larger_batch(mr, packed_inputs):
    """A batch of 5 after one of 8 (same bucket): rows 5..7 must not keep the old requests'
    slots, or the padded rows would write into live KV."""
    runner = CudaGraphRunner(mr, replace(CFG, packed_inputs=packed_inputs))
    g = torch.Generator().manual_seed(11)
    big = mr.random_batch(8, g, packed=packed_inputs)
    runner.replay(big)
    small = mr.random_batch(5, g, packed=packed_inputs)
    state_before = mr.clone_state()
    want, want_state = mr.eager_reference(small)
    mr.load_state(state_before)
    got = runner.replay(small)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    buf = runner.buffers
    assert buf.out_cache_loc[5:8].tolist() == [0, 0, 0]
    assert buf.block_table[5:8].eq(0).all() and buf.seq_lens[5:8].eq(1).all()
    assert buf.input_ids[5:8].eq(0).all() and buf.positions[5:8].eq(0).all()
    for have, ref in zip(mr.kv, want_state):
        torch.testing.assert_close(have[mr.page_size :], ref[mr.page_size :])


def test_too_large_batch_refused_then_runner_still_works(mr):
    runner = CudaGraphRunner(mr, CFG)
    g = torch.Generator().manual_seed(3)
    big = mr.random_batch(17, g)
    assert not runner.can_run(big)
    assert runner.stats.fallbacks["too_large"] == 1
    with pytest.raises(ReplayError, match=r"largest captured bucket \(16\).*eagerly.*max_bs"):
        runner.replay(big)
    ok = mr.random_batch(2, g)
    want, _ = mr.eager_reference(ok)
    torch.testing.assert_close(runner.replay(ok), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "field,bad",
    [
        ("input_ids", lambda t: t.to(torch.int32)),
        ("seq_lens", lambda t: t.to(torch.int64)),
        ("block_table", lambda t: t.to(torch.int64)),
        ("out_cache_loc", lambda t: t.to("meta")),
        ("positions", lambda t: t[:-1]),
    ],
)
def test_bad_input_errors_before_any_copy(mr, field, bad):
    runner = CudaGraphRunner(mr, CFG)
    g = torch.Generator().manual_seed(5)
    batch = mr.random_batch(4, g)
    setattr(batch, field, bad(getattr(batch, field)))
    snapshot = {k: v.clone() for k, v in runner.buffers.view(16).device_tensors().items()}
    assert not runner.can_run(batch)
    assert runner.stats.fallbacks["bad_input"] == 1
    with pytest.raises(ReplayError, match=field):
        runner.replay(batch)
    for k, v in runner.buffers.view(16).device_tensors().items():
        assert torch.equal(v, snapshot[k]), f"{k} was modified by a rejected batch"
    ok = mr.random_batch(4, g)
    want, _ = mr.eager_reference(ok)
    torch.testing.assert_close(runner.replay(ok), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "bad,match",
    [
        (lambda p: p.to(torch.int32), "int64"),
        (lambda p: p[:-1], "shape"),
        (lambda p: torch.cat([p, p[:, :3]], dim=1), "shape"),
    ],
)
def test_bad_packed_input_errors_before_any_copy(mr, bad, match):
    runner = CudaGraphRunner(mr, CFG)
    g = torch.Generator().manual_seed(8)
    batch = mr.random_batch(4, g, packed=True)
    batch.packed = bad(batch.packed)
    before = runner.buffers.packed.clone()
    assert not runner.can_run(batch)
    with pytest.raises(ReplayError, match=match):
        runner.replay(batch)
    assert torch.equal(runner.buffers.packed, before)


@pytest.mark.parametrize("staged", [False, True])
@pytest.mark.parametrize("packed", [True, False])
def test_packed_batch_with_a_narrower_block_table(mr, packed, staged):
    """Requests short enough for two pages may send only two table columns: as packed rows, or
    as fields the runner packs (one concatenation into the static or the staged rows)."""
    from stepgraph.batch import PACKED, unpacked_batch

    runner = CudaGraphRunner(mr, replace(CFG, pinned_staging=staged))
    g = torch.Generator().manual_seed(21)
    runner.replay(mr.random_batch(6, g))  # leave full-width rows behind
    batch = mr.random_batch(5, g)
    lens = torch.randint(1, 2 * mr.page_size + 1, (5,), generator=g, dtype=torch.int32)
    batch.seq_lens, batch.seq_lens_cpu, batch.positions = lens, lens.clone(), lens.long() - 1
    last = batch.positions
    page = batch.block_table.long().gather(1, (last // mr.page_size)[:, None])[:, 0]
    batch.out_cache_loc = page * mr.page_size + last % mr.page_size
    narrow = unpacked_batch(pack_batch(batch)[:, : PACKED.width(2)], batch.seq_lens_cpu)
    if not packed:
        narrow.packed = None  # fields only: [5, 2] table columns
    want, _ = mr.eager_reference(batch)
    before = runner.stats.packed_here
    torch.testing.assert_close(runner.replay(narrow), want, rtol=1e-5, atol=1e-5)
    assert runner.stats.packed_here - before == (0 if packed or staged else 1)


def test_request_longer_than_the_captured_context_is_refused_before_any_copy(mr):
    runner = CudaGraphRunner(mr, CFG)
    batch = mr.random_batch(2, torch.Generator().manual_seed(4), packed=True)
    batch.max_seq_len = mr.max_context_len + 1
    before = runner.buffers.packed.clone()
    with pytest.raises(ReplayError, match=f"longer than the {mr.max_context_len}"):
        runner.replay(batch)
    assert torch.equal(runner.buffers.packed, before)
    batch.max_seq_len = None  # the host copy of seq_lens is the fallback, and it fits
    want, _ = mr.eager_reference(batch)
    torch.testing.assert_close(runner.replay(batch), want, rtol=1e-5, atol=1e-5)


def test_empty_and_prefill_batches(mr):
    runner = CudaGraphRunner(mr, CFG)
    g = torch.Generator().manual_seed(9)
    empty = mr.random_batch(1, g)
    for name, t in empty.device_tensors().items():
        setattr(empty, name, t[:0])
    empty.seq_lens_cpu = empty.seq_lens_cpu[:0]
    assert not runner.can_run(empty) and runner.stats.fallbacks["empty"] == 1
    with pytest.raises(ReplayError, match="empty batch"):
        runner.replay(empty)
    prefill = mr.random_batch(2, g)
    prefill.mode = ForwardMode.PREFILL
    assert not runner.can_run(prefill) and runner.stats.fallbacks["not_decode"] == 1
    with pytest.raises(ReplayError, match="decode"):
        runner.replay(prefill)


def test_shutdown_then_any_call_raises(mr):
    runner = CudaGraphRunner(mr, CFG)
    batch = mr.random_batch(2, torch.Generator().manual_seed(1))
    runner.shutdown()
    assert runner.graphs == {} and runner.output_buffers == {} and runner.capture_order == []
    assert not runner.can_run(batch) and runner.stats.fallbacks["shut_down"] == 1
    with pytest.raises(ReplayError, match="after shutdown"):
        runner.replay(batch)
    with pytest.raises(ReplayError, match="after shutdown"):
        runner.capture()


def test_host_sync_in_forward_fails_capture_cleanly():
    mr = ToyModelRunner(num_pages=160, sync_in_forward=True)
    with pytest.raises(CaptureError, match=r"batch size 16.*host.*eagerly") as info:
        CudaGraphRunner(mr, CFG)
    assert isinstance(info.value.__cause__, RuntimeError)
    assert "_local_scalar_dense" in str(info.value.__cause__)
    runner = CudaGraphRunner(mr, CFG, capture=False)
    with pytest.raises(CaptureError):
        runner.capture()
    assert runner.graphs == {} and runner.capture_order == []
    # Fix the model and capture again: the same runner works.
    mr.sync_in_forward = False
    runner.capture()
    batch = mr.random_batch(3, torch.Generator().manual_seed(2))
    want, _ = mr.eager_reference(batch)
    torch.testing.assert_close(runner.replay(batch), want, rtol=1e-5, atol=1e-5)


def test_config_validation():
    with pytest.raises(ConfigError, match="mode"):
        RunnerConfig(mode="fast")
    with pytest.raises(ConfigError):
        RunnerConfig(capture_bs=(4, 2))
    with pytest.raises(ConfigError):
        RunnerConfig(warmup_iters=0)
    assert RunnerConfig(capture_bs=(1, 3, 5)).buckets() == [1, 3, 5]


class FakeUpdater:
    """Stands in for the driver-backed flash updater: records what the runner asks of it."""

    def __init__(self):
        self.plans, self.applied, self.invalidated = [], [], []

    def plan(self, graph, bs):
        assert isinstance(graph, CpuCapturedGraph)
        self.plans.append(bs)
        return {"bs": bs, "ns": None}

    def apply(self, plan, graph, t_kv):
        self.applied.append((plan["bs"], t_kv))
        changed = plan["ns"] != t_kv
        plan["ns"] = t_kv
        return 2 if changed else 0

    def invalidate(self, plan):
        self.invalidated.append(plan["bs"])
        plan["ns"] = None


def test_exact_mode_applies_per_bucket_and_reapplies_after_reinstantiate(mr):
    upd = FakeUpdater()
    runner = CudaGraphRunner(
        mr, RunnerConfig(max_bs=8, mode="exact", show_progress=False), exec_updater=upd
    )
    assert upd.plans == [8, 4, 2, 1]
    g = torch.Generator().manual_seed(4)
    b3 = mr.random_batch(3, g)
    runner.replay(b3)
    runner.replay(b3)
    assert upd.applied == [(4, int(b3.seq_lens.max()))] * 2
    assert runner.stats.node_edits == 2  # the second apply was a no-op
    b3.max_seq_len = 29  # a host hint wins over the reduction
    runner.replay(b3)
    assert upd.applied[-1] == (4, 29)
    runner.reinstantiate()
    assert sorted(upd.invalidated) == [1, 2, 4, 8]
    runner.replay(b3)
    assert runner.stats.node_edits == 6


@pytest.mark.parametrize("checks", ["host", "off"])
def test_exact_mode_of_staged_host_rows_takes_the_kv_length_of_their_column(mr, checks):
    """A staged replay of host rows retunes to the longest KV length of the rows' column (what
    the graph reads), with value checks on or off, and to ``max_seq_len`` where given."""
    upd = FakeUpdater()
    config = RunnerConfig(
        max_bs=8, mode="exact", show_progress=False, pinned_staging=True, check_inputs=checks
    )
    runner = CudaGraphRunner(mr, config, exec_updater=upd)
    b3 = mr.random_batch(3, torch.Generator().manual_seed(6), packed=True)
    longest = int(PACKED.column(b3.packed_cpu, "seq_lens").max())
    b3.seq_lens_cpu.fill_(1)  # not what the staged replay reads
    runner.replay(b3)
    assert upd.applied == [(4, longest)]
    b3.max_seq_len = longest + 1  # a host hint wins over the column
    runner.replay(b3)
    assert upd.applied[-1] == (4, longest + 1)


def test_exact_mode_without_nodes_is_a_capture_error(mr):
    class Empty(FakeUpdater):
        def plan(self, graph, bs):
            raise CaptureError("no flash-decode nodes; use mode='graph'")

    with pytest.raises(CaptureError, match="mode='graph'"):
        CudaGraphRunner(
            mr, RunnerConfig(max_bs=4, mode="exact", show_progress=False), exec_updater=Empty()
        )


def test_exact_mode_on_the_stand_in_names_the_fix(mr):
    with pytest.raises(CaptureError, match="mode='graph'"):
        CudaGraphRunner(mr, RunnerConfig(max_bs=2, mode="exact", show_progress=False))


@pytest.mark.parametrize("packed_inputs", [True, False])
def test_random_walk_of_batch_sizes_never_touches_live_kv(packed_inputs):
    """Batches grow and shrink across and within buckets in a random order; every replay equals
    eager and leaves every live page exactly as eager does (padding only touches page 0)."""
    mr = ToyModelRunner(num_pages=160, seed=322)
    runner = CudaGraphRunner(mr, replace(CFG, packed_inputs=packed_inputs))
    g = torch.Generator().manual_seed(323)
    for _ in range(30):
        bs = int(torch.randint(1, 17, (1,), generator=g))
        batch = mr.random_batch(bs, g, packed=packed_inputs and bool(bs % 2))
        want, want_state = mr.eager_reference(batch)
        got = runner.replay(batch)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for have, ref in zip(mr.kv, want_state):
            torch.testing.assert_close(have[mr.page_size :], ref[mr.page_size :])
