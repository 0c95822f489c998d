"""The configs' API as users write it: positional arguments in the declared order, and subclasses
that implement only the three abstract methods, captured and replayed by ConfigGraphRunner."""

from __future__ import annotations

import pytest
import torch

from stepgraph.configs import (
    BatchedCudaGraphConfig,
    ConfigGraphRunner,
    CudaGraphConfig,
    CudaGraphConfigType,
    PackedCudaGraphConfig,
)

D = 4


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(21)  # the tests below draw their inputs from the global generator


def test_positional_arguments_follow_mstars_order():
    one = {"x": torch.randn(2, D)}
    b = BatchedCudaGraphConfig("decode", one, ["verify"], "key", False, [1, 2], "fwd", False, 3)
    assert (b.capture_graph_walk, b.single_request_inputs) == ("decode", one)
    assert (b.replay_graph_walks, b.additional_key_info, b.compile) == (["verify"], "key", False)
    assert (b.capture_batch_sizes, b.capture_forward_method) == ([1, 2], "fwd")
    assert (b.caps_eager_batch_size, b.total_tokens_multiplier) == (False, 3)
    make = lambda n: {"x": torch.randn(n, D)}  # noqa: E731
    p = PackedCudaGraphConfig("prefill", [8, 16], make, None, 7, True, [1, 2], "fwd2", False)
    assert (p.capture_token_lengths, p.make_node_input) == ([8, 16], make)
    assert (p.additional_key_info, p.capture_batch_sizes) == (7, [1, 2])
    assert (p.capture_forward_method, p.caps_eager_batch_size) == ("fwd2", False)


class MinimalBatched(CudaGraphConfig):
    """Only mstar's three abstract methods: two tokens per request, a [2, D] input."""

    def get_config_type(self):
        return CudaGraphConfigType.BASIC_BATCHED

    def get_node_inputs(self, bs, num_tokens):
        return [{"x": torch.full((2, D), 0.5)} for _ in range(bs)]

    def get_total_tokens(self, bs):
        return [2 * bs]


class MinimalPacked(CudaGraphConfig):
    def get_config_type(self):
        return CudaGraphConfigType.FLASH_INFER_PACKED

    def get_node_inputs(self, bs, num_tokens):
        base, rem = divmod(num_tokens, bs)
        return [{"x": torch.full((base + (i < rem), D), 0.25)} for i in range(bs)]

    def get_total_tokens(self, bs):
        return [t for t in (4, 8) if t >= bs]


class Walks(torch.nn.Module):
    """A per-token map plus a per-request sum, so padding leaking into a request would show."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.randn(D, D, generator=torch.Generator().manual_seed(5))

    def forward_batched(self, *, walk, inputs):
        y = torch.tanh(inputs["x"] @ self.w)
        if "cu_seqlens" not in inputs:
            return y + y.sum(dim=1, keepdim=True)  # [bs, 2, D]
        cu = inputs["cu_seqlens"]
        seg = torch.searchsorted(cu[1:], torch.arange(y.shape[0]), right=True)
        sums = torch.zeros(cu.shape[0] - 1, D).index_add_(0, seg, y)
        return y + sums[seg]  # [T, D]


@pytest.mark.parametrize("packed", [False, True])
def test_a_config_with_only_the_three_abstract_methods_captures_and_replays(packed):
    cfg = (MinimalPacked if packed else MinimalBatched)("walk", capture_batch_sizes=[1, 2, 4])
    model = Walks()
    runner = ConfigGraphRunner(model, [cfg], device="cpu", show_progress=False)
    assert runner.graphs and runner.stats.capture is not None
    g = torch.Generator().manual_seed(6)
    for lens in ([1], [2, 1], [3, 3, 2], [1, 1, 1, 1]) if packed else ([2], [2, 2, 2]):
        reqs = [{"x": torch.randn(n, D, generator=g)} for n in lens]
        want = model.forward_batched(walk="walk", inputs=cfg.model_inputs(reqs)).clone()
        for graph in runner.graphs.values():
            graph.output.fill_(float("nan"))
        replays = runner.stats.replays
        torch.testing.assert_close(runner.run("walk", reqs), want)
        assert runner.stats.replays == replays + 1
