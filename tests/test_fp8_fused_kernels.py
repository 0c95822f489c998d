"""The fused decode-step kernels streaming FP8 weights (``W_FP8``: e4m3 data converted in
registers, per-channel scales applied to the sums) under the Triton interpreter, one row and
tensor-core rows, split K, against float64 references over the dequantized weights; edges: K not
a multiple of the chunk, a scale of 0 and a huge one; refusals on the host."""

from __future__ import annotations

import pytest
import torch

from stepgraph.errors import ConfigError
from stepgraph.kernels.proj.gate_up_silu import gate_up_silu
from stepgraph.kernels.proj.norm_gemv import gemv_residual
from stepgraph.kernels.proj.proj_tiles import act_e4m3, as_tile, tile_for
from stepgraph.model.fp8_weight import quantize_per_channel
from tests.conftest import rel_err
from tests.references import rms64

from .test_fp8_tiles import check_qkv_rope_fp8
from .test_fused_step_kernels import EPS, inputs

TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


def fp8(w: torch.Tensor, zero_row: int | None = None, huge_row: int | None = None):
    """``w`` per channel in e4m3: ``(data, scale, the float64 dequantized weight)``; a row's
    scale set to 0 or to 1e30 (its dequantized values follow)."""
    q = quantize_per_channel(w.float())
    scale = q.scale.clone()
    if zero_row is not None:
        scale[zero_row] = 0.0
    if huge_row is not None:
        scale[huge_row] = 1e30
    return q.data, scale, q.data.double() * scale.double()[:, None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "m, k, n, blocks",
    [(1, 72, 36, (8, 32, 4)), (3, 40, 24, (16, 16, 4)), (2, 100, 24, (16, 32, 4, 3, 2))],
)  # K 72 and 100: the last chunk partial; (.., 2): split K
def test_gemv_residual_fp8(nan_empty, dtype, m, k, n, blocks):
    x, _, w, _ = inputs(m, k, n, dtype, m + k + n)
    data, scale, w64 = fp8(w, zero_row=1)
    res = torch.randn(m, n, generator=torch.Generator().manual_seed(1)).to(dtype)
    y = gemv_residual(x, data, res, blocks=blocks, w_scale=scale)
    ref = x.double() @ w64.T + res.double()
    assert rel_err(y, ref) < TOL[dtype]
    assert torch.equal(y[:, 1], res[:, 1])  # scale 0: the projection is 0, the residual stays
    y2, xw, ssq = gemv_residual(
        x, data, res, blocks=blocks, w_scale=scale, next_norm=torch.ones(n, dtype=dtype)
    )
    assert torch.equal(y2, y) and torch.equal(xw, y)
    assert rel_err(ssq.double().sum(1), y.double().pow(2).sum(1)) < TOL[dtype]


def test_a_huge_scale_reaches_the_output_unclipped(nan_empty):
    x, _, w, _ = inputs(1, 48, 16, torch.float32, 3)
    data, scale, w64 = fp8(w, huge_row=2)
    y = gemv_residual(x, data, None, blocks=(8, 16, 4), w_scale=scale)
    ref = x.double() @ w64.T
    assert rel_err(y, ref) < 1e-5 and y[0, 2].abs() > 1e25


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "m, k, inter, blocks", [(1, 64, 24, (4, 32, 4)), (3, 40, 12, None), (3, 72, 16, (16, 32, 4))]
)
def test_gate_up_silu_fp8(nan_empty, dtype, m, k, inter, blocks):
    x, nw, w, _ = inputs(m, k, 2 * inter, dtype, m * inter + k)
    data, scale, w64 = fp8(w, zero_row=inter + 2)  # an up row: that output is 0
    out = gate_up_silu(x, nw, data, EPS, blocks=blocks, w_scale=scale)
    tile = as_tile(blocks) if blocks else tile_for("gate_up_silu", m, 2 * inter, k, 2, fp8=True)
    xin = rms64(x, nw)
    if act_e4m3(tile, m, True, x):  # the rule's tile from 2 rows in float16: W8A8
        from .test_fp8_tiles import quantized_x

        xf = x.float()
        xn = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(dtype).float()
        xin = quantized_x((xn * nw.float()).to(dtype), tile.block_k)
    gate, up = (xin @ w64.T).split(inter, dim=-1)
    ref = gate * torch.sigmoid(gate) * up
    assert out.shape == (m, inter) and out.dtype == dtype
    assert rel_err(out, ref) < 2 * TOL[dtype]
    assert torch.all(out[:, 2] == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "m, bias, blocks", [(3, True, (16, 16, 4)), (1, False, None), (1, True, (4, 16, 4))]
)
def test_qkv_rope_fp8(nan_empty, dtype, m, bias, blocks):
    n_heads, n_kv, hd, pages, ps, k = 4, 2, 16, 5, 8, 40
    n = (n_heads + 2 * n_kv) * hd
    x, nw, w, b = inputs(m, k, n, dtype, 7 * m, bias)
    data, scale, w64 = fp8(w)
    qkv = rms64(x, nw) @ w64.T + (b.double() if bias else 0)
    positions = torch.tensor([5, 0, 63][:m])
    slots = torch.tensor([ps - 1, ps, 4 * ps + 3][:m])
    shape = (n_heads, n_kv, hd), (pages, ps)
    check_qkv_rope_fp8(
        x, nw, data, scale, blocks, qkv, b, *shape, positions, slots, tol=2 * TOL[dtype]
    )


def test_fp8_weights_and_scales_go_together():
    x, nw, w, _ = inputs(1, 32, 16, torch.float32, 1)
    data, scale, _ = fp8(w)
    with pytest.raises(ConfigError, match="needs its scales"):
        gemv_residual(x, data, None)
    with pytest.raises(ConfigError, match="needs its scales"):
        gate_up_silu(x, nw, w, EPS, w_scale=scale)
    with pytest.raises(ConfigError, match=r"float32 \[16\]"):
        gemv_residual(x, data, None, w_scale=scale[:8])
    with pytest.raises(ConfigError, match=r"float32 \[16\]"):
        gemv_residual(x, data, None, w_scale=scale.double())
