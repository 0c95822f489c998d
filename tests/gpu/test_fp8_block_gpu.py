"""FP8 weights with 128 x 128 block scales (Hugging Face's fine-grained layout) in the fused
decode step on a real GPU: the fused kernels at the llama-3.2-1b shapes against float64 over
the dequantized weights (from two rows, over x scaled by each row block's scales and rounded
to e4m3 as the W8A8 tiles do), with the tiles the step plan gives them; the 1B's plan fused at
every bucket; one bf16 row within e4m3's weight error. The float32 step and exact against
eager with block scales: ``test_fp8_step_gpu.py``, beside per-channel scales.

Nothing touches CUDA at import time: without a GPU the module imports and every test skips.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from stepgraph.kernels.proj.block_scales import block_tile
from stepgraph.kernels.proj.gate_up_silu import gate_up_silu
from stepgraph.kernels.proj.norm_gemv import gemv_residual
from stepgraph.kernels.proj.proj_tiles import act_e4m3, tile_for
from stepgraph.kernels.proj.qkv_rope import qkv_rope, qkv_tile
from stepgraph.model.decode.fused_decode import step_plan
from tests.gpu.test_fp8_step_gpu import _dequantized_twin, _logits, _runner
from tests.test_fp8_block_fused import fp8_blocks, w8a8_reference

pytestmark = pytest.mark.cuda

DEV, DT, EPS, BLOCK = "cuda", torch.bfloat16, 1e-5, (128, 128)


def _rel(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


def _tile(kernel, m, n, k):
    return block_tile(tile_for(kernel, m, n, k, 2, fp8=True), m, 2)


def _seen(x, data, scale, tile, m, w64):
    """The float64 product the launched tile computes: W8A8 over x scaled per row block, or
    x itself against the dequantized weight (one row)."""
    if act_e4m3(tile, m, True, x):
        return w8a8_reference(x, data, scale, BLOCK, tile.block_k)
    return x.double() @ w64.T


@pytest.mark.parametrize("m", [1, 8, 32, 64])
@pytest.mark.parametrize("n, k", [(2048, 2048), (2048, 8192)])
def test_gemv_residual_block_scales_at_model_shapes(nan_empty, m, n, k):
    g = torch.Generator(device=DEV).manual_seed(m + n + k)
    w = torch.randn(n, k, device=DEV, generator=g) * k**-0.5
    data, scale, w64 = fp8_blocks(w, BLOCK, zero=(1, 3))
    x = torch.randn(m, k, device=DEV, generator=g).to(DT)
    res = torch.randn(m, n, device=DEV, generator=g).to(DT)
    tile = _tile("gemv_residual", m, n, k)
    y = gemv_residual(x, data, res, w_scale=scale, w_block=BLOCK)
    assert _rel(y, _seen(x, data, scale, tile, m, w64) + res.double()) < 1e-2
    assert _rel(y, x.double() @ w64.T + res.double()) < 6e-2  # e4m3's 4 bits of x, from 2 rows


@pytest.mark.parametrize("m", [1, 8, 64])
def test_gate_up_block_scales_at_model_shapes(nan_empty, m):
    g = torch.Generator(device=DEV).manual_seed(m)
    inter, k = 8192, 2048
    w = torch.randn(2 * inter, k, device=DEV, generator=g) * k**-0.5
    data, scale, w64 = fp8_blocks(w, BLOCK, zero=(64, 2))  # an up block
    x = torch.randn(m, k, device=DEV, generator=g).to(DT)
    tile = _tile("gate_up_silu_normed", m, 2 * inter, k)
    out = gate_up_silu(x, None, data, EPS, w_scale=scale, w_block=BLOCK)
    gate, up = _seen(x, data, scale, tile, m, w64).split(inter, -1)
    assert _rel(out, F.silu(gate) * up) < 1e-2


@pytest.mark.parametrize("m", [1, 8, 64])
def test_qkv_rope_block_scales_at_model_shapes(nan_empty, m):
    g = torch.Generator(device=DEV).manual_seed(m + 1)
    nh, nkv, hd, k = 32, 8, 64, 2048
    n = (nh + 2 * nkv) * hd
    w = torch.randn(n, k, device=DEV, generator=g) * k**-0.5
    data, scale, w64 = fp8_blocks(w, BLOCK)
    x = torch.randn(m, k, device=DEV, generator=g).to(DT)
    pos = torch.zeros(m, dtype=torch.int64, device=DEV)  # position 0: cos 1, sin 0
    cos = torch.ones(512, hd, device=DEV, dtype=DT)
    sin = torch.zeros(512, hd, device=DEV, dtype=DT)
    kc = torch.zeros(m + 2, 64, nkv, hd, device=DEV, dtype=DT)
    vc = torch.zeros_like(kc)
    slots = torch.arange(m, device=DEV) * 64 + 1
    q = qkv_rope(
        x, None, data, None, EPS, pos, cos, sin, kc, vc, slots, nh, w_scale=scale, w_block=BLOCK
    )
    tile = block_tile(qkv_tile(False, m, n, k, hd // 2, 2, None, True), m, 2)
    qkv = _seen(x, data, scale, tile, m, w64)
    assert _rel(q.reshape(m, -1), qkv[:, : nh * hd]) < 1e-2
    v = vc.view(-1, nkv, hd)[slots].reshape(m, -1)
    assert _rel(v, qkv[:, (nh + nkv) * hd :]) < 1e-2


def test_the_1b_plan_runs_block_scales_fused_at_every_bucket():
    mr = _runner(DT, layers=1, max_bs=64, quantization="fp8-block")
    for bs in (1, 2, 8, 16, 32, 64):
        plan = step_plan(bs, mr.model, mr.attn_backend, mr.tuning)
        assert plan.fused, (bs, plan.reference)
        assert mr.uses_fused(bs)


def test_one_bf16_row_with_block_scales_equals_the_dequantized_weights():
    mr = _runner(DT, quantization="fp8-block")
    got, tokens = _logits(mr, 1)
    ref, _ = _logits(_dequantized_twin(mr), 1)
    assert (got - ref).abs().max() / ref.abs().max() < 3e-2
    assert torch.equal(tokens, got.argmax(-1))
