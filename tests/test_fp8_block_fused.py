"""The fused decode-step kernels streaming FP8 weights with block scales (``W_FP8 == 2``: the
scale of each ``(bn, bk)`` block multiplies the activation chunk, ``kernels/proj/block_scales``)
under the Triton interpreter, against float64 references over the dequantized weights: one row,
tensor-core rows (2-byte activations there run W8A8, checked over the same quantized x),
every loop form, split K; edges: K not a multiple of the block or the chunk, a last partial
row block, a block scaled by 0 and one by 1e30, paired row sets in different blocks; refusals."""

from __future__ import annotations

import pytest
import torch

from stepgraph.errors import ConfigError
from stepgraph.kernels.proj.block_scales import block_tile, rows_fit
from stepgraph.kernels.proj.gate_up_silu import gate_up_silu
from stepgraph.kernels.proj.norm_gemv import gemv_residual
from stepgraph.kernels.proj.proj_tiles import act_e4m3, as_tile
from stepgraph.kernels.proj.tile_table import Tile
from stepgraph.model.fp8_weight import quantize_per_block
from tests.conftest import rel_err
from tests.references import rms64

from .test_fp8_tiles import A8_FORMS, FORMS, check_qkv_rope_fp8, quantized_x
from .test_fused_step_kernels import EPS, inputs

TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


def fp8_blocks(w: torch.Tensor, block, zero=None, huge=None):
    """``w`` in e4m3 per ``block``: ``(data, scale, the float64 dequantized weight)``; the block
    at ``zero`` scaled by 0, the one at ``huge`` by 1e30."""
    q = quantize_per_block(w.float(), block)
    scale = q.scale.clone()
    if zero is not None:
        scale[zero] = 0.0
    if huge is not None:
        scale[huge] = 1e30
    n, k = w.shape
    expand = scale.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    return q.data, scale, q.data.double() * expand.double()


def w8a8_reference(x, data, scale, block, block_k) -> torch.Tensor:
    """What a W8A8 tile computes, in float64: for each row block, x (as the kernel holds it)
    times that block row's column scales in float32, rounded to e4m3 per row per ``block_k``
    chunk (``quantized_x``), against the e4m3 data."""
    n, k = data.shape
    bn, bk = block
    cols = torch.arange(k, device=data.device) // bk
    out = torch.empty(x.shape[0], n, dtype=torch.float64, device=data.device)
    for nb in range(scale.shape[0]):
        rows = slice(nb * bn, min(n, (nb + 1) * bn))
        xs = x.float() * scale[nb, cols][None, :]
        out[:, rows] = quantized_x(xs, block_k) @ data[rows].double().T
    return out


def a8(tile, m: int, dtype) -> bool:
    """Whether ``tile`` runs W8A8 at ``m`` rows of ``dtype`` under block scales."""
    x = torch.empty(0, dtype=dtype)
    return act_e4m3(block_tile(as_tile(tile), m, x.element_size()), m, True, x)


BLOCK = (16, 32)
CASES = [  # (m, tile): one row, split K; tensor-core rows in every loop form
    (1, Tile(8, 32, 4)),
    (1, Tile(16, 64, 4, None, 2)),
    (2, FORMS["swap"]),
    (3, Tile(16, 32, 4, 2, 2)),
    (17, FORMS["tma-swap"]),
    (17, FORMS["tma-x"]),
    (2, A8_FORMS["a8-pointers"]),
    (17, A8_FORMS["a8-tma-swap"]),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m, tile", CASES)
def test_gemv_residual_block_scales(nan_empty, dtype, m, tile):
    # K 144: four 32-column blocks and a partial one; N 40: two 16-row blocks and a partial
    k, n = 144, 40
    x, _, w, _ = inputs(m, k, n, dtype, 11 * m + tile.block_n)
    huge = (0, 4) if dtype == torch.float32 else None
    data, scale, w64 = fp8_blocks(w, BLOCK, zero=(1, 2), huge=huge)
    res = torch.randn(m, n, generator=torch.Generator().manual_seed(3)).to(dtype)
    y = gemv_residual(x, data, res, blocks=tile, w_scale=scale, w_block=BLOCK)
    if a8(tile, m, dtype):
        ref = w8a8_reference(x, data, scale, BLOCK, tile.block_k) + res.double()
        plain = x.double() @ w64.T + res.double()
        assert rel_err(y, plain) < 5e-2  # e4m3's 4 significant bits of x
    else:
        ref = x.double() @ w64.T + res.double()
    assert rel_err(y, ref) < TOL[dtype]
    if huge:  # 1e30 times sums of O(1): in float32's range, unclipped
        assert y[:, :16].abs().max() > 1e28


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "m, tile", [(1, Tile(4, 32, 4)), (2, FORMS["swap-split"]), (17, FORMS["tma-swap"])]
)
def test_gate_up_silu_block_scales(nan_empty, dtype, m, tile):
    # gate and up rows in different blocks: each row set scales x by its own block's scales
    k, inter, block = 144, 64, (32, 32)
    x, nw, w, _ = inputs(m, k, 2 * inter, dtype, m + k)
    data, scale, w64 = fp8_blocks(w, block, zero=(2, 1))  # up's first block, columns 32..63
    out = gate_up_silu(x, None, data, EPS, blocks=tile, w_scale=scale, w_block=block)
    if a8(tile, m, dtype):
        g_u = w8a8_reference(x, data, scale, block, tile.block_k)
    else:
        g_u = x.double() @ w64.T
    gate, up = g_u.split(inter, dim=-1)
    ref = gate * torch.sigmoid(gate) * up
    assert rel_err(out, ref) < 2 * TOL[dtype]
    # with the norm in the prologue (one row, float32: no x rounding beyond the norm's)
    if m == 1 and dtype == torch.float32:
        out = gate_up_silu(x, nw, data, EPS, blocks=tile, w_scale=scale, w_block=block)
        gate, up = (rms64(x, nw) @ w64.T).split(inter, dim=-1)
        assert rel_err(out, gate * torch.sigmoid(gate) * up) < 2 * TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m, tile", [(1, Tile(4, 32, 4)), (1, Tile(8, 64, 4)), (3, FORMS["swap"])])
def test_qkv_rope_block_scales(nan_empty, dtype, m, tile):
    from .test_fp8_tiles import QKV_HD, QKV_K, QKV_N

    block = (QKV_HD, 32)  # one block a head; K 80: two blocks and a partial one
    x, nw, w, _ = inputs(m, QKV_K, QKV_N, dtype, 5 * m)
    data, scale, w64 = fp8_blocks(w, block, zero=(3, 1))
    if m > 1 and dtype != torch.float32:
        xn = x.float()
        xn = (xn * torch.rsqrt(xn.pow(2).mean(-1, keepdim=True) + EPS)).to(dtype).float()
        xin = (xn * nw.float()).to(dtype)
        qkv64 = w8a8_reference(xin, data, scale, block, tile.block_k)
    else:
        qkv64 = rms64(x, nw) @ w64.T
    check_qkv_rope_fp8(x, nw, data, scale, tile, qkv64, w_block=block)


def test_rows_fit_and_the_tiles_block_scales_run():
    assert rows_fit("gemv_residual", Tile(64, 128), 128)
    assert not rows_fit("gemv_residual", Tile(64, 128), 96)  # a 64-row set across 64..127
    assert rows_fit("gemv_residual", Tile(128, 128), 128)
    assert not rows_fit("gemv_residual", Tile(256, 128), 128)
    # qkv's sets are half-head tiles: 32 rows of a 64-wide half at block_n 64
    assert rows_fit("qkv_rope", Tile(64, 128), 32, half=32)
    assert not rows_fit("qkv_rope", Tile(16, 128), 128, half=24)  # starts 0, 16, 24, ...
    assert not rows_fit("gate_up_silu", Tile(32, 128), 128, offset=48)  # up rows from 48
    assert rows_fit("gate_up_silu", Tile(16, 128), 128, offset=48)
    # from two rows 2-byte activations run W8A8; one row and float32 keep the tile
    t = Tile(32, 128, 4)
    assert block_tile(t, 2, 2).a8 == 1 and block_tile(t, 1, 2) == t and block_tile(t, 2, 4) == t


def test_block_scales_refused_where_they_do_not_fit():
    x, nw, w, _ = inputs(2, 64, 64, torch.float16, 1)
    data, scale, _ = fp8_blocks(w, BLOCK)
    with pytest.raises(ConfigError, match="do not lie inside the 16-row scale blocks"):
        gemv_residual(x, data, None, blocks=Tile(32, 32, 4), w_scale=scale, w_block=BLOCK)
    with pytest.raises(ConfigError, match=r"float32 \[4, 2\]"):  # 64 / 16 x 64 / 32
        gemv_residual(
            x, data, None, blocks=Tile(16, 32, 4), w_scale=scale[:, :1].contiguous(), w_block=BLOCK
        )
    with pytest.raises(ConfigError, match=r"float32 \[64\]"):  # block scales, no w_block
        gemv_residual(x, data, None, w_scale=scale)
    with pytest.raises(ConfigError, match="bk a power of two"):
        gemv_residual(x, data, None, w_scale=scale, w_block=(16, 24))
    with pytest.raises(ConfigError, match="without an e4m3 weight"):
        gate_up_silu(x, nw, w, EPS, w_block=BLOCK)


@pytest.mark.parametrize("bs", [1, 3, 17])
def test_the_fused_step_of_a_block_scaled_model_equals_its_reference_ops(bs, monkeypatch):
    """The tiny preset's projections in e4m3 on 128 x 32 blocks (two to four column blocks a
    weight, gate and up in row blocks of their own), float32 activations: the fused step under
    the interpreter against ``ModelRunner.forward``'s reference ops (the dequantized weights),
    logits, greedy tokens and the K/V written."""
    from stepgraph.bench.workload import Point, build_model_runner, decode_batch, fill_kv_random
    from stepgraph.model.decode import step_plan
    from stepgraph.model.decode.fused_decode import fused_decode_step
    from stepgraph.model.fp8_linear import quantize_model, weight_format

    mr = build_model_runner("tiny", "cpu", torch.float32, max_bs=17, max_context=64)
    quantize_model(mr.model, (128, 32))
    assert weight_format(mr.model) == "fp8-block"
    fill_kv_random(mr)
    # the tensor-core kernels from two rows (the tiny shapes have no measured tiles)
    monkeypatch.setattr(step_plan, "measured_all", lambda shapes, rows, tables=None: True)
    shapes = step_plan.step_shapes(mr.model, mr.attn_backend)
    assert shapes.scale_block == (128, 32)
    assert step_plan.plan_step(shapes, bs, bs).fused
    batch, pages = decode_batch(mr, Point(bs, 20), seed=bs)
    caches = (*mr.kv_cache.k_caches, *mr.kv_cache.v_caches)
    try:
        kv0 = [c.clone() for c in caches]
        ref = mr.forward(batch)  # [bs, vocab] float32, the reference ops
        kv_ref = [c.clone() for c in caches]
        for c, c0 in zip(caches, kv0):
            c.copy_(c0)
        tokens = torch.full((bs,), -1, dtype=torch.int64)
        logits = fused_decode_step(
            mr.model, mr.attn_backend, batch.input_ids, batch.positions, tokens_out=tokens
        )
        assert rel_err(logits, ref) < 1e-5
        assert torch.equal(tokens, ref.argmax(-1))
        assert max((a - b).abs().max().item() for a, b in zip(caches, kv_ref)) < 1e-5
    finally:
        for p in pages:
            mr.kv_cache.release(p)
