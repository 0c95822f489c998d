"""The FP8-weight GEMV under the Triton interpreter against float64 references over the
dequantized weights: scales per channel and per block, 1, 2, 16 and 64 rows (65 refused), K not
a multiple of the chunk or the block, the last partial blocks of N and K, scales of 0 and of a
huge value, split-K with several chunks a split, outputs poisoned with NaN first; the host
checks; the tile rule as a pure function.

The interpreter loads float8 and converts it exactly (every e4m3 value is checked). Its
``tl.dot`` on bfloat16 operands is wrong (Triton 3.9: a 16x16 bf16 dot is off by 1e10), so the
tensor-core rows run here in float16 and float32; bf16 rows on tensor cores are tested on the
GPU (tests/gpu/test_fp8_gemv_gpu.py), bf16 one-row GEMVs here.
"""

from __future__ import annotations

import pytest
import torch

from stepgraph.errors import ConfigError
from stepgraph.kernels.proj import proj_tiles
from stepgraph.kernels.proj.fp8_gemv import (
    MAX_M,
    TARGET_PROGRAMS,
    fp8_gemv,
    fp8_gemv_reference,
    fp8_tile,
)
from stepgraph.kernels.proj.tile_table import Tile
from stepgraph.model.fp8_weight import quantize_per_block, quantize_per_channel
from tests.conftest import rel_err

F8 = torch.float8_e4m3fn
TOL = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2}
N, K = 40, 200  # K: 6 chunks of 32 and a ragged one; blocks (16, 32): N 16+16+8, K 6x32+8
BLOCK = (16, 32)


def weight(g, n=N, k=K, block=None):
    w = torch.randn(n, k, generator=g) * k**-0.5
    w[:, -1] *= 50  # the last (partial) K block scaled apart from the rest
    return quantize_per_channel(w) if block is None else quantize_per_block(w, block)


def tiles_for(m: int) -> list[Tile | None]:
    # the default rule, and a tile whose grid has 3 column tiles and whose K splits run 4 and
    # 3 chunks each (split 2), so every loop runs more than once
    return [None, Tile(16 if m > 1 else 8, 32, 4, None, 2)]


@pytest.mark.parametrize("m", [1, 2, 16, 64])
@pytest.mark.parametrize("block", [None, BLOCK], ids=["channel", "block"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fp8_gemv_rows_formats_and_tiles(nan_empty, m, block, dtype):
    g = torch.Generator().manual_seed(10 * m + (block is None))
    fw = weight(g, block=block)
    x = torch.randn(m, K, generator=g).to(dtype)
    bias = torch.randn(N, generator=g).to(dtype)
    ref = fp8_gemv_reference(x, fw.data, fw.scale, block, bias)
    for tile in tiles_for(m):
        y = fp8_gemv(x, fw.data, fw.scale, block, bias, tile=tile)
        assert y.shape == (m, N) and y.dtype == dtype
        assert rel_err(y, ref) < TOL[dtype], tile
        # deterministic (the split-K sum in split order), every ticket back at zero
        assert torch.equal(fp8_gemv(x, fw.data, fw.scale, block, bias, tile=tile), y)
        assert all(int(t.abs().sum()) == 0 for _, t in proj_tiles._WORKSPACES.values())


@pytest.mark.parametrize("block", [None, (32, 128)], ids=["channel", "block"])
def test_one_row_bf16_into_a_poisoned_float32_out(block):
    g = torch.Generator().manual_seed(7)
    fw = weight(g, 300, 260, block)  # 260: two 128-blocks and a partial one
    x = torch.randn(1, 260, generator=g).bfloat16()
    out = torch.full((1, 300), float("nan"))
    y = fp8_gemv(x, fw.data, fw.scale, block, out=out)
    assert y is out and rel_err(y, fp8_gemv_reference(x, fw.data, fw.scale, block)) < 1e-6
    assert fp8_gemv(x, fw.data, fw.scale, block, out_dtype=torch.float32).dtype == torch.float32


def test_every_e4m3_value_converts_exactly():
    vals = torch.arange(256, dtype=torch.uint8).view(F8)
    w = vals[~vals.float().isnan()][:, None].contiguous()  # 254 values, K = 1
    y = fp8_gemv(torch.ones(1, 1), w, torch.ones(w.shape[0]))
    assert torch.equal(y[0], w.float()[:, 0])
    y16 = fp8_gemv(torch.ones(2, 1), w, torch.ones(w.shape[0]))  # through tl.dot
    assert torch.equal(y16[1], w.float()[:, 0])


@pytest.mark.parametrize("m", [1, 16])
@pytest.mark.parametrize("block", [None, BLOCK], ids=["channel", "block"])
def test_scales_of_zero_and_of_a_huge_value(nan_empty, m, block):
    g = torch.Generator().manual_seed(11)
    fw = weight(g, block=block)
    scale = fw.scale.clone()
    zero, huge = (3, 25) if block is None else ((0, 2), (2, 6))  # rows 0-15 K 64-95; last
    scale[zero] = 0.0
    scale[huge] = 1e30
    x = torch.randn(m, K, generator=g)
    y = fp8_gemv(x, fw.data, scale, block, tile=tiles_for(m)[1])
    ref = fp8_gemv_reference(x, fw.data, scale, block)
    assert torch.isfinite(y).all()
    assert ((y.double() - ref).abs() <= 1e-6 * ref.abs() + 1e-4).all()
    if block is None:
        assert (y[:, 3] == 0).all() and y[:, 25].abs().max() > 1e28


def test_at_most_64_rows():
    g = torch.Generator().manual_seed(12)
    fw = weight(g)
    x = torch.randn(MAX_M + 1, K, generator=g)
    y = fp8_gemv(x[:MAX_M], fw.data, fw.scale)
    assert rel_err(y, fp8_gemv_reference(x[:MAX_M], fw.data, fw.scale)) < 1e-6
    with pytest.raises(ConfigError, match="at most 64 rows; got 65"):
        fp8_gemv(x, fw.data, fw.scale)
    assert fp8_gemv(x[:0], fw.data, fw.scale).shape == (0, N)


def test_host_checks_name_the_problem():
    g = torch.Generator().manual_seed(13)
    fw, fb = weight(g), weight(g, block=BLOCK)
    x = torch.randn(2, K, generator=g)
    cases = [
        (lambda: fp8_gemv(x.int(), fw.data, fw.scale), "x must be"),
        (lambda: fp8_gemv(x.t().contiguous().t(), fw.data, fw.scale), "contiguous rows"),
        (lambda: fp8_gemv(x, fw.data.float(), fw.scale), "float8_e4m3fn"),
        (lambda: fp8_gemv(x, fw.data[:, :100].contiguous(), fw.scale), "K = 200"),
        (lambda: fp8_gemv(x, fw.data.t(), fw.scale), "contiguous=False"),
        (lambda: fp8_gemv(x, fw.data, fw.scale[:, None]), r"shape \(40,\)"),
        (lambda: fp8_gemv(x, fw.data, fw.scale.half()), "float32"),
        (lambda: fp8_gemv(x, fb.data, fb.scale), r"shape \(40,\)"),
        (lambda: fp8_gemv(x, fw.data, fw.scale, BLOCK), r"shape \(3, 7\)"),
        (lambda: fp8_gemv(x, fb.data, fb.scale, BLOCK, tile=Tile(16, 64)), "must divide"),
        (lambda: fp8_gemv(x, fw.data, fw.scale, tile=Tile(8, 32)), "block_n >= 16"),
        (lambda: fp8_gemv(x, fw.data, fw.scale, tile=Tile(16, 48)), "power of two"),
        (lambda: fp8_gemv(x, fw.data, fw.scale, tile=Tile(16, 32, 4, None, 0)), "split_k"),
        (lambda: fp8_gemv(x, fw.data, fw.scale, bias=torch.ones(N, 1)), "bias must be"),
        (lambda: fp8_gemv(x, fw.data, fw.scale, torch.ones(N)), "block must be None or"),
        (lambda: fp8_gemv(x, fw.data, fw.scale, out=torch.empty(2, N + 1)), "out must be"),
    ]
    for call, said in cases:
        with pytest.raises(ConfigError, match=said) as e:
            call()
        assert "\n" not in str(e.value)
    odd = quantize_per_block(torch.randn(N, K, generator=g), (16, 24))
    with pytest.raises(ConfigError, match="power of two >= 16"):
        fp8_gemv(x, odd.data, odd.scale, (16, 24))


@pytest.mark.parametrize(
    "n, k",
    [
        (3072, 2048),
        (2048, 2048),
        (16384, 2048),
        (2048, 8192),
        (6144, 4096),
        (4096, 4096),
        (28672, 4096),
        (4096, 14336),
        (40, 200),
        (7, 1),
    ],
)
@pytest.mark.parametrize("m", [1, 8, 64])
@pytest.mark.parametrize("block", [None, (128, 128)])
def test_tile_rule(m, n, k, block):
    t = fp8_tile(m, n, k, block)
    assert t.block_k >= 16 and t.block_k & (t.block_k - 1) == 0
    assert block is None or block[1] % t.block_k == 0
    assert m == 1 or t.block_n >= 16
    if m == 1:
        assert t.block_n * t.block_k <= 8192
    # split K until the programs reach the target or a split would hold under two chunks
    programs = -(-n // t.block_n) * t.split_k
    assert programs >= TARGET_PROGRAMS or k < 4 * t.split_k * t.block_k
    if t.split_k > 1:
        assert -(-n // t.block_n) * t.split_k // 2 < TARGET_PROGRAMS
        assert k >= 2 * t.split_k * t.block_k
