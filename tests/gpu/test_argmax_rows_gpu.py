"""``argmax_rows`` on the GPU against ``torch.argmax``: LM-head-sized rows (vocab 128256 and
151936), float32 and bf16, ties and special values, inside a graph into a poisoned buffer."""

from __future__ import annotations

import pytest
import torch

from stepgraph.kernels.sampling.argmax_rows import argmax_rows

pytestmark = pytest.mark.cuda
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,v", [(1, 128256), (8, 128256), (33, 151936), (64, 128256)])
def test_equals_torch_argmax(m, v, dtype):
    g = torch.Generator(device="cuda").manual_seed(m + v)
    x = ((torch.randn(m, v, device="cuda", generator=g) * 4).round() / 4).to(dtype)
    x[0, -1] = x[0].max()  # a tie with the last column: the first occurrence wins
    if m > 2:
        x[1, 77] = float("nan")
        x[2] = float("-inf")
    out = torch.full((m,), -7, dtype=torch.int64, device="cuda")
    argmax_rows(x, out)
    assert torch.equal(out, torch.argmax(x, -1))


def test_replays_in_a_graph_on_fresh_logits():
    x = torch.randn(8, 128256, device="cuda")
    out = torch.full((8,), -7, dtype=torch.int64, device="cuda")
    argmax_rows(x, out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        argmax_rows(x, out)
    for seed in range(3):
        g = torch.Generator("cuda").manual_seed(seed)
        x.copy_(torch.randn(8, 128256, device="cuda", generator=g))
        out.fill_(-7)
        graph.replay()
        assert torch.equal(out, torch.argmax(x, -1)), seed
