"""``dequantize_fp8`` (``kernels/proj/fp8_dequant``), the one-pass dequantization a prefill's
FP8 projections hand cuBLAS, under the Triton interpreter: the same bits as torch's
float32 ``weight * scale`` cast to the dtype, for scales per channel and per block, with shapes
that leave partial tiles and partial scale blocks in both dimensions and grids of several
programs each way; scales of 0 and huge; refusals on the host."""

from __future__ import annotations

import pytest
import torch

from stepgraph.errors import ConfigError
from stepgraph.kernels.proj import fp8_dequant
from stepgraph.kernels.proj.fp8_dequant import dequantize_fp8
from stepgraph.kernels.proj.fp8_gemv import dequantize_reference
from stepgraph.model.fp8_weight import quantize_per_block, quantize_per_channel


def weight(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 4


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # the interpreter's float16
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("block", [None, (16, 32), (128, 128)])
def test_one_pass_equals_the_float32_dequantization_bit_for_bit(nan_empty, dtype, block):
    # N, K: more than one program each way (BLOCK_N 16, BLOCK_K 256), a partial tile and a
    # partial scale block in both
    n, k = 3 * fp8_dequant.BLOCK_N + 5, 2 * fp8_dequant.BLOCK_K + 40
    w = weight(n, k, seed=n + k)
    q = quantize_per_channel(w) if block is None else quantize_per_block(w, block)
    scale = q.scale.clone()
    scale.view(-1)[0] = 0.0  # a scale of 0 and a huge one
    scale.view(-1)[-1] = 1e30
    y = dequantize_fp8(q.data, scale, block, dtype)
    want = dequantize_reference(q.data, scale, block, torch.float32).to(dtype)
    assert y.dtype == dtype and y.shape == (n, k)
    assert torch.equal(y, want)
    # the huge scale's rows are what a float32 product makes of them, and nonzero rows stay so
    assert torch.isinf(want).any() == (dtype == torch.float16)
    assert (y.float().abs().sum(1) > 0).sum() >= n - (16 if block else 1)


def test_a_nan_weight_stays_nan_in_bfloat16():
    """The rounding's integer carry never turns a NaN into a number (a NaN scale: loading
    refuses one, this kernel takes what it is given)."""
    q = quantize_per_channel(weight(4, 64, 1))
    scale = q.scale.clone()
    scale[1] = float("nan")
    y = dequantize_fp8(q.data, scale, None, torch.bfloat16)
    assert torch.isnan(y[1]).all() and torch.isnan(y).sum() == 64


def test_an_empty_weight_gives_an_empty_result():
    q = quantize_per_channel(torch.zeros(0, 64))
    assert dequantize_fp8(q.data, q.scale).shape == (0, 64)


def test_bad_inputs_are_refused_on_the_host_naming_the_fix():
    q = quantize_per_channel(weight(32, 64, 0))
    with pytest.raises(ConfigError, match="float8_e4m3fn"):
        dequantize_fp8(q.data.float(), q.scale)
    with pytest.raises(ConfigError, match=r"shape \(32,\)"):
        dequantize_fp8(q.data, q.scale[:31])
    with pytest.raises(ConfigError, match=r"shape \(2, 2\)"):
        dequantize_fp8(q.data, q.scale, (16, 32))
    with pytest.raises(ConfigError, match="float32"):
        dequantize_fp8(q.data, q.scale.double())
    with pytest.raises(ConfigError, match="dtype must be"):
        dequantize_fp8(q.data, q.scale, dtype=torch.float64)


@pytest.mark.parametrize(
    ("n", "k", "itemsize", "block", "chunk_bytes", "want"),
    [
        (1000, 64, 2, None, 128 * 64 * 2, 128),  # exactly one unit of rows
        (1000, 64, 2, None, 128 * 64 * 2 - 1, 128),  # one byte short: still one unit
        (1000, 64, 2, None, 3 * 128 * 64 * 2 + 5, 384),  # whole units only
        (1000, 64, 2, (16, 32), 3 * 16 * 64 * 2, 48),  # a multiple of the scale block's rows
        (1000, 64, 2, None, 0, 1000),  # 0: the whole weight
        (1000, 64, 2, None, 1000 * 64 * 2, 1000),  # exactly the weight: one chunk
        (1000, 64, 2, None, 8 << 20, 1000),  # more than the weight: one chunk
        (1000, 64, 4, None, 128 * 64 * 4, 128),  # float32 rows take twice the bytes
    ],
)
def test_chunk_rows_hold_whole_scale_blocks_within_the_budget(
    n, k, itemsize, block, chunk_bytes, want
):
    assert fp8_dequant.chunk_rows(n, k, itemsize, block, chunk_bytes) == want


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("block", [None, (16, 32)])
def test_dequant_linear_by_chunks_matches_float64_and_holds_one_chunk_at_a_time(
    monkeypatch, block, bias
):
    """``dequant_linear`` over a weight in several chunks, the last one partial (and a partial
    scale block at the end of N with block scales): near ``x @ (weight * scale).T + bias`` in
    float64, every column written, equal to the one-GEMM path within float32's rounding; at
    most one dequantized chunk alive at any time (what a graph's pool holds), each of
    ``chunk_rows`` rows."""
    import gc
    import weakref

    n, k, m = 3 * 128 + 40, 96, 7
    w = weight(n, k, seed=5)
    q = quantize_per_channel(w) if block is None else quantize_per_block(w, block)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(m, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    alive, most, shapes = set(), [0], []
    real = fp8_dequant.dequantize

    def tracked(*args):
        t = real(*args)
        shapes.append(tuple(t.shape))
        alive.add(id(t))
        weakref.finalize(t, alive.discard, id(t))
        most[0] = max(most[0], len(alive))
        return t

    monkeypatch.setattr(fp8_dequant, "dequantize", tracked)
    chunk_bytes = 128 * k * 4  # 128 float32 rows: 4 chunks, the last of 40 rows
    gc.disable()  # chunks are freed by their last reference, not by a collection
    try:
        y = fp8_dequant.dequant_linear(x, q.data, q.scale, block, b, chunk_bytes=chunk_bytes)
    finally:
        gc.enable()
    assert shapes == [(128, k)] * 3 + [(40, k)] and most[0] == 1
    want = x.double() @ dequantize_reference(q.data, q.scale, block).T
    want = want + b.double() if bias else want
    assert y.shape == (m, n) and y.dtype == x.dtype
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5)
    whole = fp8_dequant.dequant_linear(x, q.data, q.scale, block, b, chunk_bytes=0)
    assert shapes[-1] == (n, k)
    torch.testing.assert_close(y, whole, rtol=1e-6, atol=1e-6)


def test_dequant_linear_keeps_the_dtype_in_bfloat16():
    q = quantize_per_channel(weight(300, 64, 8))
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    y = fp8_dequant.dequant_linear(x, q.data, q.scale, chunk_bytes=128 * 64 * 2)
    wq = dequantize_reference(q.data, q.scale, None, torch.float32).to(torch.bfloat16)
    want = x.double() @ wq.double().T  # the weight as dequantized, in float64
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), want, rtol=8e-3, atol=8e-3 * want.abs().max().item())


def test_dequant_linear_of_no_rows_dequantizes_nothing(monkeypatch):
    q = quantize_per_channel(weight(300, 64, 8))
    monkeypatch.setattr(fp8_dequant, "dequantize", lambda *a: pytest.fail("dequantized"))
    y = fp8_dequant.dequant_linear(torch.zeros(0, 64), q.data, q.scale, bias=torch.ones(300))
    assert y.shape == (0, 300)
