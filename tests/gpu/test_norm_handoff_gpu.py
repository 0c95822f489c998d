"""The norm handoff (``kernels/proj/norm_handoff``) compiled, bf16 at Llama-3.2-1B sizes, rows 2 to
64 with the committed tiles (split-K, TMA): what ``gemv_residual(..., next_norm=w)`` leaves
(``xw = y * w`` and the sums of squares) against torch and float64 sums of the y it wrote, and
each consumer (``qkv_rope``, ``gate_up_silu``, the LM head) given them against float64 and
against its own norm prologue. In a graph too: a replay with new inputs in the same buffers
gives what an eager call gives, bit for bit."""

from __future__ import annotations

import pytest
import torch

from stepgraph.kernels.proj.gate_up_silu import gate_up_silu, gate_up_silu_reference
from stepgraph.kernels.proj.norm_gemv import gemv_residual
from stepgraph.kernels.proj.proj_tiles import tile_for
from stepgraph.kernels.proj.qkv_rope import qkv_rope
from stepgraph.kernels.sampling.lm_head_argmax import lm_head_argmax
from tests.conftest import rel_err
from tests.references import check_qkv_rope, rms64

DEV = "cuda"
EPS = 1e-5
H, INTER, VOCAB, HEADS, KV, HD = 2048, 8192, 128256, 32, 8, 64
BF16 = 2e-2


def randn(*shape, g, scale=1.0):
    return (scale * torch.randn(*shape, generator=g, device=DEV)).to(torch.bfloat16)


def tile_sums(y: torch.Tensor, block_n: int) -> torch.Tensor:
    yd = y.double()
    return torch.stack([(c * c).sum(-1) for c in yd.split(block_n, dim=-1)], dim=-1)


@pytest.mark.parametrize("m", [2, 8, 17, 32, 64])
def test_residual_sums_and_consumers(m):
    g = torch.Generator(DEV).manual_seed(m)
    a, r = randn(m, INTER, g=g), randn(m, H, g=g)
    w_down = randn(H, INTER, g=g, scale=INTER**-0.5)
    nw = 1 + randn(H, g=g, scale=0.1)
    y, xw, sums = gemv_residual(a, w_down, r, next_norm=nw)
    assert torch.equal(y, gemv_residual(a, w_down, r))
    assert torch.equal(xw, (y.float() * nw.float()).bfloat16())
    block_n = tile_for("gemv_residual", m, H, INTER).block_n
    assert sums.shape == (m, H // block_n)
    assert rel_err(sums, tile_sums(y, block_n)) < 1e-6
    # -- gate-up + SiLU from the sums: float64 and the prologue kernel agree --
    w_gu = randn(2 * INTER, H, g=g, scale=H**-0.5)
    got = gate_up_silu(xw, None, w_gu, EPS, ssq=sums)
    want = gate_up_silu_reference(y.double(), nw.double(), w_gu.double(), EPS)
    assert rel_err(got, want) < BF16
    assert rel_err(got, gate_up_silu(y, nw, w_gu, EPS)) < BF16
    # -- the LM head: logits and tokens --
    w_lm = randn(VOCAB, H, g=g, scale=H**-0.5)
    logits, tokens = lm_head_argmax(xw, None, w_lm, EPS, ssq=sums)
    ref = rms64(y, nw, EPS) @ w_lm.double().T
    assert rel_err(logits, ref) < BF16
    assert (tokens == logits.argmax(-1)).all()
    half, _ = lm_head_argmax(xw, None, w_lm, EPS, ssq=4 * sums)  # it reads them: half the norm
    assert rel_err(half, 0.5 * ref) < BF16


@pytest.mark.parametrize("m", [2, 8, 16])
def test_qkv_rope_from_sums(m):
    g = torch.Generator(DEV).manual_seed(50 + m)
    o, r = randn(m, H, g=g), randn(m, H, g=g)
    w_o = randn(H, H, g=g, scale=H**-0.5)
    nw = 1 + randn(H, g=g, scale=0.1)
    y, xw, sums = gemv_residual(o, w_o, r, next_norm=nw)
    w = randn((HEADS + 2 * KV) * HD, H, g=g, scale=H**-0.5)
    pages, page = 8, 16
    k_cache = randn(pages, page, KV, HD, g=g)
    v_cache = randn(pages, page, KV, HD, g=g)
    caches0 = (k_cache.clone(), v_cache.clone())
    slots = torch.randperm(pages * page, device=DEV)[:m]
    pos = torch.randint(0, 500, (m,), device=DEV)
    inv = 500000.0 ** (-torch.arange(0, HD, 2, device=DEV).double() / HD)
    ang = torch.arange(512, device=DEV).double()[:, None] * inv[None, :]
    cos_t, sin_t = torch.cos(ang).repeat(1, 2).bfloat16(), torch.sin(ang).repeat(1, 2).bfloat16()
    q = qkv_rope(
        xw, None, w, None, EPS, pos, cos_t, sin_t, k_cache, v_cache, slots, HEADS, ssq=sums
    )
    qkv = rms64(y, nw, EPS) @ w.double().T
    check_qkv_rope(q, qkv, pos, cos_t, sin_t, (k_cache, v_cache), caches0, slots, HEADS, BF16)


def test_graph_replay_equals_eager():
    m = 8
    g = torch.Generator(DEV).manual_seed(3)
    a, r = randn(m, INTER, g=g), randn(m, H, g=g)
    w_down = randn(H, INTER, g=g, scale=INTER**-0.5)
    w_gu = randn(2 * INTER, H, g=g, scale=H**-0.5)
    nw = 1 + randn(H, g=g, scale=0.1)

    def step():
        _, xw, sums = gemv_residual(a, w_down, r, next_norm=nw)
        return gate_up_silu(xw, None, w_gu, EPS, ssq=sums)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    a.copy_(randn(m, INTER, g=g))
    r.copy_(randn(m, H, g=g))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, step())
