"""The fused decode kernels and the Triton GEMV on a real GPU, in bf16 at Llama-3.2-1B sizes,
against float64 references (outputs poisoned with NaN first); and the model with the GEMV on
matches cuBLAS, eagerly and from a captured graph.

Nothing touches CUDA at import time: without a GPU the module imports and every test skips.
"""

from __future__ import annotations

import pytest
import torch

from stepgraph.kernels.elementwise import fused_act, fused_norm
from stepgraph.kernels.elementwise import rope_kv as rope_mod
from stepgraph.kernels.proj import gemv as gemv_mod
from stepgraph.model import ModelRunner
from stepgraph.runner import CudaGraphRunner, RunnerConfig
from tests.conftest import rel_err
from tests.references import check_qkv_rope, rms64, rope64

DEV = "cuda"
BF16_TOL = 1e-2  # relative Frobenius error of bf16 outputs against float64
HIDDEN, INTER, N_HEADS, N_KV, HD, VOCAB = 2048, 8192, 32, 8, 64, 128256


def randn(*shape, g, scale=1.0):
    return (scale * torch.randn(*shape, generator=g, device=DEV)).to(torch.bfloat16)


@pytest.mark.parametrize("t", [1, 8, 33])
def test_add_rmsnorm_bf16(nan_empty, t):
    g = torch.Generator(DEV).manual_seed(t)
    x, res = randn(t, HIDDEN, g=g), randn(t, HIDDEN, g=g)
    w = 1 + randn(HIDDEN, g=g, scale=0.1)
    out, new_res = fused_norm.add_rmsnorm(x, res, w, 1e-5)
    s = x.double() + res.double()
    ref = w.double() * s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5)
    assert rel_err(new_res, s) < BF16_TOL and rel_err(out, ref) < BF16_TOL
    # the torch reference (what the CPU runs) agrees to bf16 rounding
    ref_out, ref_res = fused_norm.add_rmsnorm_reference(x, res, w, 1e-5)
    assert torch.equal(new_res, ref_res)
    assert rel_err(out, ref_out.double()) < 4e-3


@pytest.mark.parametrize("t", [1, 8, 64])
def test_embed_rmsnorm_bf16_is_the_embedding_then_the_norm(t):
    g = torch.Generator(DEV).manual_seed(40 + t)
    table, w = randn(VOCAB, HIDDEN, g=g), 1 + randn(HIDDEN, g=g, scale=0.1)
    ids = torch.randint(0, VOCAB, (t,), generator=g, device=DEV)
    ids[0] = VOCAB - 1  # the table's last row
    out, rows = fused_norm.embed_rmsnorm(ids, table, w, 1e-5)
    assert torch.equal(rows, torch.nn.functional.embedding(ids, table))
    assert torch.equal(out, fused_norm.add_rmsnorm(rows, None, w, 1e-5)[0])  # bit for bit


@pytest.mark.parametrize("t", [1, 8, 33])
def test_silu_mul_bf16(nan_empty, t):
    g = torch.Generator(DEV).manual_seed(t)
    gate_up = randn(t, 2 * INTER, g=g, scale=2.0)
    out = fused_act.silu_mul(gate_up)
    gate, up = gate_up.double().split(INTER, dim=-1)
    assert rel_err(out, gate * torch.sigmoid(gate) * up) < BF16_TOL
    assert rel_err(out, fused_act.silu_mul_reference(gate_up).double()) < 4e-3  # ulps apart


def rope_inputs(t: int, g: torch.Generator, pages: int = 64, ps: int = 64):
    """``(cos, sin, positions, slots, k_cache, v_cache)``: 1024 positions' tables at large
    frequencies, ``t`` random positions and distinct slots, random caches (bf16)."""
    emb = torch.rand(1024, HD // 2, generator=g, device=DEV, dtype=torch.float64) * 100
    emb = torch.cat((emb, emb), dim=-1)
    cos_t, sin_t = emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16)
    positions = torch.randint(0, 1024, (t,), generator=g, device=DEV)
    slots = torch.randperm(pages * ps, generator=g, device=DEV)[:t]
    return (
        cos_t,
        sin_t,
        positions,
        slots,
        randn(pages, ps, N_KV, HD, g=g),
        randn(pages, ps, N_KV, HD, g=g),
    )


@pytest.mark.parametrize("t", [1, 8, 40])
def test_rope_kv_bf16(nan_empty, t):
    g = torch.Generator(DEV).manual_seed(t)
    pages, ps = 64, 64
    qkv = randn(t, (N_HEADS + 2 * N_KV) * HD, g=g)
    cos_t, sin_t, positions, slots, k_cache, v_cache = rope_inputs(t, g, pages, ps)
    k0, v0 = k_cache.clone(), v_cache.clone()
    q = rope_mod.rope_kv(qkv, positions, cos_t, sin_t, k_cache, v_cache, slots, N_HEADS)
    qd, kd, vd = qkv.double().split([N_HEADS * HD, N_KV * HD, N_KV * HD], dim=-1)
    cos, sin = cos_t[positions].double(), sin_t[positions].double()
    assert rel_err(q, rope64(qd.view(t, N_HEADS, HD), cos, sin)) < BF16_TOL
    kf, vf = k_cache.view(-1, N_KV, HD), v_cache.view(-1, N_KV, HD)
    assert rel_err(kf[slots], rope64(kd.view(t, N_KV, HD), cos, sin)) < BF16_TOL
    assert torch.equal(vf[slots], qkv[:, (N_HEADS + N_KV) * HD :].view(t, N_KV, HD))
    keep = torch.ones(pages * ps, dtype=torch.bool, device=DEV)
    keep[slots] = False
    assert torch.equal(kf[keep], k0.view(-1, N_KV, HD)[keep])
    assert torch.equal(vf[keep], v0.view(-1, N_KV, HD)[keep])


@pytest.mark.parametrize("t", [33, 64])
def test_rope_kv_on_the_norm_handoff_bf16(nan_empty, t):
    """The 1B's qkv at 33-64 rows: cuBLAS on ``r * norm_w``, then this kernel scales each row
    by r's 1 / RMS from the down projection's 32 per-tile sums of squares and adds a bias;
    against float64 of the normed GEMM (the cuBLAS output's bf16 rounding within the bound)."""
    g = torch.Generator(DEV).manual_seed(t)
    eps, width = 1e-5, (N_HEADS + 2 * N_KV) * HD
    r, nw = randn(t, HIDDEN, g=g, scale=4.0), 1 + randn(HIDDEN, g=g, scale=0.1)
    w, b = randn(width, HIDDEN, g=g, scale=HIDDEN**-0.5), randn(width, g=g)
    ssq = torch.stack([(c.float() ** 2).sum(1) for c in r.chunk(32, 1)], 1)  # [t, 32]
    raw = torch.nn.functional.linear(r * nw, w)  # the GEMM of the handoff's x
    cos_t, sin_t, positions, slots, k_cache, v_cache = rope_inputs(t, g)
    caches0 = (k_cache.clone(), v_cache.clone())
    q = rope_mod.rope_kv(
        raw,
        positions,
        cos_t,
        sin_t,
        k_cache,
        v_cache,
        slots,
        N_HEADS,
        ssq=ssq,
        hidden=HIDDEN,
        eps=eps,
        bias=b,
    )
    row = rms64(r, nw, eps) @ w.double().T + b.double()
    check_qkv_rope(
        q, row, positions, cos_t, sin_t, (k_cache, v_cache), caches0, slots, N_HEADS, BF16_TOL
    )


@pytest.mark.parametrize("m", [33, 64])
def test_head_scale_on_the_norm_handoff_bf16(m):
    """The 1B's LM head at 33-64 rows: cuBLAS on ``r * norm_w`` in bf16, then one launch scales
    the rows by 1 / RMS into float32 logits (poisoned first) and takes the greedy tokens,
    folded: against float64 and ``torch.argmax``, a tie across programs included."""
    from stepgraph.kernels.proj.head_scale import head_scale

    g = torch.Generator(DEV).manual_seed(m)
    r, nw = randn(m, HIDDEN, g=g, scale=4.0), 1 + randn(HIDDEN, g=g, scale=0.1)
    w = randn(VOCAB, HIDDEN, g=g, scale=HIDDEN**-0.5)
    ssq = torch.stack([(c.float() ** 2).sum(1) for c in r.chunk(32, 1)], 1)
    raw = torch.nn.functional.linear(r * nw, w)
    raw[1, 9000] = raw[1, 100000] = raw[1].abs().max() + 1  # programs 1 and 12 of the row
    logits = torch.full((m, VOCAB), float("nan"), device=DEV)
    tokens = torch.full((m,), -3, dtype=torch.int64, device=DEV)
    head_scale(raw, ssq, HIDDEN, 1e-5, logits_out=logits, tokens_out=tokens)
    rd = r.double()
    inv = torch.rsqrt(rd.pow(2).mean(-1, keepdim=True) + 1e-5)
    assert rel_err(logits, raw.double() * inv) < 1e-6  # the scale in float32 of the bf16 rows
    normed = (nw.double() * rd * inv) @ w.double().T
    assert rel_err(logits[2:], normed[2:]) < BF16_TOL  # and the head of the normed rows
    assert torch.equal(tokens, torch.argmax(logits, -1)) and int(tokens[1]) == 9000


SHAPES = [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192), (VOCAB, 2048)]


@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("n, k", SHAPES)
def test_gemv_bf16(nan_empty, m, n, k):
    g = torch.Generator(DEV).manual_seed(m + n + k)
    x, w = randn(m, k, g=g), randn(n, k, g=g, scale=k**-0.5)
    ref = x.double() @ w.double().T
    assert rel_err(gemv_mod.gemv(x, w), ref) < BF16_TOL
    y32 = gemv_mod.gemv(x, w, out_dtype=torch.float32)
    assert y32.dtype == torch.float32 and rel_err(y32, ref) < 1e-4


def test_model_with_gemv_matches_cublas_eager_and_graph():
    """4 layers of llama-3.2-1b: the GEMV on every projection gives the cuBLAS logits (to bf16
    rounding), eagerly and from a captured graph, at bs 1, 3 and 8."""
    kw = dict(seed=7, num_layers=4, max_bs=8, max_context_len=256, page_size=64)
    ref_mr = ModelRunner.from_preset("llama-3.2-1b", DEV, torch.bfloat16, **kw)
    mr = ModelRunner.from_preset("llama-3.2-1b", DEV, torch.bfloat16, **kw)
    assert len(mr.model.use_gemv("all")) == 4 * 4 + 1
    runner = CudaGraphRunner(mr, RunnerConfig(max_bs=8, show_progress=False))
    g = torch.Generator().manual_seed(0)
    for bs in (1, 3, 8):
        toks = torch.randint(1, 128256, (bs,), generator=g).tolist()
        pos = [17 * (i + 1) for i in range(bs)]
        pa = [ref_mr.kv_cache.reserve(p + 1) for p in pos]
        pb = [mr.kv_cache.reserve(p + 1) for p in pos]
        ref = ref_mr.forward(ref_mr.decode_batch(toks, pos, pa))
        eager = mr.forward(mr.decode_batch(toks, pos, pb))
        graph = runner.replay(mr.decode_batch(toks, pos, pb))
        for got in (eager, graph):
            assert got.dtype == torch.float32 and got.shape == (bs, 128256)
            assert (got - ref).abs().max().item() < 0.1  # logits std ~1: bf16 rounding only
        for p in pa:
            ref_mr.kv_cache.release(p)
        for p in pb:
            mr.kv_cache.release(p)
    runner.shutdown()
