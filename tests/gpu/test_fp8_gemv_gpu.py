"""The FP8-weight GEMV on a real GPU at Llama-3.2-1B's and Llama-3.1-8B's projection shapes,
bf16 and float32 activations, scales per channel and per 128x128 block, 1, 8 and 64 rows,
against float64 references over the dequantized weights (outputs poisoned with NaN first); with
PDL on and off, and replayed from a CUDA graph.

Nothing touches CUDA at import time: without a GPU the module imports and every test skips.
"""

from __future__ import annotations

import pytest
import torch

from stepgraph.kernels.proj import proj_tiles
from stepgraph.kernels.proj.fp8_gemv import fp8_gemv, fp8_gemv_reference
from stepgraph.model.fp8_weight import quantize_per_block, quantize_per_channel
from tests.conftest import rel_err

DEV = "cuda"
TOL = {torch.bfloat16: 1e-2, torch.float32: 1e-5}  # relative Frobenius error against float64
SHAPES = {  # (N, K) of the fused projections
    "1b-qkv": (3072, 2048),
    "1b-o": (2048, 2048),
    "1b-gate_up": (16384, 2048),
    "1b-down": (2048, 8192),
    "8b-qkv": (6144, 4096),
    "8b-o": (4096, 4096),
    "8b-gate_up": (28672, 4096),
    "8b-down": (4096, 14336),
}
FORMATS = {"channel": None, "block": (128, 128)}


def fp8_weight(n: int, k: int, block, seed: int):
    g = torch.Generator(DEV).manual_seed(seed)
    w = torch.randn(n, k, generator=g, device=DEV) * k**-0.5
    return quantize_per_channel(w) if block is None else quantize_per_block(w, block)


# bs 1 and 8 at every shape; 64 rows at three (each tile compiles once: the run stays short)
CASES = [(s, m) for m in (1, 8) for s in SHAPES] + [
    ("1b-o", 64),
    ("1b-down", 64),
    ("8b-gate_up", 64),
]


@pytest.mark.parametrize("shape, m", CASES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_fp8_gemv_bf16_at_model_shapes(nan_empty, shape, fmt, m):
    n, k = SHAPES[shape]
    block = FORMATS[fmt]
    fw = fp8_weight(n, k, block, seed=m)
    g = torch.Generator(DEV).manual_seed(100 + m)
    x = torch.randn(m, k, generator=g, device=DEV).bfloat16()
    ref = fp8_gemv_reference(x, fw.data, fw.scale, block)
    y = fp8_gemv(x, fw.data, fw.scale, block)
    assert y.dtype == torch.bfloat16 and rel_err(y, ref) < TOL[torch.bfloat16]
    if shape in ("1b-qkv", "8b-down"):  # a float32 output, and PDL off: the same sums
        y32 = fp8_gemv(x, fw.data, fw.scale, block, out_dtype=torch.float32, use_pdl=False)
        assert rel_err(y32, ref) < 1e-5
        assert torch.equal(fp8_gemv(x, fw.data, fw.scale, block, use_pdl=False), y)
    torch.cuda.synchronize()
    assert all(int(t.abs().sum()) == 0 for _, t in proj_tiles._WORKSPACES.values())


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", [1, 33])
def test_fp8_gemv_float32_activations(nan_empty, fmt, m):
    n, k = SHAPES["1b-down"]
    block = FORMATS[fmt]
    fw = fp8_weight(n, k, block, seed=7)
    g = torch.Generator(DEV).manual_seed(m)
    x = torch.randn(m, k, generator=g, device=DEV)
    y = fp8_gemv(x, fw.data, fw.scale, block)
    assert y.dtype == torch.float32
    assert rel_err(y, fp8_gemv_reference(x, fw.data, fw.scale, block)) < TOL[torch.float32]


@pytest.mark.parametrize("m", [1, 8])
def test_fp8_gemv_replays_from_a_graph_with_pdl(m):
    n, k = SHAPES["1b-qkv"]
    ws = [fp8_weight(n, k, block, seed=s) for s, block in enumerate(FORMATS.values())]
    blocks = list(FORMATS.values())
    x = torch.randn(m, k, device=DEV).bfloat16()
    outs = [torch.full((m, n), float("nan"), device=DEV, dtype=torch.bfloat16) for _ in ws]

    def step():
        for fw, block, out in zip(ws, blocks, outs):
            fp8_gemv(x, fw.data, fw.scale, block, out=out)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile and warm up off the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for out in outs:
        out.fill_(float("nan"))
    x.copy_(torch.randn(m, k, device=DEV).bfloat16())
    graph.replay()
    torch.cuda.synchronize()
    for fw, block, out in zip(ws, blocks, outs):
        assert rel_err(out, fp8_gemv_reference(x, fw.data, fw.scale, block)) < 1e-2
        assert torch.equal(out, fp8_gemv(x, fw.data, fw.scale, block))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_past_64_rows_cublas_runs_over_the_one_pass_dequantized_weight_by_chunks(
    nan_empty, dtype, fmt
):
    """``dequantize_fp8`` gives the bits of torch's float32 dequantization cast to the dtype;
    past 64 rows ``Fp8Linear`` is ``dequant_linear`` (chunks of it, each GEMM into its columns
    of one output), near the one-GEMM result and float64 over the dequantized weight."""
    from stepgraph.kernels.proj.fp8_dequant import dequant_linear, dequantize_fp8
    from stepgraph.kernels.proj.fp8_gemv import dequantize_reference
    from stepgraph.model.fp8_linear import Fp8Linear

    n, k = SHAPES["1b-gate_up"]
    block = FORMATS[fmt]
    q = fp8_weight(n + 40, k + 72, block, seed=5)  # partial tiles, scale blocks and chunks
    torch_dq = dequantize_reference(q.data, q.scale, block, torch.float32).to(dtype)
    assert torch.equal(dequantize_fp8(q.data, q.scale, block, dtype), torch_dq)
    lin = Fp8Linear.from_weight(q)
    x = torch.randn(65, k + 72, device=DEV, dtype=dtype)
    y = lin(x)
    assert torch.equal(y, dequant_linear(x, q.data, q.scale, block))
    whole = torch.nn.functional.linear(x, torch_dq)
    assert rel_err(y, whole.double()) < TOL[dtype] / 4
    assert rel_err(y, fp8_gemv_reference(x, q.data, q.scale, block)) < TOL[dtype]


@pytest.mark.cuda
def test_the_gemv_runs_exactly_at_64_rows_and_past_them_one_chunk_of_weight_is_held(nan_empty):
    """64 rows: the FP8-weight GEMV, bit for bit; 65 and 512: ``dequant_linear``, whose
    allocations past the output stay within one chunk (``CHUNK_BYTES``) of dequantized weight,
    where the whole gate-up weight in bf16 is 64 MiB. All near float64."""
    from stepgraph.kernels.proj import fp8_dequant
    from stepgraph.kernels.proj.fp8_gemv import fp8_gemv
    from stepgraph.model.fp8_linear import Fp8Linear

    n, k = SHAPES["1b-gate_up"]
    q = fp8_weight(n, k, None, seed=9)
    lin = Fp8Linear.from_weight(q)
    x = torch.randn(64, k, device=DEV, dtype=torch.bfloat16)
    assert torch.equal(lin(x), fp8_gemv(x, q.data, q.scale))
    assert n * k * 2 >= 4 * fp8_dequant.CHUNK_BYTES  # several chunks
    for m in (65, 512):
        x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
        lin(x)  # warm: cuBLAS's workspace
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        y = lin(x)
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - base - y.numel() * y.element_size()
        assert extra <= fp8_dequant.CHUNK_BYTES + (1 << 20), (m, extra)
        assert torch.equal(y, fp8_dequant.dequant_linear(x, q.data, q.scale))
        assert rel_err(y, fp8_gemv_reference(x, q.data, q.scale)) < TOL[torch.bfloat16]
