"""Capture configs (mstar's ``cuda_graph_config`` API): every method on hand-checked examples,
every validation error."""

from __future__ import annotations

import inspect

import pytest
import torch

from stepgraph.configs import (
    CU_SEQLENS,
    BatchedCudaGraphConfig,
    CudaGraphConfig,
    CudaGraphConfigType,
    PackedCudaGraphConfig,
    PiecewiseBatchedConfig,
    PiecewiseCallInputs,
    PiecewiseCaptureShape,
    PiecewiseConfigType,
    PiecewiseCudaGraphConfig,
    PiecewisePackedConfig,
    distribute_tokens,
    pad_lengths,
)
from stepgraph.errors import ConfigError


def make_req(n: int) -> dict[str, torch.Tensor]:
    # token ids [n] int64 and features [n, 3]; values encode n so the layout is checkable
    return {"ids": torch.full((n,), n, dtype=torch.int64), "h": torch.full((n, 3), float(n))}


def batched(**kw):
    single = {"ids": torch.tensor([7]), "h": torch.ones(1, 3)}
    return BatchedCudaGraphConfig("decode", single, **kw)


def packed(**kw):
    return PackedCudaGraphConfig("prefill", kw.pop("tokens", [4, 8, 16]), make_req, **kw)


def region(ci):
    return {"y": ci.static_inputs["x"] * 2}


def pw_batched(**kw):
    kw.setdefault("seq_len", 4)
    return PiecewiseBatchedConfig(capture_fn=region, make_static_inputs=dict, **kw)


def pw_packed(**kw):
    kw.setdefault("total_tokens", [4, 8])
    return PiecewisePackedConfig(capture_fn=region, make_static_inputs=dict, **kw)


def test_distribute_tokens_hand_checked():
    assert distribute_tokens(10, 3) == [4, 3, 3]
    assert distribute_tokens(8, 4) == [2, 2, 2, 2]
    assert distribute_tokens(5, 1) == [5]
    with pytest.raises(ConfigError, match="at least one token"):
        distribute_tokens(2, 3)


def test_enums_and_defaults_follow_mstars_api():
    assert CudaGraphConfigType.BASIC_BATCHED.value == "basic_batched"
    assert CudaGraphConfigType.FLASH_INFER_PACKED.value == "flash_infer_packed"
    assert PiecewiseConfigType.BATCHED.value == "batched"
    assert PiecewiseConfigType.PACKED.value == "packed"
    c = batched()
    assert (c.replay_graph_walks, c.additional_key_info, c.compile) == (None, None, True)
    assert (c.capture_batch_sizes, c.capture_forward_method) == (None, "forward_batched")
    assert c.caps_eager_batch_size is True and c.total_tokens_multiplier == 1
    assert list(inspect.signature(BatchedCudaGraphConfig).parameters)[:2] == [
        "capture_graph_walk",
        "single_request_inputs",
    ]
    assert list(inspect.signature(PackedCudaGraphConfig).parameters)[:3] == [
        "capture_graph_walk",
        "capture_token_lengths",
        "make_node_input",
    ]
    p = pw_batched()
    assert p.declare_step is None and p.lease_before_step is False and p.compile is False
    assert p.forward_kwargs == {} and p.capture_batch_sizes is None
    with pytest.raises(TypeError):
        CudaGraphConfig("x")  # abstract
    with pytest.raises(TypeError):
        PiecewiseCudaGraphConfig(capture_fn=region, make_static_inputs=dict)  # abstract
    with pytest.raises(TypeError):
        PiecewiseBatchedConfig(region, dict, seq_len=4)  # kw_only


def test_batched_config_methods():
    c = batched(total_tokens_multiplier=3, replay_graph_walks=["verify"])
    assert c.get_config_type() is CudaGraphConfigType.BASIC_BATCHED
    assert c.get_total_tokens(5) == [15]
    assert c.walks == ["decode", "verify"]
    reqs = c.get_node_inputs(4, 12)
    assert len(reqs) == 4 and all(torch.equal(r["ids"], torch.tensor([7])) for r in reqs)
    with pytest.raises(ConfigError, match="get_total_tokens"):
        c.get_node_inputs(4, 13)
    a = {"ids": torch.tensor([1]), "h": torch.zeros(1, 3)}
    b = {"ids": torch.tensor([2]), "h": torch.ones(1, 3)}
    pads = c.padding_requests([3, 3], 4, 12)
    inputs = c.model_inputs([a, b, *pads])
    assert inputs["ids"].tolist() == [[1], [2], [7], [7]]  # [bs, tokens_per_request]
    assert inputs["h"].shape == (4, 1, 3)
    assert c.batch_sizes()[:5] == [1, 2, 4, 8, 16]
    assert batched(capture_batch_sizes=[2, 3]).batch_sizes() == [2, 3]


def test_packed_config_methods():
    c = packed(capture_batch_sizes=[1, 2, 8])
    assert c.get_config_type() is CudaGraphConfigType.FLASH_INFER_PACKED
    assert c.get_total_tokens(1) == [4, 8, 16]
    assert c.get_total_tokens(8) == [8, 16]  # total < bs is skipped
    reqs = c.get_node_inputs(3, 10)
    assert [r["ids"].shape[0] for r in reqs] == [4, 3, 3]
    inputs = c.model_inputs(reqs)
    assert inputs["ids"].tolist() == [4] * 4 + [3] * 6
    assert inputs["h"].shape == (10, 3)
    assert inputs[CU_SEQLENS].tolist() == [0, 4, 7, 10]
    assert inputs[CU_SEQLENS].dtype == torch.int32
    # padding: 2 real requests (5 + 2 tokens) into (bs=4, total=12) -> 2 padded requests of
    # 1 token, then the spare slot with the 3 left over
    pads = c.padding_requests([5, 2], 4, 12)
    assert [p["ids"].shape[0] for p in pads] == [1, 1, 3]
    assert [p["ids"].shape[0] for p in c.padding_requests([5, 3], 2, 8)] == [0]  # spare only
    with pytest.raises(ConfigError, match="do not fit"):
        c.padding_requests([5, 4], 2, 8)  # 9 tokens > 8
    with pytest.raises(ConfigError, match="do not fit"):
        c.padding_requests([1, 1, 1], 2, 8)  # 3 requests > 2
    # the capture-time batch of a key carries the empty spare slot
    assert [r["ids"].shape[0] for r in c.capture_requests(3, 10)] == [4, 3, 3, 0]
    assert c.template()["h"].shape == (4, 3)
    assert packed().batch_sizes() == [1, 2, 4, 8, 16]  # capped by the largest token bucket


def test_pad_lengths_rule():
    # (tokens, real requests, key bs, key tokens) -> padded requests + the spare, last
    assert pad_lengths(7, 2, 4, 12) == [1, 1, 3]
    assert pad_lengths(7, 2, 2, 7) == [0]  # exactly full: the spare is empty
    assert pad_lengths(7, 2, 3, 8) == [1, 0]
    assert pad_lengths(7, 2, 2, 8) == [1]  # a leftover token and no padded request: the spare
    assert pad_lengths(7, 2, 5, 9) == [1, 1, 0, 0]  # tokens run out: padded requests get 0
    assert pad_lengths(7, 3, 2, 9) is None  # 3 requests > 2
    assert pad_lengths(10, 2, 4, 9) is None  # 10 tokens > 9
    assert pad_lengths(0, 0, 4, 9) is None  # nothing to run
    # every fitting batch fills the key exactly, with no negative length
    for n in range(1, 13):
        for real in range(1, 5):
            for bs in range(1, 5):
                lens = pad_lengths(n, real, bs, 12)
                assert (lens is not None) == (real <= bs and n <= 12)
                if lens is not None:
                    assert len(lens) == bs - real + 1 and min(lens) >= 0
                    assert n + sum(lens) == 12


def test_piecewise_shapes():
    b = pw_batched()
    assert b.get_config_type() is PiecewiseConfigType.BATCHED
    assert b.get_capture_shapes([1, 3]) == [
        PiecewiseCaptureShape(1, [4], 4),
        PiecewiseCaptureShape(3, [4, 4, 4], 12),
    ]
    p = pw_packed(total_tokens=[3, 10])
    assert p.get_config_type() is PiecewiseConfigType.PACKED
    assert p.get_capture_shapes([1, 3, 4]) == [  # each packed shape ends in the spare slot
        PiecewiseCaptureShape(1, [3, 0], 3),
        PiecewiseCaptureShape(1, [10, 0], 10),
        PiecewiseCaptureShape(3, [1, 1, 1, 0], 3),
        PiecewiseCaptureShape(3, [4, 3, 3, 0], 10),
        PiecewiseCaptureShape(4, [4, 2, 2, 2, 0], 10),  # (4, 3) skipped: 3 tokens < 4 requests
    ]
    assert p.get_capture_shapes([4])[0].num_requests == 5
    with pytest.raises(ConfigError, match="sorted"):
        p.get_capture_shapes([2, 1])


def test_replay_seq_lens_padding():
    b = pw_batched()
    shape = PiecewiseCaptureShape(4, [4] * 4, 16)
    assert b.replay_seq_lens(shape, None, 2) == [4, 4, 1, 1]
    assert b.replay_seq_lens(shape, [3, 1, 2], 3) == [3, 1, 2, 1]
    with pytest.raises(ConfigError, match="1..4"):
        b.replay_seq_lens(shape, [5], 1)
    with pytest.raises(ConfigError, match="real_bs"):
        b.replay_seq_lens(shape, None, 5)
    p = pw_packed(total_tokens=[12])
    shape = PiecewiseCaptureShape(4, [3, 3, 3, 3, 0], 12)
    assert p.replay_seq_lens(shape, [5, 2], 2) == [5, 2, 1, 1, 3]
    assert p.replay_seq_lens(shape, [5, 2, 1], 3) == [5, 2, 1, 1, 3]
    assert p.replay_seq_lens(shape, [3, 3, 3, 3], 4) == [3, 3, 3, 3, 0]  # exactly on the edge
    assert p.replay_seq_lens(shape, [3, 3, 3, 2], 4) == [3, 3, 3, 2, 1]  # the spare holds 1
    with pytest.raises(ConfigError, match="do not fit"):
        p.replay_seq_lens(shape, [7, 3, 3], 3)  # 13 tokens > 12
    with pytest.raises(ConfigError, match="needs seq_lens"):
        p.replay_seq_lens(shape, None, 2)


def test_call_inputs_resources():
    ci = PiecewiseCallInputs({"x": torch.zeros(1)}, None)
    assert ci.kwargs == {} and ci.resources == {}
    t = torch.ones(2)
    assert PiecewiseCallInputs({}, None, step={"lens": t}).resources["lens"] is t

    class Step:
        resources = {"lens": t}

    assert PiecewiseCallInputs({}, None, step=Step()).resources == {"lens": t}
    with pytest.raises(ConfigError, match="resources"):
        _ = PiecewiseCallInputs({}, None, step=3).resources


@pytest.mark.parametrize(
    "build,match",
    [
        (lambda: batched(capture_batch_sizes=[]), "empty"),
        (lambda: batched(capture_batch_sizes=[0, 1]), "positive"),
        (lambda: batched(capture_batch_sizes=[4, 2]), "sorted"),
        (lambda: batched(capture_batch_sizes=[2, 2]), "duplicates"),
        (lambda: batched(total_tokens_multiplier=0), "total_tokens_multiplier"),
        (lambda: BatchedCudaGraphConfig("", {"x": torch.ones(1)}), "capture_graph_walk"),
        (lambda: BatchedCudaGraphConfig("d", {}), "empty"),
        (lambda: BatchedCudaGraphConfig("d", {CU_SEQLENS: torch.ones(1)}), "reserved"),
        (lambda: BatchedCudaGraphConfig("d", lambda: None), "must be a dict of input name"),
        (lambda: batched(replay_graph_walks="decode"), r"replay_graph_walks .* \['decode'\]"),
        (lambda: batched(replay_graph_walks=["a", ""]), "replay_graph_walks"),
        (lambda: batched(capture_forward_method=None), "capture_forward_method"),
        (lambda: batched(compile="yes"), "compile must be True or False"),
        (lambda: packed(tokens=[4], caps_eager_batch_size=1), "caps_eager_batch_size"),
        (lambda: packed(tokens=[]), "capture_token_lengths is empty"),
        (lambda: packed(tokens=[8, 4]), "sorted"),
        (lambda: packed(tokens=[-1, 4]), "positive"),
        (lambda: pw_batched(capture_batch_sizes=[1, 1]), "duplicates"),
        (
            lambda: PiecewiseBatchedConfig(capture_fn=region, make_static_inputs=dict, seq_len=0),
            "seq_len",
        ),
        (lambda: pw_batched(declare_step=3), "declare_step must be a callable"),
        (lambda: pw_batched(compile=1), "compile must be True or False"),
        (lambda: pw_batched(lease_before_step="no"), "lease_before_step"),
        (lambda: pw_batched(forward_kwargs=[("a", 1)]), "forward_kwargs must be a dict"),
        (
            lambda: PiecewiseBatchedConfig(
                capture_fn=region, make_static_inputs=dict, seq_len=True
            ),
            "seq_len",
        ),
        (lambda: pw_packed(total_tokens=[]), "total_tokens is empty"),
        (lambda: pw_packed(total_tokens=[8, 8]), "duplicates"),
    ],
)
def test_validation_errors(build, match):
    with pytest.raises(ConfigError, match=match):
        build()
