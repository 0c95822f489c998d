"""GPU tier: the piecewise and config runners on real CUDA graphs, against eager torch.

A small MLP-plus-eager-attention toy: the captured region projects q/k/v, runs causal attention
inside each request (segments from the declared step's ``cu_seqlens``, no host sync), then an MLP.
The reference runs each request on its own with ``scaled_dot_product_attention``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from stepgraph.configs import BatchedCudaGraphConfig, PiecewisePackedConfig, PiecewiseRunner
from stepgraph.configs.forward_runner import ConfigGraphRunner, GraphKey
from stepgraph.errors import CaptureError

pytestmark = pytest.mark.cuda

D, H = 64, 4  # model dim, heads
DEV = torch.device("cuda")
TOL = dict(rtol=2e-3, atol=2e-3)


class Toy:
    def __init__(self, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        rand = lambda *s: (torch.randn(*s, generator=g) / s[0] ** 0.5).to(DEV)
        self.wqkv, self.wo, self.w1, self.w2 = (
            rand(D, 3 * D),
            rand(D, D),
            rand(D, 4 * D),
            rand(4 * D, D),
        )
        self.steps: dict[int, torch.Tensor] = {}  # bs -> persistent cu_seqlens [bs + 1] int32

    def declare_step(self, names: list[str], seq_lens: list[int]) -> dict[str, torch.Tensor]:
        cu = self.steps.setdefault(
            len(seq_lens), torch.zeros(len(seq_lens) + 1, dtype=torch.int32, device=DEV)
        )
        host = torch.tensor([0, *seq_lens], dtype=torch.int64).cumsum(0).to(torch.int32)
        cu.copy_(host)  # in place: the graph reads this address
        return {"cu_seqlens": cu}

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.gelu(x @ self.w1) @ self.w2

    def region(self, ci) -> dict[str, torch.Tensor]:
        x = ci.static_inputs["x"]  # [T, D]
        cu = ci.resources["cu_seqlens"]  # [bs + 1] int32
        t = x.shape[0]
        pos = torch.arange(t, device=x.device)
        seg = torch.searchsorted(cu[1:], pos.to(torch.int32), right=True)  # [T] request of token
        mask = (seg[:, None] == seg[None, :]) & (pos[None, :] <= pos[:, None])  # [T, T]
        q, k, v = (x @ self.wqkv).view(t, 3, H, D // H).unbind(1)  # each [T, H, hd]
        att = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask
        )  # [H, T, hd]
        return {"y": self.mlp(x + att.transpose(0, 1).reshape(t, D) @ self.wo)}

    def reference(self, x: torch.Tensor, lens: list[int]) -> torch.Tensor:
        outs = []
        for xi in torch.split(x, lens):
            t = xi.shape[0]
            q, k, v = (xi @ self.wqkv).view(t, 3, H, D // H).unbind(1)
            att = F.scaled_dot_product_attention(
                q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
            )
            outs.append(self.mlp(xi + att.transpose(0, 1).reshape(t, D) @ self.wo))
        return torch.cat(outs)

    @torch.no_grad()
    def forward_batched(self, *, walk: str, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.mlp(inputs["h"])  # decode-like: [bs, 1, D]


def piecewise_runner(toy: Toy, capture_fn=None) -> PiecewiseRunner:
    cfg = PiecewisePackedConfig(
        capture_fn=capture_fn or toy.region,
        make_static_inputs=lambda s: {"x": torch.zeros(s.total_tokens, D, device=DEV)},
        declare_step=toy.declare_step,
        total_tokens=[16, 64],
        capture_batch_sizes=[1, 2, 4, 8],
    )
    return PiecewiseRunner(cfg, device=DEV)


@pytest.mark.parametrize(
    "lens,key",
    [
        ([5, 3, 7], (4, 16)),  # mixed lengths, padded
        ([16], (1, 16)),  # exactly on a bucket edge
        ([8, 8], (2, 16)),  # on the edge, two requests
        ([2] * 8, (8, 16)),  # on the edge at the largest bs
        ([8, 9], (4, 64)),  # one token past the edge
        ([17], (2, 64)),
        ([30, 1, 12, 9, 4], (8, 64)),
    ],
)
@torch.no_grad()
def test_piecewise_packed_equals_eager(lens, key):
    toy = Toy()
    runner = piecewise_runner(toy)
    g = torch.Generator().manual_seed(sum(lens))
    x = torch.randn(sum(lens), D, generator=g).to(DEV)
    for out in runner.outputs.values():
        out["y"].fill_(float("nan"))  # unwritten rows would show
    got = runner.replay({"x": x}, lens)["y"]
    assert got.data_ptr() == runner.outputs[key]["y"].data_ptr()
    torch.testing.assert_close(got, toy.reference(x, lens), **TOL)
    # A second, different batch on the same graph: no stale state from the first.
    x2 = torch.randn(sum(lens), D, generator=g).to(DEV)
    torch.testing.assert_close(runner.replay({"x": x2}, lens)["y"], toy.reference(x2, lens), **TOL)


@torch.no_grad()
def test_piecewise_region_returning_its_input_is_refused_on_cuda():
    toy = Toy()
    with pytest.raises(CaptureError, match="not allocated by the captured call"):
        piecewise_runner(toy, capture_fn=lambda ci: {"y": ci.static_inputs["x"]})


@pytest.mark.parametrize("compile", [False, True])
@torch.no_grad()
def test_config_runner_decode_walk_equals_eager(compile):
    toy = Toy(seed=1)
    single = {"h": torch.zeros(1, D, device=DEV)}
    sizes = [1, 2, 4] if compile else [1, 2, 4, 8, 16]
    cfg = BatchedCudaGraphConfig("decode", single, capture_batch_sizes=sizes, compile=compile)
    runner = ConfigGraphRunner(toy, [cfg], device=DEV, show_progress=False)
    assert runner.compile_enabled
    g = torch.Generator().manual_seed(2)
    for bs in range(1, sizes[-1] + 1):
        reqs = [{"h": torch.randn(1, D, generator=g).to(DEV)} for _ in range(bs)]
        want = toy.forward_batched(walk="decode", inputs=cfg.model_inputs(reqs)).clone()
        for graph in runner.graphs.values():
            graph.output.fill_(float("nan"))
        got = runner.run("decode", reqs)
        torch.testing.assert_close(got, want, **TOL)
    assert runner.stats.eager_calls == 0
    assert set(runner.graphs) == {GraphKey("decode", b, b, None) for b in sizes}
