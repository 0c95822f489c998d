"""The fused decode kernels (add+RMSNorm, SiLU*mul, RoPE+KV write) and the Triton GEMV under the
Triton interpreter, against float64 torch references on fresh random inputs; every output is
poisoned with NaN first, so an unwritten element fails."""

from __future__ import annotations

import pytest
import torch

from stepgraph.errors import ConfigError
from stepgraph.kernels.elementwise.fused_act import silu_mul
from stepgraph.kernels.elementwise.fused_norm import add_rmsnorm, embed_rmsnorm
from stepgraph.kernels.elementwise.rope_kv import apply_rope, rope_kv
from stepgraph.kernels.proj.gemv import gemv
from tests.conftest import rel_err
from tests.references import rope64

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t, n, with_res", [(3, 64, True), (1, 48, True), (2, 40, False)])
def test_add_rmsnorm(nan_empty, dtype, t, n, with_res):
    g = torch.Generator().manual_seed(t * n)
    x = torch.randn(t, n, generator=g).to(dtype)
    res = torch.randn(t, n, generator=g).to(dtype) if with_res else None
    w = (1 + 0.1 * torch.randn(n, generator=g)).to(dtype)
    out, new_res = add_rmsnorm(x, res, w, 1e-5)
    s = x.double() + (res.double() if with_res else 0)  # [T, n]
    ref = w.double() * s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5)
    assert rel_err(new_res, s) < TOL[dtype] / 2
    assert rel_err(out, ref) < TOL[dtype]
    if not with_res:
        assert new_res is x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embed_rmsnorm_is_the_embedding_then_the_norm_bit_for_bit(dtype):
    g = torch.Generator().manual_seed(5)
    table = (3 * torch.randn(50, 48, generator=g)).to(dtype)
    w = (1 + 0.1 * torch.randn(48, generator=g)).to(dtype)
    ids = torch.tensor([49, 0, 7, 7, 23])  # the last row, the first, one twice
    out, rows = embed_rmsnorm(ids, table, w, 1e-5)
    assert torch.equal(rows, table[ids])
    assert torch.equal(out, add_rmsnorm(table[ids], None, w, 1e-5)[0])
    s = table[ids].double()
    ref = w.double() * s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5)
    assert rel_err(out, ref) < TOL[dtype]
    empty = embed_rmsnorm(ids[:0], table, w, 1e-5)
    assert empty[0].shape == empty[1].shape == (0, 48)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t, inter, block", [(2, 96, 64), (1, 128, 128)])
def test_silu_mul(nan_empty, dtype, t, inter, block):
    g = torch.Generator().manual_seed(inter)
    gate_up = (2 * torch.randn(t, 2 * inter, generator=g)).to(dtype)
    out = silu_mul(gate_up, block=block)
    gate, up = gate_up.double().split(inter, dim=-1)
    assert out.shape == (t, inter)
    assert rel_err(out, gate * torch.sigmoid(gate) * up) < TOL[dtype]


def test_apply_rope_equals_pairwise_float64_rotation():
    """``apply_rope`` is the unfused path (and the eager model's): checked against the pairwise
    rotation written in tests/references.py, at angles that cover every quadrant."""
    g = torch.Generator().manual_seed(8)
    t, heads, hd = 5, 3, 16
    x = torch.randn(t, heads, hd, generator=g, dtype=torch.float64)
    ang = torch.rand(t, hd // 2, generator=g, dtype=torch.float64) * 4 * torch.pi
    cos, sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()
    torch.testing.assert_close(apply_rope(x, cos, sin), rope64(x, cos, sin), rtol=0, atol=1e-12)
    # one pair by hand: a quarter turn maps (a, b) to (-b, a)
    quarter = torch.full((1, hd), torch.pi / 2, dtype=torch.float64)
    one = torch.zeros(1, 1, hd, dtype=torch.float64)
    one[0, 0, 0], one[0, 0, hd // 2] = 3.0, 5.0
    got = apply_rope(one, quarter.cos(), quarter.sin())[0, 0]
    assert abs(got[0] + 5.0) < 1e-12 and abs(got[hd // 2] - 3.0) < 1e-12


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_kv(nan_empty, dtype):
    n_heads, n_kv, hd, pages, ps, t = 4, 2, 16, 5, 8, 3
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(t, (n_heads + 2 * n_kv) * hd, generator=g).to(dtype)
    freqs = torch.rand(64, hd // 2, generator=g, dtype=torch.float64) * 6
    emb = torch.cat((freqs, freqs), dim=-1)  # [64 positions, hd]
    cos_t, sin_t = emb.cos().to(dtype), emb.sin().to(dtype)
    positions = torch.tensor([5, 0, 63])
    slots = torch.tensor([ps - 1, ps, 4 * ps + 3])  # page edges
    k_cache = torch.randn(pages, ps, n_kv, hd, generator=g).to(dtype)
    v_cache = torch.randn(pages, ps, n_kv, hd, generator=g).to(dtype)
    k0, v0 = k_cache.clone(), v_cache.clone()
    q = rope_kv(qkv, positions, cos_t, sin_t, k_cache, v_cache, slots, n_heads)
    # float64 reference: rotate, then place k and v at their slots
    qd, kd, vd = qkv.double().split([n_heads * hd, n_kv * hd, n_kv * hd], dim=-1)
    cos, sin = cos_t[positions].double(), sin_t[positions].double()
    q_ref = rope64(qd.view(t, n_heads, hd), cos, sin)
    k_ref = rope64(kd.view(t, n_kv, hd), cos, sin)
    assert rel_err(q, q_ref) < TOL[dtype]
    k_flat, v_flat = k_cache.view(-1, n_kv, hd), v_cache.view(-1, n_kv, hd)
    assert rel_err(k_flat[slots], k_ref) < TOL[dtype]
    assert torch.equal(v_flat[slots], vd.view(t, n_kv, hd).to(dtype))
    untouched = torch.ones(pages * ps, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(k_flat[untouched], k0.view(-1, n_kv, hd)[untouched])
    assert torch.equal(v_flat[untouched], v0.view(-1, n_kv, hd)[untouched])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_rope_kv_scales_by_the_handoffs_rms_then_adds_the_bias(nan_empty, dtype, bias):
    """``ssq``: the row of a GEMM of ``r * norm_w`` times r's 1 / RMS (from per-tile sums of
    squares, 5 parts: a padded reduce), plus the bias, then rotated; float64 reference."""
    n_heads, n_kv, hd, pages, ps, t, hidden, parts, eps = 4, 2, 16, 5, 8, 3, 40, 5, 1e-5
    g = torch.Generator().manual_seed(11 + bias)
    width = (n_heads + 2 * n_kv) * hd
    raw = torch.randn(t, width, generator=g).to(dtype)  # (r * norm_w) @ W^T, not scaled
    r = torch.randn(t, hidden, generator=g, dtype=torch.float64) * 3
    ssq = torch.stack([(c * c).sum(1) for c in r.chunk(parts, 1)], 1).float()  # [t, parts]
    b = torch.randn(width, generator=g).to(dtype) if bias else None
    freqs = torch.rand(64, hd // 2, generator=g, dtype=torch.float64) * 6
    emb = torch.cat((freqs, freqs), dim=-1)
    cos_t, sin_t = emb.cos().to(dtype), emb.sin().to(dtype)
    positions, slots = torch.tensor([7, 0, 63]), torch.tensor([ps - 1, ps, 4 * ps + 3])
    k_cache = torch.randn(pages, ps, n_kv, hd, generator=g).to(dtype)
    v_cache = torch.randn(pages, ps, n_kv, hd, generator=g).to(dtype)
    q = rope_kv(
        raw,
        positions,
        cos_t,
        sin_t,
        k_cache,
        v_cache,
        slots,
        n_heads,
        ssq=ssq,
        hidden=hidden,
        eps=eps,
        bias=b,
    )
    inv = (r.pow(2).mean(1, keepdim=True) + eps).rsqrt()
    row = raw.double() * inv + (b.double() if bias else 0)
    qd, kd, vd = row.split([n_heads * hd, n_kv * hd, n_kv * hd], dim=-1)
    cos, sin = cos_t[positions].double(), sin_t[positions].double()
    assert rel_err(q, rope64(qd.view(t, n_heads, hd), cos, sin)) < TOL[dtype]
    k_flat, v_flat = k_cache.view(-1, n_kv, hd), v_cache.view(-1, n_kv, hd)
    assert rel_err(k_flat[slots], rope64(kd.view(t, n_kv, hd), cos, sin)) < TOL[dtype]
    assert rel_err(v_flat[slots], vd.view(t, n_kv, hd)) < TOL[dtype]
    assert rel_err(v_flat[slots], raw[:, -n_kv * hd :].view(t, n_kv, hd).double()) > 1e-2


def test_rope_kv_refuses_a_handoff_without_its_width_and_a_wrong_bias():
    n_heads, n_kv, hd, t = 2, 1, 8, 2
    qkv = torch.randn(t, (n_heads + 2 * n_kv) * hd)
    cache = torch.zeros(2, 4, n_kv, hd)
    args = (
        qkv,
        torch.tensor([0, 1]),
        torch.ones(4, hd),
        torch.zeros(4, hd),
        cache,
        cache.clone(),
        torch.tensor([1, 2]),
        n_heads,
    )
    ssq = torch.ones(t, 3)
    for hidden in (0, True, 2.0):
        with pytest.raises(ConfigError, match="hidden"):
            rope_kv(*args, ssq=ssq, hidden=hidden)
    with pytest.raises(ConfigError, match="ssq must be"):
        rope_kv(*args, ssq=torch.ones(t - 1, 3), hidden=16)  # one row short
    rope_kv(*args, ssq=torch.ones(t, 3), hidden=16)  # exactly t rows: taken
    with pytest.raises(ConfigError, match="bias must be"):
        rope_kv(*args, bias=torch.zeros(qkv.shape[1] + 1))
    with pytest.raises(ConfigError, match="bias must be"):
        rope_kv(*args, bias=torch.zeros(qkv.shape[1], dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "m, n, k, bias, blocks",
    [
        (1, 40, 96, False, {}),  # N not a multiple of BLOCK_N, K not of BLOCK_K
        (3, 24, 64, True, {"block_n": 8, "block_k": 32}),
        (8, 16, 80, False, {"block_n": 4, "block_k": 32}),
    ],
)
def test_gemv(nan_empty, dtype, m, n, k, bias, blocks):
    g = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    y = gemv(x, w, b, **blocks)
    ref = x.double() @ w.double().T + (b.double() if bias else 0)
    assert y.dtype == dtype and y.shape == (m, n)
    assert rel_err(y, ref) < TOL[dtype]
    y32 = gemv(x, w, b, torch.float32, **blocks)  # the LM head's float32 logits
    assert y32.dtype == torch.float32 and rel_err(y32, ref) < 1e-5
