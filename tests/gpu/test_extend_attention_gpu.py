"""Prefill ("extend") attention on a real GPU: bf16, fp16 and fp32 against the float64 reference
over a spread of shapes (8 x 2048, a 512-token chunk over a 3000-token prefix, mixed batches,
llama-3.2-1b and hd-128 geometry, page sizes 8, 16 and 64), every tile the benchmark sweeps, and
a replay inside a CUDA graph with new inputs copied in place.

The cases come from ``tests/test_extend_attention.py``'s ``make_case``: NaN in every slot and page
no request owns, shuffled pages, q a strided view, out poisoned. Nothing touches CUDA at import.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from stepgraph.kernels.prefill.extend_attention import extend_attention
from stepgraph.kernels.prefill.extend_reference import (
    extend_attention_reference,
    extend_attention_torch,
)
from tests.conftest import rel_err
from tests.test_extend_attention import make_case, run

bench = importlib.import_module("benchmarks.extend_attention")  # its SWEEP; no CUDA at import

DEV = "cuda"
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
TOL = {FP32: 1e-5, FP16: 2e-3, BF16: 1.5e-2}

# id: (prefix, q_lens, n_heads, n_kv, head_dim, page_size, dtype)
SHAPES = {
    "8x2048-hd64-bf16": ([0] * 8, [2048] * 8, 32, 8, 64, 16, BF16),
    "8x2048-hd128-bf16": ([0] * 8, [2048] * 8, 32, 8, 128, 16, BF16),
    "8x2048-hd64-fp16": ([0] * 8, [2048] * 8, 32, 8, 64, 16, FP16),
    "prefix3000-chunk512-hd64-bf16": ([3000], [512], 32, 8, 64, 16, BF16),
    "prefix3000-chunk512-hd128-fp16": ([3000], [512], 32, 8, 128, 16, FP16),
    "mix-hd64-bf16": ([0, 100, 1000, 5, 0, 77], [1, 300, 17, 1, 700, 129], 32, 8, 64, 16, BF16),
    "mix-hd128-bf16": ([0, 100, 1000, 5, 0, 77], [1, 300, 17, 1, 700, 129], 32, 8, 128, 16, BF16),
    "decode-rows-hd128": ([100, 2000, 7, 0], [1, 1, 1, 1], 32, 8, 128, 16, BF16),
    "fp32-hd64": ([77, 0], [200, 129], 32, 8, 64, 16, FP32),
    "fp32-hd128": ([500], [64], 8, 2, 128, 16, FP32),
    "page64-hd128": ([1000, 3], [257, 90], 32, 8, 128, 64, BF16),
    "page8-hd64-fp16": ([40, 0], [100, 33], 32, 8, 64, 8, FP16),
    "group1-hd64": ([40], [333], 16, 16, 64, 16, BF16),
    "hd256": ([100], [300], 8, 2, 256, 16, BF16),
    "hd16-tiny-model": ([0, 5], [33, 12], 4, 2, 16, 16, FP16),
}


@pytest.mark.parametrize("name", SHAPES)
def test_kernel_matches_float64_reference(name):
    prefix, q_lens, n_heads, n_kv, hd, ps, dtype = SHAPES[name]
    c = make_case(list(SHAPES).index(name), prefix, q_lens, n_heads, n_kv, hd, ps, dtype, DEV)
    got = run(c)
    ref = extend_attention_reference(*c.args(), c.scale)
    assert got.dtype == dtype
    assert rel_err(got, ref) < TOL[dtype], name


@pytest.mark.parametrize("hd", [64, 128])
def test_every_swept_tile_is_correct(hd):
    c = make_case(hd, [37, 0, 600], [300, 129, 1], 32, 8, hd, 16, BF16, DEV)
    ref = extend_attention_reference(*c.args(), c.scale)
    for tile in bench.SWEEP[hd]:
        assert rel_err(run(c, tile=tile), ref) < TOL[BF16], tile.name


def test_torch_path_on_the_gpu():
    c = make_case(50, [3000, 0], [512, 100], 32, 8, 64, 16, BF16, DEV)
    got = extend_attention_torch(c.q, c.k, c.v, c.q_lens, c.kv_list, c.bt, c.scale)
    assert rel_err(got, extend_attention_reference(*c.args(), c.scale)) < TOL[BF16]


def test_replay_in_a_cuda_graph_reads_the_live_inputs():
    """No host sync in the launcher: it captures, and a replay after new values are copied into
    q and kv_lens (same max_q_len) gives the new answer."""
    # the same T and KV lengths (so one cache shape), but new chunks and prefixes
    first = make_case(60, [100, 136], [200, 64], 32, 8, 64, 16, BF16, DEV)
    second = make_case(61, [236, 0], [64, 200], 32, 8, 64, 16, BF16, DEV)
    q, k, v = first.q.clone(), first.k.clone(), first.v.clone()
    indptr, kv_lens, bt = first.qo_indptr.clone(), first.kv_lens.clone(), first.bt.clone()
    out = torch.full_like(q, float("nan"))

    def step():
        extend_attention(q, k, v, indptr, kv_lens, bt, max_q_len=200, sm_scale=0.125, out=out)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up: compiles outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        step()
    for case in (first, second):
        for dst, src in zip((q, k, v, indptr, kv_lens, bt), case.args()):
            dst.copy_(src)
        out.fill_(float("nan"))
        graph.replay()
        ref = extend_attention_reference(q, k, v, indptr, kv_lens, bt, 0.125)
        assert rel_err(out, ref) < TOL[BF16]
