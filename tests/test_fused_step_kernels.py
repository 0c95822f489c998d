"""The fused decode-step kernels (norm-prologue GEMV, residual epilogue, gate-up + SiLU·mul,
qkv + RoPE + KV write, LM head + argmax) under the Triton interpreter, in float32 and float16 at
odd sizes, against float64 references and the unfused torch ops; outputs start as NaN."""

from __future__ import annotations

import pytest
import torch

from stepgraph.kernels.pdl import launch_options, pdl_enabled, resolve_pdl
from stepgraph.kernels.proj.gate_up_silu import gate_up_silu, gate_up_silu_reference
from stepgraph.kernels.proj.norm_gemv import (
    gemv_residual,
    gemv_residual_reference,
    norm_gemv,
    norm_gemv_reference,
)
from stepgraph.kernels.proj.qkv_rope import qkv_rope, qkv_rope_reference
from stepgraph.kernels.sampling.lm_head_argmax import lm_head_argmax
from tests.conftest import rel_err
from tests.references import check_qkv_rope, rms64

TOL = {torch.float32: 1e-5, torch.float16: 2e-3}
EPS = 1e-5


def inputs(m, k, n, dtype, seed, bias=False):
    g = torch.Generator().manual_seed(seed)
    x = (2 * torch.randn(m, k, generator=g)).to(dtype)
    nw = (1 + 0.1 * torch.randn(k, generator=g)).to(dtype)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return x, nw, w, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "m, k, n, bias, blocks",
    [(1, 80, 40, False, (8, 32, 4)), (3, 48, 20, True, (16, 16, 4)), (2, 64, 24, False, None)],
)
def test_norm_gemv(nan_empty, dtype, m, k, n, bias, blocks):
    x, nw, w, b = inputs(m, k, n, dtype, m * k + n, bias)
    y = norm_gemv(x, nw, w, b, EPS, blocks=blocks)
    ref = rms64(x, nw) @ w.double().T + (b.double() if bias else 0)
    assert y.dtype == dtype and y.shape == (m, n)
    assert rel_err(y, ref) < TOL[dtype]
    assert rel_err(y, norm_gemv_reference(x, nw, w, b, EPS)) < TOL[dtype]
    y32 = norm_gemv(x, nw, w, b, EPS, torch.float32, blocks=blocks)
    assert y32.dtype == torch.float32 and rel_err(y32, ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m, k, n, blocks", [(1, 72, 36, (8, 32, 4)), (3, 40, 24, (16, 16, 4))])
def test_gemv_residual(nan_empty, dtype, m, k, n, blocks):
    x, _, w, _ = inputs(m, k, n, dtype, m + k + n)
    res = torch.randn(m, n, generator=torch.Generator().manual_seed(1)).to(dtype)
    y = gemv_residual(x, w, res, blocks=blocks)
    assert rel_err(y, x.double() @ w.double().T + res.double()) < TOL[dtype]
    assert rel_err(y, gemv_residual_reference(x, w, res)) < TOL[dtype]
    # in place on the residual stream: each program reads and writes only its own columns
    res2 = res.clone()
    assert gemv_residual(x, w, res2, out=res2, blocks=blocks) is res2
    assert torch.equal(res2, y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m, k, inter, blocks", [(1, 64, 24, (4, 32, 4)), (3, 40, 12, None)])
def test_gate_up_silu(nan_empty, dtype, m, k, inter, blocks):
    x, nw, w, _ = inputs(m, k, 2 * inter, dtype, m * inter + k)
    out = gate_up_silu(x, nw, w, EPS, blocks=blocks)
    gate, up = (rms64(x, nw) @ w.double().T).split(inter, dim=-1)
    assert out.shape == (m, inter) and out.dtype == dtype
    assert rel_err(out, gate * torch.sigmoid(gate) * up) < 2 * TOL[dtype]
    assert rel_err(out, gate_up_silu_reference(x, nw, w, EPS)) < 2 * TOL[dtype]


def rope_tables(hd, n_pos, dtype, g):
    freqs = torch.rand(n_pos, hd // 2, generator=g, dtype=torch.float64) * 6
    emb = torch.cat((freqs, freqs), dim=-1)  # [n_pos, hd]
    return emb.cos().to(dtype), emb.sin().to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m, bias, blocks", [(3, True, (16, 16, 4)), (1, False, None)])
def test_qkv_rope(nan_empty, dtype, m, bias, blocks):
    n_heads, n_kv, hd, pages, ps, k = 4, 2, 16, 5, 8, 40
    n = (n_heads + 2 * n_kv) * hd
    x, nw, w, b = inputs(m, k, n, dtype, 7 * m, bias)
    g = torch.Generator().manual_seed(11)
    cos_t, sin_t = rope_tables(hd, 64, dtype, g)
    positions = torch.tensor([5, 0, 63][:m])
    slots = torch.tensor([ps - 1, ps, 4 * ps + 3][:m])  # page edges
    k_cache = torch.randn(pages, ps, n_kv, hd, generator=g).to(dtype)
    v_cache = torch.randn(pages, ps, n_kv, hd, generator=g).to(dtype)
    k0, v0 = k_cache.clone(), v_cache.clone()
    q = qkv_rope(
        x, nw, w, b, EPS, positions, cos_t, sin_t, k_cache, v_cache, slots, n_heads, blocks=blocks
    )
    # float64 reference: norm, project, rotate, place k and v at their slots
    qkv = rms64(x, nw) @ w.double().T + (b.double() if bias else 0)
    check_qkv_rope(
        q,
        qkv,
        positions,
        cos_t,
        sin_t,
        (k_cache, v_cache),
        (k0, v0),
        slots,
        n_heads,
        2 * TOL[dtype],
    )
    # the unfused torch ops agree
    k_ref, v_ref = k0.clone(), v0.clone()
    q_ref = qkv_rope_reference(
        x, nw, w, b, EPS, positions, cos_t, sin_t, k_ref, v_ref, slots, n_heads
    )
    assert rel_err(q, q_ref) < 2 * TOL[dtype]
    assert rel_err(k_cache, k_ref) < 2 * TOL[dtype]


@pytest.mark.parametrize("m, k, vocab, blocks", [(1, 32, 100, (8, 32, 4)), (3, 24, 37, None)])
def test_lm_head_argmax(nan_empty, m, k, vocab, blocks):
    x, nw, w, _ = inputs(m, k, vocab, torch.float32, vocab, False)
    w[vocab // 2] = w[vocab - 3]  # a tie across programs: the first index wins
    w[1] = w[2]  # a tie inside one program
    logits, tokens = lm_head_argmax(x, nw, w, EPS, blocks=blocks)
    ref = rms64(x, nw) @ w.double().T
    assert logits.dtype == torch.float32 and rel_err(logits, ref) < 1e-5
    assert tokens.dtype == torch.int64 and torch.equal(tokens, logits.argmax(-1))
    # make row 0's maximum a tie and check the first index is returned
    x0 = x[:1].clone()
    w2 = w.clone()
    top = int(tokens[0])
    w2[top - 1 if top else top + 1] = w2[top]
    lg, tk = lm_head_argmax(x0, nw, w2, EPS, blocks=blocks)
    assert int(tk[0]) == min(top, top - 1 if top else top + 1) == int(lg.argmax(-1)[0])


def test_pdl_falls_back_off_hopper():
    """No PDL on the CPU or under the interpreter: plain launches, the device calls compiled out."""
    assert not pdl_enabled("cpu") and not pdl_enabled(None)
    assert resolve_pdl(True, "cpu") is False and resolve_pdl(None, "cpu") is False
    assert launch_options(False) == {} and launch_options(True) == {"launch_pdl": True}
    # "detached" (5): compiled with its trigger, launched without the attribute; "early" (4)
    # is a PDL launch
    assert launch_options(5) == {} and launch_options(4) == {"launch_pdl": True}


def test_trigger_modes(monkeypatch):
    """``resolve_pdl``: off -> False; None and True -> mode 1 (the trigger at the wait); a mode
    as given; ``pdl.trigger`` overrides the mode of every PDL launch, never turns PDL on, and
    an unknown value or mode is refused by name; ``pdl.enabled`` off turns every launch off."""
    from stepgraph.kernels import pdl
    from stepgraph.tuning import DecodeTuning, PdlPlacement

    monkeypatch.setattr(pdl, "pdl_enabled", lambda device: True)
    got = [pdl.resolve_pdl(u, "cuda") for u in (None, True, 1, 2, 3, 4, 5, False, 0)]
    assert got == [1, 1, 1, 2, 3, 4, 5, False, False] and got[-1] is False and got[1] is not True
    for name, mode in (("wait", 1), ("late", 2), ("exit", 3)):
        t = DecodeTuning(pdl=PdlPlacement(trigger=name))
        assert [pdl.resolve_pdl(u, "cuda", t) for u in (None, True, 2, False)] == [mode] * 3 + [0]
        assert [pdl.resolve_pdl(u, "cuda", t) for u in (4, 5)] == [4, 5]  # the attention's own
    for name in ("soon", "early", "detached"):  # the two per-kernel modes are no global choice
        with pytest.raises(ValueError, match=f"pdl.trigger='{name}': expected one of"):
            PdlPlacement(trigger=name)
        with pytest.raises(ValueError, match=f"pdl.trigger='{name}': expected one of"):
            pdl.trigger_mode(1, name)
    assert pdl.resolve_pdl(False, "cuda") is False  # off needs no mode
    off = DecodeTuning(pdl=PdlPlacement(enabled=False))
    assert [pdl.resolve_pdl(u, "cuda", off) for u in (None, True, 2, 5)] == [False] * 4
    with pytest.raises(ValueError, match="use_pdl=6"):
        pdl.resolve_pdl(6, "cuda")
    monkeypatch.setattr(pdl, "pdl_enabled", lambda device: False)
    assert pdl.resolve_pdl(2, "cpu") is False and pdl.resolve_pdl(3, "cpu") is False
