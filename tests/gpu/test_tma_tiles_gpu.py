"""The TMA tiles (``Tile.tma`` 1 and 2) of every fused projection on the GPU, bf16 at
Llama-3.2-1B sizes, 2 to 64 rows, split-K, with the L2 prefetch before the PDL wait: against
float64 and the pointer tiles, eagerly and captured in a graph (descriptors are kernel
parameters: a replay reads the captured copy), and with the prefetch off bit-identical."""

from __future__ import annotations

import pytest
import torch

from stepgraph.kernels.proj import proj_tiles
from stepgraph.kernels.proj.gate_up_silu import gate_up_silu, gate_up_silu_reference
from stepgraph.kernels.proj.norm_gemv import gemv_residual
from stepgraph.kernels.proj.proj_tiles import Tile
from stepgraph.kernels.proj.qkv_rope import qkv_rope, qkv_rope_reference
from stepgraph.kernels.sampling.lm_head_argmax import lm_head_argmax
from stepgraph.tuning import DecodeTuning
from tests.conftest import rel_err

DEV = "cuda"
EPS = 1e-5
H, INTER, VOCAB = 2048, 8192, 128256
BF16 = 2e-2


def randn(*shape, g, scale=1.0):
    return (scale * torch.randn(*shape, generator=g, device=DEV)).to(torch.bfloat16)


@pytest.fixture
def spy(monkeypatch):
    calls = []
    real = proj_tiles.descriptor
    monkeypatch.setattr(proj_tiles, "descriptor", lambda *a: calls.append(a) or real(*a))
    return calls


@pytest.mark.parametrize("tma", [1, 2])
@pytest.mark.parametrize("m", [2, 17, 64])
def test_tma_tiles_match_float64_and_pointers(spy, monkeypatch, tma, m):
    g = torch.Generator(DEV).manual_seed(m + 10 * tma)
    r = randn(m, H, g=g)
    nw = 1 + randn(H, g=g, scale=0.1)
    w_o = randn(H, H, g=g, scale=H**-0.5)
    w_down = randn(H, INTER, g=g, scale=INTER**-0.5)
    w_gu = randn(2 * INTER, H, g=g, scale=H**-0.5)
    a = randn(m, INTER, g=g)
    cases = [
        (
            lambda t, tu=None: gemv_residual(r, w_o, r, blocks=t, tuning=tu),
            lambda: r.double() @ w_o.double().T + r.double(),
            Tile(64, 128, 4, 3, 4),
        ),
        (
            lambda t, tu=None: gemv_residual(a, w_down, r, blocks=t, tuning=tu),
            lambda: a.double() @ w_down.double().T + r.double(),
            Tile(64, 128, 4, 3, 8),
        ),
        (
            lambda t, tu=None: gate_up_silu(r, nw, w_gu, EPS, blocks=t, tuning=tu),
            lambda: gate_up_silu_reference(r.double(), nw.double(), w_gu.double(), EPS),
            Tile(32, 128, 4, 3, 1),
        ),
    ]
    for call, ref, tile in cases:
        tma_tile = Tile(*list(tile.__dict__.values())[:5], tma)
        spy.clear()
        out = call(tma_tile)
        assert len(spy) == 3 - tma, "the TMA path did not run"
        assert rel_err(out, ref()) < BF16
        assert rel_err(out, call(tile)) < BF16
        for budget in (0, 65536):  # the prefetch (default 16 KB) moves no value
            assert torch.equal(call(tma_tile, DecodeTuning(l2_prefetch_bytes=budget)), out)
        graph = torch.cuda.CUDAGraph()
        static = call(tma_tile)
        with torch.cuda.graph(graph):
            static = call(tma_tile)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static, out)


@pytest.mark.parametrize("tma", [1, 2])
@pytest.mark.parametrize("m", [3, 64])
def test_tma_qkv_rope_and_head(spy, tma, m):
    g = torch.Generator(DEV).manual_seed(m + tma)
    n_heads, n_kv, hd, pages, ps = 32, 8, 64, 4, 64
    r = randn(m, H, g=g)
    nw = 1 + randn(H, g=g, scale=0.1)
    w = randn((n_heads + 2 * n_kv) * hd, H, g=g, scale=H**-0.5)
    pos = torch.arange(4096, device=DEV, dtype=torch.float32)
    inv = 500000.0 ** (-torch.arange(0, hd, 2, device=DEV, dtype=torch.float32) / hd)
    emb = torch.cat([pos[:, None] * inv[None, :]] * 2, dim=-1)
    cos, sin = emb.cos().bfloat16(), emb.sin().bfloat16()
    positions = torch.randint(0, 4096, (m,), generator=g, device=DEV)
    slots = torch.randperm(pages * ps, generator=g, device=DEV)[:m]
    caches = [randn(pages, ps, n_kv, hd, g=g) for _ in range(2)]
    caches += [c.clone() for c in caches]  # the reference writes its own copy
    q = qkv_rope(
        r,
        nw,
        w,
        None,
        EPS,
        positions,
        cos,
        sin,
        caches[0],
        caches[1],
        slots,
        n_heads,
        blocks=Tile(32, 128, 4, 3, 4, tma),
    )
    assert len(spy) == 3 - tma
    q_ref = qkv_rope_reference(
        r, nw, w, None, EPS, positions, cos, sin, caches[2], caches[3], slots, n_heads
    )
    assert rel_err(q, q_ref) < BF16
    assert rel_err(caches[0], caches[2]) < BF16 and rel_err(caches[1], caches[3]) < BF16
    head = randn(VOCAB, H, g=g, scale=H**-0.5)
    spy.clear()
    logits, tokens = lm_head_argmax(r, nw, head, EPS, blocks=Tile(128, 128, 4, 3, 1, tma))
    assert len(spy) == 3 - tma
    ref, _ = lm_head_argmax(r, nw, head, EPS, blocks=Tile(128, 128, 4, 3))
    assert rel_err(logits, ref) < BF16
    assert torch.equal(tokens, logits.argmax(-1))
