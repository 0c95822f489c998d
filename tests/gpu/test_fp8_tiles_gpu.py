"""FP8 weights' own tiles on a real GPU: every loop form a tile can take (the pointer loop, TMA
swap-AB, TMA with x from pointers, swap-AB through pointers; W8A8 in three of them) compiled for
e4m3 weights at the llama-3.2-1b shapes and checked against float64 over the dequantized weights
(W8A8: over x quantized as the kernel does), at 1 to 64 rows; the launchers' own tiles
(``FP8_TILES`` or the rule) alike; a scale of 0 and a huge one reach the output as the float64
reference says.

Nothing touches CUDA at import time: without a GPU the module imports and every test skips.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from stepgraph.kernels.proj.gate_up_silu import gate_up_silu
from stepgraph.kernels.proj.norm_gemv import gemv_residual
from stepgraph.kernels.proj.proj_tiles import SWAP_POINTERS, Tile, act_e4m3, tile_for
from stepgraph.kernels.proj.qkv_rope import qkv_rope
from stepgraph.model.fp8_weight import quantize_per_channel
from tests.test_fp8_tiles import quantized_x

pytestmark = pytest.mark.cuda

DEV, DT, EPS = "cuda", torch.bfloat16, 1e-5
FORMS = [  # (block_n, block_k, warps, stages, split_k, tma[, a8]): every loop form, W8A16 and
    # W8A8 (the sweep's candidates: their compiles are cached by then)
    Tile(64, 256, 4, 3, 4, SWAP_POINTERS),
    Tile(64, 256, 4, 3, 4, 1),
    Tile(32, 128, 4, 4, 4, 2),
    Tile(32, 256, 4, 3, 4, 0),
    Tile(64, 128, 4, 4, 4, SWAP_POINTERS, 1),
    Tile(64, 128, 4, 4, 4, 1, 1),
    Tile(32, 128, 4, 4, 4, 0, 1),
]


def _fp8(n, k, g, zero_row=None, huge_row=None):
    q = quantize_per_channel(torch.randn(n, k, device=DEV, generator=g) * k**-0.5)
    scale = q.scale.clone()
    if zero_row is not None:
        scale[zero_row] = 0.0
    if huge_row is not None:
        scale[huge_row] = 1e20
    return q.data, scale, q.data.double() * scale.double()[:, None]


def _rel(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


def _x_seen(x, tile, kernel, m, n, k):
    """x as the launched tile sees it: quantized per row per chunk for W8A8 tiles (the
    reference then differs from the kernel by float32 sums only), else x itself."""
    t = tile or tile_for(kernel, m, n, k, x.element_size(), fp8=True)
    return quantized_x(x, t.block_k) if act_e4m3(t, m, True, x) else x.double()


@pytest.mark.parametrize("m", [2, 17, 64])
@pytest.mark.parametrize("tile", [*FORMS, None], ids=lambda t: "own" if t is None else str(t))
@pytest.mark.parametrize("n, k", [(2048, 2048), (2048, 8192)])
def test_gemv_residual_fp8_forms(m, tile, n, k):
    g = torch.Generator(device=DEV).manual_seed(m + n + k)
    data, scale, w64 = _fp8(n, k, g, zero_row=5)
    x = torch.randn(m, k, device=DEV, generator=g).to(DT)
    res = torch.randn(m, n, device=DEV, generator=g).to(DT)
    y = gemv_residual(x, data, res, blocks=tile, w_scale=scale)
    ref = _x_seen(x, tile, "gemv_residual", m, n, k) @ w64.T + res.double()
    assert _rel(y, ref) < 1e-2
    assert torch.equal(y[:, 5], res[:, 5])  # scale 0: the residual alone


@pytest.mark.parametrize("m", [1, 8, 64])
@pytest.mark.parametrize("tile", [FORMS[0], FORMS[1], FORMS[4], None], ids=lambda t: str(t))
def test_gate_up_fp8_forms(m, tile):
    if m == 1 and tile is not None:
        pytest.skip("one row: the GEMV")
    g = torch.Generator(device=DEV).manual_seed(m)
    inter, k = 8192, 2048
    data, scale, w64 = _fp8(2 * inter, k, g, huge_row=3)
    x = torch.randn(m, k, device=DEV, generator=g).to(DT)
    out = gate_up_silu(x, None, data, EPS, blocks=tile, w_scale=scale)
    gate, up = (_x_seen(x, tile, "gate_up_silu_normed", m, 2 * inter, k) @ w64.T).split(inter, -1)
    ref = F.silu(gate) * up
    keep = torch.ones(inter, dtype=torch.bool, device=DEV)
    keep[3] = False  # the huge gate row (scale 1e20): alone, or it would hide the others
    assert _rel(out[:, keep], ref[:, keep]) < 1e-2
    assert _rel(out[:, 3], ref[:, 3]) < 1e-2 and out[:, 3].abs().max() > 1e15


@pytest.mark.parametrize("m", [1, 8, 64])
@pytest.mark.parametrize(
    "tile",
    [
        Tile(32, 256, 4, 3, 8, SWAP_POINTERS),
        Tile(32, 256, 4, 3, 4, 1),
        Tile(32, 128, 4, 4, 8, 3, 1),
        None,
    ],
    ids=str,
)
def test_qkv_rope_normed_fp8_forms(m, tile):
    if m == 1 and tile is not None:
        pytest.skip("one row: the GEMV")
    g = torch.Generator(device=DEV).manual_seed(m + 1)
    nh, nkv, hd, k = 32, 8, 64, 2048
    data, scale, w64 = _fp8((nh + 2 * nkv) * hd, k, g)
    x = torch.randn(m, k, device=DEV, generator=g).to(DT)
    pos = torch.randint(0, 512, (m,), device=DEV, generator=g)
    cos = torch.randn(512, hd, device=DEV, generator=g).to(DT)
    sin = torch.randn(512, hd, device=DEV, generator=g).to(DT)
    kc = torch.zeros(m + 2, 64, nkv, hd, device=DEV, dtype=DT)
    vc = torch.zeros_like(kc)
    slots = torch.arange(m, device=DEV) * 64 + 1
    q = qkv_rope(
        x, None, data, None, EPS, pos, cos, sin, kc, vc, slots, nh, blocks=tile, w_scale=scale
    )
    qkv = _x_seen(x, tile, "qkv_rope_normed", m, (nh + 2 * nkv) * hd, k) @ w64.T
    qr = qkv[:, : nh * hd].view(m, nh, hd)
    half = hd // 2
    c, s = cos.double()[pos][:, None], sin.double()[pos][:, None]
    rot = torch.cat([-qr[..., half:], qr[..., :half]], -1)
    assert _rel(q, qr * c + rot * s) < 2e-2
    v = qkv[:, (nh + nkv) * hd :].view(m, nkv, hd)
    assert _rel(vc.view(-1, nkv, hd)[slots], v) < 1e-2
