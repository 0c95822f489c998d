"""Edges of the pure modules that mutation testing (scripts/mutation-test) found unchecked:
bucket lists at max_bs 1 and just past a multiple of 16, error messages, the ladder's smallest
GPU, the step finder's first value, the batch's device fields and unpacked views."""

from __future__ import annotations

import pytest
import torch

from stepgraph.batch import PACKED, ForwardBatch, pack_batch, unpacked_batch
from stepgraph.buckets import default_capture_sizes, distribute_tokens, validate_buckets
from stepgraph.errors import ConfigError
from stepgraph.kernels.decode.splits import (
    fa_split_keys,
    ladder_cap,
    monotone_steps,
    num_splits_for,
)


@pytest.mark.parametrize(
    "max_bs, want",
    [
        (1, [1]),
        (2, [1, 2]),
        (3, [1, 2, 3]),
        (8, [1, 2, 4, 8]),
        (15, [1, 2, 4, 8, 15]),
        (16, [1, 2, 4, 8, 16]),
        (17, [1, 2, 4, 8, 16, 17]),
        (31, [1, 2, 4, 8, 16, 31]),
        (32, [1, 2, 4, 8, 16, 32]),
        (47, [1, 2, 4, 8, 16, 32, 47]),
        (64, [1, 2, 4, 8, 16, 32, 48, 64]),
    ],
)
def test_default_capture_sizes_hand_written(max_bs, want):
    assert default_capture_sizes(max_bs) == want


def test_bucket_errors_name_the_value_and_the_fix():
    with pytest.raises(ConfigError, match=r"max_bs must be >= 1, got 0; pass a positive"):
        default_capture_sizes(0)
    with pytest.raises(ConfigError, match=r"^capture_bs is empty; give at least one bucket"):
        validate_buckets([])
    with pytest.raises(ConfigError, match=r"^capture_bs must hold positive ints, got \[0, 2\]"):
        validate_buckets([0, 2])
    with pytest.raises(ConfigError, match=r"^my_bs must be sorted.*sorted\(set\(my_bs\)\)"):
        validate_buckets([2, 2], what="my_bs")
    with pytest.raises(ConfigError, match=r"bs must be >= 1, got 0\."):
        distribute_tokens(5, 0)
    with pytest.raises(ConfigError, match=r"cannot give 3 requests .* from 2 tokens"):
        distribute_tokens(2, 3)


def test_the_ladder_on_a_one_sm_gpu():
    # 4 programs on one SM: 1 request x 1 KV head -> cap 4 splits
    assert ladder_cap(1, 1, 1) == 4
    assert fa_split_keys(1000, 1, 1, 1) == 250 and num_splits_for(1000, 1, 1, 1, 64) == 4
    assert fa_split_keys(0, 1, 1, 1) == 128  # MIN_SPLIT_KEYS


def test_monotone_steps_first_value_and_single_step_functions():
    assert monotone_steps(lambda t: 1 + (t >= 2), 10) == ([1, 2], [1, 2])
    assert monotone_steps(lambda t: 5, 10) == ([1], [5])
    assert monotone_steps(lambda t: 1 + (t >= 10), 10) == ([1, 10], [1, 2])
    assert monotone_steps(lambda t: t, 4) == ([1, 2, 3, 4], [1, 2, 3, 4])


def _batch(bs: int = 3, pages: int = 4) -> ForwardBatch:
    g = torch.Generator().manual_seed(bs * 10 + pages)
    lens = torch.randint(1, 50, (bs,), generator=g, dtype=torch.int32)
    return ForwardBatch(
        input_ids=torch.randint(1, 1000, (bs,), generator=g),
        positions=lens.long() - 1,
        seq_lens=lens,
        seq_lens_cpu=lens.clone(),
        block_table=torch.randint(1, 99, (bs, pages), generator=g, dtype=torch.int32),
        out_cache_loc=torch.randint(16, 2000, (bs,), generator=g),
    )


def test_device_tensors_are_exactly_the_five_device_fields():
    b = _batch()
    assert set(b.device_tensors()) == {
        "input_ids",
        "positions",
        "seq_lens",
        "block_table",
        "out_cache_loc",
    }
    assert all(v is getattr(b, k) for k, v in b.device_tensors().items())


def test_unpacked_batch_keeps_the_host_lengths_and_copies_by_default():
    b = _batch()
    packed = pack_batch(b)
    assert packed.dtype is torch.int64 and packed.shape == (3, PACKED.width(4))
    back = unpacked_batch(packed, b.seq_lens_cpu)
    assert back.seq_lens_cpu is b.seq_lens_cpu and back.packed is packed
    for name, t in back.device_tensors().items():
        assert torch.equal(t, getattr(b, name)) and t.dtype == getattr(b, name).dtype, name
        assert t.is_contiguous(), f"{name}: copy=True is the default and gives contiguous fields"
        assert t.untyped_storage().data_ptr() != packed.untyped_storage().data_ptr(), name
    views = unpacked_batch(packed, b.seq_lens_cpu, copy=False)
    assert views.seq_lens_cpu is b.seq_lens_cpu
    for name, t in views.device_tensors().items():
        assert torch.equal(t, getattr(b, name)), name
        assert t.untyped_storage().data_ptr() == packed.untyped_storage().data_ptr(), name


def test_rows_of_cycles_rows_whatever_the_width():
    from stepgraph.configs.padding import rows_of

    g = torch.Generator().manual_seed(7)
    req = {"x": torch.randn(3, 5, generator=g), "ids": torch.randint(0, 9, (3,), generator=g)}
    out = rows_of(req, 7)
    assert torch.equal(out["x"], req["x"][[0, 1, 2, 0, 1, 2, 0]])
    assert torch.equal(out["ids"], req["ids"][[0, 1, 2, 0, 1, 2, 0]])
    one = rows_of({"x": req["x"][:1]}, 3)["x"]
    assert torch.equal(one, req["x"][[0, 0, 0]])
    assert rows_of(req, 0)["x"].shape == (0, 5)


def test_config_constructors_keep_every_argument_and_name_bad_inputs():
    from stepgraph.configs import BatchedCudaGraphConfig, PackedCudaGraphConfig

    x = {"x": torch.ones(1, 2)}
    make = lambda n: {"x": torch.ones(n, 2)}  # noqa: E731
    packed = PackedCudaGraphConfig("prefill", [8, 16], make, ["prefill", "extend"], "k")
    assert packed.compile is True
    assert PackedCudaGraphConfig("w", [8], make, compile=False).compile is False
    assert packed.replay_graph_walks == ["prefill", "extend"] and packed.additional_key_info == "k"
    with pytest.raises(ConfigError, match=r"^make_node_input must be a callable n -> NodeInputs"):
        PackedCudaGraphConfig("w", [8], None)
    with pytest.raises(ConfigError, match=r"^single_request_inputs\['y'\] is a int, expected a t"):
        BatchedCudaGraphConfig("w", {"x": torch.ones(1), "y": 3})
    with pytest.raises(ConfigError, match=r"^single_request_inputs is empty"):
        BatchedCudaGraphConfig("w", {})
    batched = BatchedCudaGraphConfig("w", x, total_tokens_multiplier=3)
    with pytest.raises(ConfigError, match=r"key of 4 requests holds 12 tokens, got num_tokens=8"):
        batched.get_node_inputs(4, 8)


def test_check_inputs_names_shapes_rows_and_the_fix():
    from stepgraph.configs.fit import check_inputs
    from stepgraph.errors import ReplayError

    g = torch.Generator().manual_seed(8)
    static = {"x": torch.randn(16, 4, 3, generator=g), "ids": torch.zeros(16, dtype=torch.int64)}
    live = {"x": torch.randn(5, 4, 3, generator=g), "ids": torch.ones(5, dtype=torch.int64)}
    assert check_inputs(live, static, label="walk w") == 5
    assert check_inputs({"x": live["x"]}, static, label="w", subset_ok=True) == 5
    with pytest.raises(ReplayError, match=r"^w has inputs \['x'\], .*; pass exactly those\.$"):
        check_inputs({"x": live["x"]}, static, label="w")  # subset_ok defaults to False
    with pytest.raises(ReplayError, match=r"\['x', 'z'\].*pass a non-empty subset of them\.$"):
        check_inputs({"x": live["x"], "z": live["ids"]}, static, label="w", subset_ok=True)
    with pytest.raises(ReplayError, match=r"^w has inputs \[\], .*subset of them\.$"):
        check_inputs({}, static, label="w", subset_ok=True)
    bad_rows = {"x": live["x"], "ids": torch.ones(4, dtype=torch.int64)}
    with pytest.raises(ReplayError, match=r"must be \[n, 4, 3\] with one n for every input\. "):
        check_inputs(bad_rows, static, label="w")
    with pytest.raises(
        ReplayError, match=r"input 'x' of w has shape \(5, 4, 2\).*run it\s+eagerly\.$"
    ):
        check_inputs({**live, "x": torch.randn(5, 4, 2, generator=g)}, static, label="w")
    scalar = {"x": torch.tensor(1.0), "ids": torch.tensor(1)}
    with pytest.raises(ReplayError, match=r"input 'x' of w has shape \(\)"):
        check_inputs(scalar, {"x": torch.randn(1), "ids": torch.zeros(1)}, label="w")
    empty = {"x": torch.randn(0, 4, 3, generator=g), "ids": torch.ones(0, dtype=torch.int64)}
    with pytest.raises(ReplayError, match=r"^w has no rows; drop it from the batch\.$"):
        check_inputs(empty, static, label="w")
    # one batched request: the whole shape must match, and the count is one request
    one = {"x": torch.randn(16, 4, 3, generator=g), "ids": torch.ones(16, dtype=torch.int64)}
    assert check_inputs(one, static, label="w", full_shape=True) == 1
    with pytest.raises(ReplayError, match=r"so it must be \[16, 4, 3\]\."):
        check_inputs(live, static, label="w", full_shape=True)
    assert check_inputs(live, static, label="w") == 5  # full_shape defaults to False


def test_config_defaults_capture_requests_and_batched_padding():
    from stepgraph.configs import BatchedCudaGraphConfig, PackedCudaGraphConfig

    x = {"x": torch.arange(6.0).view(3, 2)}
    batched = BatchedCudaGraphConfig("w", x)
    assert batched.compile is True and batched.caps_eager_batch_size is True
    reqs = batched.capture_requests(4, 4)
    assert len(reqs) == 4  # no spare slot: that is packed only
    assert all(r.keys() == x.keys() and torch.equal(r["x"], x["x"]) for r in reqs)
    pads = batched.padding_requests([1, 1], 5, 5)
    assert len(pads) == 3 and all(torch.equal(p["x"], x["x"]) for p in pads)
    with pytest.raises(ConfigError, match=r"^6 requests do not fit a key of 5 requests\.$"):
        batched.padding_requests([1] * 6, 5, 5)
    with pytest.raises(ConfigError, match=r"^capture_batch_sizes must be sorted"):
        BatchedCudaGraphConfig("w", x, capture_batch_sizes=[4, 2])
    packed = PackedCudaGraphConfig("w", [8], lambda n: {"x": torch.ones(n, 2)})
    reqs = packed.capture_requests(2, 8)
    assert [r["x"].shape[0] for r in reqs] == [4, 4, 0]  # two requests and the empty spare


def test_the_base_config_defaults():
    from stepgraph.configs import CudaGraphConfig, CudaGraphConfigType

    class Minimal(CudaGraphConfig):  # mstar's three abstract methods, nothing else
        def get_config_type(self):
            return CudaGraphConfigType.BASIC_BATCHED

        def get_node_inputs(self, bs, num_tokens):
            return [{"x": torch.ones(1)}] * bs

        def get_total_tokens(self, bs):
            return [bs]

    cfg = Minimal("w")
    assert cfg.compile is True and cfg.caps_eager_batch_size is True
    assert cfg.replay_graph_walks is None and cfg.capture_forward_method == "forward_batched"
