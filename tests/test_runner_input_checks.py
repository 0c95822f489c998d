"""The runner refuses bad batch values with ReplayError before anything is copied or written:
seq_lens < 1, positions outside [0, max context), out_cache_loc outside the cache or in
scratch page 0, block-table entries >= num_pages, token ids >= vocab. The KV cache outside
page 0, the free pages and the runner's stats stay as they were; a good batch still replays
equal to eager. Levels: "host" (default, host rows), "full" (device tensors too), "off"."""

from __future__ import annotations

import pytest
import torch

from stepgraph.batch import PACKED, unpacked_batch
from stepgraph.errors import ConfigError, ReplayError
from stepgraph.model import ModelRunner
from stepgraph.runner import CudaGraphRunner, RunnerConfig
from stepgraph.runner.input_checks import _FEW_ROWS as FEW_ROWS
from stepgraph.runner.input_checks import InputLimits, check_values
from stepgraph.toy_model import ToyModelRunner

from .guards import assert_kv_unchanged, fill_kv_random, kv_snapshot, time_limit

VOCAB, CTX, PAGE = 512, 64, 16


@pytest.fixture(scope="module", params=[False, True], ids=["copied", "staged"])
def setup(request):
    """The runner as the CPU stand-in runs it, and staged as on CUDA (host rows through the
    pinned slots: the replay's numpy path, checks included)."""
    mr = ModelRunner.from_preset(
        "tiny", "cpu", torch.float32, seed=8, max_bs=4, max_context_len=CTX
    )
    config = RunnerConfig(max_bs=4, show_progress=False, pinned_staging=request.param)
    runner = CudaGraphRunner(mr, config)
    return mr, runner


def _batch(mr, seed: int):
    """Three requests at random positions over freshly reserved pages; random tokens."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.randint(0, CTX - 1, (3,), generator=g).tolist()
    pages = [mr.kv_cache.reserve(p + 1) for p in pos]
    tokens = torch.randint(1, VOCAB, (3,), generator=g).tolist()
    return mr.decode_batch(tokens, pos, pages, contiguous_fields=False), pages


def _set(batch, field: str, row: int, value: int, col: int = 0) -> None:
    """Corrupt the host rows (on the CPU they are the rows the device copy came from)."""
    host = batch.packed_cpu
    if field == "block_table":
        PACKED.table(host)[row, col] = value
    else:
        PACKED.column(host, field)[row] = value
    if field == "seq_lens":
        batch.seq_lens_cpu[row] = value


CASES = [
    ("seq_lens", 0, "seq_lens"),
    ("seq_lens", -3, "seq_lens"),
    ("positions", -1, "positions"),
    ("positions", CTX, "positions"),
    ("out_cache_loc", -1, "out_cache_loc"),
    ("out_cache_loc", 5, "scratch page 0"),  # a slot of page 0, for a real row
    ("out_cache_loc", 10**6, "out_cache_loc"),
    ("block_table", 10**6, "block_table"),
    ("block_table", -2, "block_table"),
    ("input_ids", VOCAB, "input_ids"),
    ("input_ids", -1, "input_ids"),
]


@pytest.mark.parametrize("field,value,match", CASES)
def test_bad_value_is_refused_and_nothing_changes(setup, field, value, match):
    mr, runner = setup
    fill_kv_random(mr.kv_cache, seed=hash((field, value)) % 1000)
    batch, pages = _batch(mr, seed=len(field) + value % 7)
    try:
        _set(batch, field, 1, value)
        kv, free = kv_snapshot(mr.kv_cache), mr.kv_cache.allocator.num_free
        replays, static = runner.stats.replays, runner.buffers.packed.clone()
        staged = runner._staging.host.clone() if runner.staged else None
        with time_limit(20), pytest.raises(ReplayError, match=match):
            runner.replay(batch)
        assert_kv_unchanged(mr.kv_cache, kv)
        assert mr.kv_cache.allocator.num_free == free
        assert runner.stats.replays == replays
        assert torch.equal(runner.buffers.packed, static)  # nothing copied
        if staged is not None:  # nothing staged, and the count the graphs wait on kept
            assert torch.equal(runner._staging.host, staged)
            assert runner._staging.count == replays
    finally:
        for p in pages:
            mr.kv_cache.release(p)


def test_good_batch_replays_equal_to_eager(setup):
    mr, runner = setup
    fill_kv_random(mr.kv_cache, seed=11)
    batch, pages = _batch(mr, seed=12)
    kv = [c.clone() for c in mr.kv_cache.k_caches]
    graph = runner.replay(batch).clone()
    for c, k in zip(mr.kv_cache.k_caches, kv):
        c.copy_(k)
    eager = mr.forward(unpacked_batch(batch.packed, batch.seq_lens_cpu))
    assert torch.allclose(graph, eager, atol=1e-5)
    for p in pages:
        mr.kv_cache.release(p)


def test_full_checks_device_only_batches_and_host_does_not_sync():
    toy = ToyModelRunner(num_pages=40, page_size=4, max_pages_per_request=4)
    g = torch.Generator().manual_seed(3)
    limits = InputLimits.of(toy)
    assert limits == InputLimits(num_pages=40, page_size=4, vocab_size=97, max_context_len=16)
    batch = toy.random_batch(3, g)  # device tensors only: no host rows
    batch.out_cache_loc[2] = -1
    check_values(batch, limits, "host")  # only seq_lens_cpu is on the host: passes
    with pytest.raises(ReplayError, match=r"out_cache_loc\[2\] = -1"):
        check_values(batch, limits, "full")
    batch.seq_lens_cpu[0] = 0
    check_values(batch, limits, "off")
    with pytest.raises(ReplayError, match=r"seq_lens_cpu\[0\] = 0"):
        check_values(batch, limits, "host")


def test_toy_runner_refuses_with_full_checks():
    toy = ToyModelRunner(num_pages=40, page_size=4, max_pages_per_request=4)
    runner = CudaGraphRunner(toy, RunnerConfig(max_bs=4, show_progress=False, check_inputs="full"))
    batch = toy.random_batch(2, torch.Generator().manual_seed(5), packed=True)
    batch.packed_cpu = None  # a device-only batch: "full" copies it back to check
    PACKED.table(batch.packed)[0, 1] = 40
    state = [c.clone() for c in toy.kv]
    with pytest.raises(ReplayError, match="block_table"):
        runner.replay(batch)
    assert all(torch.equal(a, b) for a, b in zip(state, toy.kv))
    assert runner.stats.replays == 0


def test_check_inputs_level_is_validated():
    with pytest.raises(ConfigError, match="check_inputs"):
        RunnerConfig(check_inputs="some")


def test_full_refuses_a_slot_in_another_requests_page():
    mr = ModelRunner.from_preset("tiny", "cpu", torch.float32, 9, max_bs=4, max_context_len=CTX)
    runner = CudaGraphRunner(mr, RunnerConfig(max_bs=4, show_progress=False, check_inputs="full"))
    fill_kv_random(mr.kv_cache, seed=13)
    batch, pages = _batch(mr, seed=14)
    # row 0 writes into row 2's last page: in range, not scratch, so "host" lets it through
    _set(batch, "out_cache_loc", 0, pages[2][-1] * PAGE + 1)
    check_values(batch, InputLimits.of(mr), "host")
    kv, free = kv_snapshot(mr.kv_cache), mr.kv_cache.allocator.num_free
    with pytest.raises(ReplayError, match="another request's page"):
        runner.replay(batch)
    assert_kv_unchanged(mr.kv_cache, kv)
    assert mr.kv_cache.allocator.num_free == free and runner.stats.replays == 0
    _set(batch, "out_cache_loc", 0, mr.kv_cache.slot(pages[0], int(batch.positions[0])))
    runner.replay(batch)  # the right slot again: replays
    assert runner.stats.replays == 1


@pytest.mark.parametrize("bs", [1, FEW_ROWS, FEW_ROWS + 1])
def test_kv_lengths_are_checked_alike_as_a_list_or_an_array(bs):
    """Up to ``_FEW_ROWS`` rows the KV lengths are read as a list, past it as an array: the same
    refusals and the same longest length either way, at the limit and one past it."""
    toy = ToyModelRunner(num_pages=4 * (FEW_ROWS + 1) + 1, page_size=4, max_pages_per_request=4)
    limits = InputLimits.of(toy)  # max_context_len 16: lengths in [1, 16]
    batch = toy.random_batch(bs, torch.Generator().manual_seed(bs), packed=True)
    batch.seq_lens_cpu[-1] = 16  # at the limit
    assert check_values(batch, limits, "host") == 16
    for row, value in ((bs - 1, 17), (0, 0)):
        good = int(batch.seq_lens_cpu[row])
        batch.seq_lens_cpu[row] = value
        with pytest.raises(ReplayError, match=rf"seq_lens_cpu\[{row}\] = {value} is outside"):
            check_values(batch, limits, "host")
        batch.seq_lens_cpu[row] = good
    batch.seq_lens_cpu[-1] = 1  # each limit on its own row: the longest is read, not assumed
    assert check_values(batch, limits, "host") == int(batch.seq_lens_cpu.max())


def test_staged_rows_changed_in_place_are_checked_and_replayed_anew():
    """An engine passes the same host rows tensor every step, written in place: the staged
    replay keeps its numpy view, and still checks and stages the values of each call; a
    tensor of the same identity but another shape or address is read anew."""
    toy = ToyModelRunner(num_pages=40, page_size=4, max_pages_per_request=4)
    runner = CudaGraphRunner(toy, RunnerConfig(max_bs=4, show_progress=False, pinned_staging=True))
    g = torch.Generator().manual_seed(21)
    batch = toy.random_batch(3, g, packed=True)
    other = toy.random_batch(3, g, packed=True)
    torch.testing.assert_close(runner.replay(batch), toy.eager_reference(batch)[0])
    batch.packed_cpu.copy_(other.packed_cpu)  # the next step's values, same tensor
    batch.seq_lens_cpu.copy_(other.seq_lens_cpu)
    for name in ("input_ids", "positions", "seq_lens", "block_table", "out_cache_loc"):
        getattr(batch, name).copy_(getattr(other, name))
    torch.testing.assert_close(runner.replay(batch), toy.eager_reference(other)[0])
    torch.testing.assert_close(runner._staging.rows(1)[:3], other.packed_cpu)
    PACKED.column(batch.packed_cpu, "out_cache_loc")[2] = 40 * 4  # one past the cache
    with pytest.raises(ReplayError, match=r"out_cache_loc\[2\] = 160 is outside \[4, 160\)"):
        runner.replay(batch)
    PACKED.column(batch.packed_cpu, "out_cache_loc")[2] = 40 * 4 - 1  # the last slot: valid
    runner.replay(batch)
    assert runner.stats.replays == 3
    rows = batch.packed_cpu.numpy()  # numpy writes leave the tensor's version: the kept view
    rows[1, PACKED.fields.index("input_ids")] = 97  # one past the vocabulary
    with pytest.raises(ReplayError, match=r"input_ids\[1\] = 97 is outside \[0, 97\)"):
        runner.replay(batch)
    rows[1, PACKED.fields.index("input_ids")] = 96
    runner.replay(batch)
    torch.testing.assert_close(runner._staging.rows(1)[1, 0], torch.tensor(96))
    batch.packed_cpu.resize_(2, batch.packed_cpu.shape[1])  # same tensor, two rows now
    with pytest.raises(ReplayError, match=r"packed_cpu has shape \(2, 8\), expected \[3, <= 8\]"):
        runner.replay(batch)
    batch.packed_cpu = other.packed_cpu.clone()  # same values, another tensor: read anew
    torch.testing.assert_close(runner.replay(batch), toy.eager_reference(other)[0])


@pytest.mark.parametrize("ctx", [16, 17])
def test_staged_rows_refuse_a_kv_length_past_the_context_at_the_limit(ctx):
    """The staged replay checks the KV lengths in the host rows' column (what the graph reads):
    the context length passes, one past it is refused, with ``seq_lens_cpu`` left agreeing."""
    toy = ToyModelRunner(num_pages=40, page_size=4, max_pages_per_request=4)  # context 16
    runner = CudaGraphRunner(toy, RunnerConfig(max_bs=4, show_progress=False, pinned_staging=True))
    batch = toy.random_batch(2, torch.Generator().manual_seed(ctx), packed=True)
    PACKED.column(batch.packed_cpu, "seq_lens")[1] = ctx
    PACKED.column(batch.packed_cpu, "positions")[1] = 15  # the last position: valid
    batch.seq_lens_cpu[1] = ctx
    if ctx <= 16:
        runner.replay(batch)
        assert runner.stats.replays == 1
        return
    with pytest.raises(ReplayError, match=r"seq_lens\[1\] = 17 is outside \[1, 17\)"):
        runner.replay(batch)
    assert runner.stats.replays == 0 and runner._staging.count == 0


def test_staged_rows_of_a_wrong_dtype_device_or_shape_take_the_general_path_and_are_named():
    toy = ToyModelRunner(num_pages=40, page_size=4, max_pages_per_request=4)
    runner = CudaGraphRunner(toy, RunnerConfig(max_bs=4, show_progress=False, pinned_staging=True))
    batch = toy.random_batch(2, torch.Generator().manual_seed(4), packed=True)
    rows = batch.packed_cpu
    batch.packed_cpu = rows.to(torch.int32)
    with pytest.raises(ReplayError, match="packed_cpu is torch.int32 on cpu, expected int64"):
        runner.replay(batch)
    batch.packed_cpu = rows.to("meta")  # numpy() refuses it: the general path names it
    with pytest.raises(ReplayError, match="packed_cpu is torch.int64 on meta, expected int64"):
        runner.replay(batch)
    batch.packed_cpu = rows[0]  # one row, 1-D
    with pytest.raises(ReplayError, match=r"packed_cpu has shape \(8,\), expected \[2, <= 8\]"):
        runner.replay(batch)
    assert runner.stats.replays == 0
