"""The fused decode-step kernels on a real GPU, in bf16 at Llama-3.2-1B sizes: against float64
and against the unfused CUDA kernels; PDL on and off bit-identical, eagerly and captured in a
CUDA graph, at 1 to 64 rows (the tensor-core path and split-K from 2); and the compiled PTX of
every PDL kernel of the step (split-KV attention included) waits (``griddepcontrol.wait``)
before its first load of anything but weights.

Nothing touches CUDA at import time: without a GPU the module imports and every test skips.
"""

from __future__ import annotations

import re

import pytest
import torch

from stepgraph.kernels.decode import split_kv
from stepgraph.kernels.decode.flash_decode import flash_decode
from stepgraph.kernels.elementwise.fused_act import silu_mul
from stepgraph.kernels.elementwise.fused_norm import add_rmsnorm
from stepgraph.kernels.elementwise.rope_kv import rope_kv
from stepgraph.kernels.pdl import pdl_enabled
from stepgraph.kernels.proj import gate_up_silu as gus
from stepgraph.kernels.proj import norm_gemv as ng
from stepgraph.kernels.proj import qkv_rope as qr
from stepgraph.kernels.proj.gemv import gemv
from stepgraph.kernels.sampling import lm_head_argmax as lha
from stepgraph.tuning import ArgmaxFold, DecodeTuning
from tests.conftest import rel_err

DEV = "cuda"
EPS = 1e-5
HIDDEN, INTER, N_HEADS, N_KV, HD, VOCAB = 2048, 8192, 32, 8, 64, 128256
PAGES, PAGE_SIZE = 9, 64


def randn(*shape, g, scale=1.0):
    return (scale * torch.randn(*shape, generator=g, device=DEV)).to(torch.bfloat16)


def layer(g):
    """One layer's weights, the residual-stream row scale of a real model."""
    return dict(
        nw1=1 + randn(HIDDEN, g=g, scale=0.1),
        qkv=randn((N_HEADS + 2 * N_KV) * HD, HIDDEN, g=g, scale=HIDDEN**-0.5),
        o=randn(HIDDEN, N_HEADS * HD, g=g, scale=HIDDEN**-0.5),
        nw2=1 + randn(HIDDEN, g=g, scale=0.1),
        gate_up=randn(2 * INTER, HIDDEN, g=g, scale=HIDDEN**-0.5),
        down=randn(HIDDEN, INTER, g=g, scale=INTER**-0.5),
    )


def rope_inputs(m, g):
    pos = torch.arange(4096, device=DEV, dtype=torch.float32)
    inv = 500000.0 ** (-torch.arange(0, HD, 2, device=DEV, dtype=torch.float32) / HD)
    emb = torch.cat([pos[:, None] * inv[None, :]] * 2, dim=-1)
    positions = torch.randint(0, 4096, (m,), generator=g, device=DEV)
    slots = torch.randperm(PAGES * PAGE_SIZE, generator=g, device=DEV)[:m]
    caches = [randn(PAGES, PAGE_SIZE, N_KV, HD, g=g) for _ in range(2)]
    return emb.cos().bfloat16(), emb.sin().bfloat16(), positions, slots, caches


def rms(x, w):  # float64 RMSNorm
    xd = x.double()
    return w.double() * xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + EPS)


def lin(x, w):  # the unfused CUDA projection: the Triton GEMV up to 8 rows, cuBLAS above
    return gemv(x, w) if x.shape[0] <= 8 else torch.nn.functional.linear(x, w)


@pytest.mark.parametrize("m", [1, 3, 8, 17, 32, 64])
def test_fused_projections_bf16(m):
    g = torch.Generator(DEV).manual_seed(m)
    w = layer(g)
    r = randn(m, HIDDEN, g=g)
    # -- gate-up + SiLU against float64 and against add_rmsnorm + gemv + silu_mul --
    act = gus.gate_up_silu(r, w["nw2"], w["gate_up"], EPS)
    gate, up = (rms(r, w["nw2"]) @ w["gate_up"].double().T).split(INTER, dim=-1)
    assert rel_err(act, gate * torch.sigmoid(gate) * up) < 1e-2
    unfused = silu_mul(lin(add_rmsnorm(r, None, w["nw2"], EPS)[0], w["gate_up"]))
    assert rel_err(act, unfused) < 1e-2
    # -- down + residual, o_proj + residual --
    for wt, x in ((w["down"], act), (w["o"], randn(m, N_HEADS * HD, g=g))):
        y = ng.gemv_residual(x, wt, r)
        assert rel_err(y, x.double() @ wt.double().T + r.double()) < 1e-2
        assert rel_err(y, lin(x, wt) + r) < 5e-3
        assert torch.equal(ng.gemv_residual(x, wt, r), y)  # split-K sums in a fixed order
    # -- qkv + RoPE + KV write against the unfused CUDA path --
    cos, sin, positions, slots, (kc, vc) = rope_inputs(m, g)
    kc2, vc2 = kc.clone(), vc.clone()
    q = qr.qkv_rope(r, w["nw1"], w["qkv"], None, EPS, positions, cos, sin, kc, vc, slots, N_HEADS)
    qkv = lin(add_rmsnorm(r, None, w["nw1"], EPS)[0], w["qkv"])
    q_ref = rope_kv(qkv, positions, cos, sin, kc2, vc2, slots, N_HEADS)
    assert rel_err(q, q_ref) < 1e-2 and rel_err(kc, kc2) < 1e-2 and rel_err(vc, vc2) < 1e-2


@pytest.mark.parametrize("m", [1, 5, 64])
def test_lm_head_argmax_bf16(m):
    g = torch.Generator(DEV).manual_seed(10 + m)
    r, nw = randn(m, HIDDEN, g=g), 1 + randn(HIDDEN, g=g, scale=0.1)
    emb = randn(VOCAB, HIDDEN, g=g, scale=0.02)
    logits, tokens = lha.lm_head_argmax(r, nw, emb, EPS)
    ref = rms(r, nw) @ emb.double().T
    assert logits.dtype == torch.float32 and rel_err(logits, ref) < 1e-2
    assert torch.equal(tokens, logits.argmax(-1))


@pytest.mark.parametrize("m", [1, 8, 16])
def test_folded_argmax_in_a_graph_equals_the_two_launches(m, monkeypatch):
    """The argmax folded into the LM head's launch (the default) against its own launch, bf16
    at the real vocab, captured and replayed: the ticket each replay resets serves the next."""
    g = torch.Generator(DEV).manual_seed(30 + m)
    nw, emb = 1 + randn(HIDDEN, g=g, scale=0.1), randn(VOCAB, HIDDEN, g=g, scale=0.02)
    r = randn(m, HIDDEN, g=g)
    out = torch.empty(m, dtype=torch.int64, device=DEV)
    lha.lm_head_argmax(r, nw, emb, EPS, tokens_out=out)  # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logits, _ = lha.lm_head_argmax(r, nw, emb, EPS, tokens_out=out)
    for step in range(3):
        if step:
            r.copy_(randn(m, HIDDEN, g=g))
        out.fill_(-5)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, logits.argmax(-1)), f"replay {step}"
    two_launches = DecodeTuning(argmax=ArgmaxFold(fold=False))  # the last replay's r
    logits_two, two = lha.lm_head_argmax(r, nw, emb, EPS, tuning=two_launches)
    assert torch.equal(logits_two, logits) and torch.equal(two, out)


def fused_chain(w, r, m, rope, use_pdl, tuning=None):
    """Two layers of the fused step minus attention (q feeds o_proj), then the LM head."""
    cos, sin, positions, slots, (kc, vc) = rope
    for _ in range(2):
        q = qr.qkv_rope(
            r,
            w["nw1"],
            w["qkv"],
            None,
            EPS,
            positions,
            cos,
            sin,
            kc,
            vc,
            slots,
            N_HEADS,
            use_pdl=use_pdl,
        )
        r = ng.gemv_residual(q.view(m, -1), w["o"], r, use_pdl=use_pdl)
        a = gus.gate_up_silu(r, w["nw2"], w["gate_up"], EPS, use_pdl=use_pdl)
        r = ng.gemv_residual(a, w["down"], r, use_pdl=use_pdl)
    return lha.lm_head_argmax(r, w["nw1"], w["gate_up"], EPS, use_pdl=use_pdl, tuning=tuning)


@pytest.mark.skipif(not torch.cuda.is_available() or not pdl_enabled(DEV), reason="needs PDL")
@pytest.mark.parametrize("m", [1, 8, 64])
def test_pdl_on_off_identical_eager_and_graph(m):
    g = torch.Generator(DEV).manual_seed(20 + m)
    w = layer(g)
    r = randn(m, HIDDEN, g=g)
    rope = rope_inputs(m, g)
    kv0 = [c.clone() for c in rope[4]]
    ref = fused_chain(w, r, m, rope, use_pdl=False)
    kv_ref = [c.clone() for c in rope[4]]
    for c, c0 in zip(rope[4], kv0):
        c.copy_(c0)
    eager = fused_chain(w, r, m, rope, use_pdl=True)
    assert all(torch.equal(a, b) for a, b in zip(eager, ref))
    assert all(torch.equal(a, b) for a, b in zip(rope[4], kv_ref))
    # -- captured with PDL: the programmatic edges replay correctly --
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_chain(w, r, m, rope, use_pdl=True)
    for _ in range(3):
        for c, c0 in zip(rope[4], kv0):
            c.copy_(c0)
        for o in out:
            o.fill_(-1)
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(out, ref))
        assert all(torch.equal(a, b) for a, b in zip(rope[4], kv_ref))


PDL_KERNELS = [
    ng._norm_gemv_kernel,
    gus._gate_up_silu_kernel,
    qr._qkv_rope_kernel,
    lha._argmax_reduce_kernel,
    split_kv._split_kv_kernel,
    split_kv._combine_kernel,
]
NO_WEIGHTS = (lha._argmax_reduce_kernel, split_kv._split_kv_kernel, split_kv._combine_kernel)
WEIGHT_LOAD = re.compile(r"evict_first|L2::cache_hint|prefetch\.global\.L2")  # TMA tiles prefetch


def compiled_kernels(jit_fn):
    """Every compiled variant of a Triton kernel (its per-device cache; the tuple layout changed
    across Triton versions, the kernel cache is its first element)."""
    for cache in jit_fn.device_caches.values():
        kernels = cache[0] if isinstance(cache, tuple) else cache
        yield from kernels.values()


@pytest.mark.skipif(not torch.cuda.is_available() or not pdl_enabled(DEV), reason="needs PDL")
@pytest.mark.parametrize("kernel", PDL_KERNELS, ids=lambda k: k.__name__)
def test_ptx_waits_before_first_dependent_load(kernel, monkeypatch):
    """In the PTX of each PDL variant: ``griddepcontrol.wait`` is there, only weight loads
    (``evict_first``) come before it, and ``launch_dependents`` follows it (but at a kernel's
    exit, or the one-row combine's "early" trigger before it)."""
    tuning = None
    if kernel is lha._argmax_reduce_kernel:  # the argmax's own launch: only with the fold off
        tuning = DecodeTuning(argmax=ArgmaxFold(fold=False))
    g = torch.Generator(DEV).manual_seed(0)
    w = layer(g)
    fused_chain(w, randn(1, HIDDEN, g=g), 1, rope_inputs(1, g), use_pdl=True, tuning=tuning)
    fused_chain(w, randn(3, HIDDEN, g=g), 3, rope_inputs(3, g), use_pdl=True, tuning=tuning)
    _, _, _, _, (kc, vc) = rope_inputs(2, g)  # the attention between qkv_rope and o_proj
    table = torch.arange(PAGES, device=DEV, dtype=torch.int32)[None, :].repeat(2, 1)
    lens = torch.tensor([200, 1], device=DEV, dtype=torch.int32)
    flash_decode(randn(2, N_HEADS, HD, g=g), kc, vc, table, lens, num_splits=4, use_pdl=True)
    variants = list(compiled_kernels(kernel))
    flags = [getattr(k.metadata, "launch_pdl", None) for k in variants]
    if all(f is None for f in flags):  # a Triton without the field: go by the PTX
        flags = ["griddepcontrol" in k.asm["ptx"] for k in variants]
    pdl = [k for k, f in zip(variants, flags) if f]
    assert pdl, f"{kernel.__name__}: no variant compiled with launch_pdl"
    after = 0  # variants whose trigger follows the wait: this test's own launches (mode 1)
    for k in pdl:
        lines = k.asm["ptx"].splitlines()
        waits = [i for i, s in enumerate(lines) if "griddepcontrol.wait" in s]
        assert waits, f"{kernel.__name__}: no griddepcontrol.wait in the PTX"
        before = [s.strip() for s in lines[: waits[0]] if "ld.global" in s or "prefetch." in s]
        stray = [s for s in before if not WEIGHT_LOAD.search(s)]
        stray += [s.strip() for s in lines[: waits[0]] if "cp.async.bulk.tensor" in s]  # TMA
        assert not stray, f"{kernel.__name__}: loads before the wait: {stray[:4]}"
        trigger = [i for i, s in enumerate(lines) if "griddepcontrol.launch_dependents" in s]
        # variants the step compiled in this process (other test files) may trigger at their
        # exit (none: the combine from two rows) or, the combine at one row ("early"), once
        # before the wait; every other trigger follows the wait
        early = kernel is split_kv._combine_kernel and trigger and trigger[0] < waits[0]
        assert all(i > waits[0] for i in trigger) or early and len(trigger) == 1, (
            f"{kernel.__name__}: trigger before the wait"
        )
        after += any(i > waits[0] for i in trigger)
        tma = "cp.async.bulk.tensor" in k.asm["ptx"]  # TMA tiles: no weight held (tma_tiles)
        if kernel not in NO_WEIGHTS and not tma:  # the GEMVs prefetch weights before it
            assert before, f"{kernel.__name__}: no weight load was issued before the wait"
    assert after, f"{kernel.__name__}: no variant triggers after its wait"


@pytest.mark.parametrize("m", [2, 8, 16])
def test_llama_8b_o_proj_and_gate_up_tiles(m):
    """The 8B's table tiles at 2-16 rows (key 16): o_proj with the norm handoff out, then gate-up
    on the handoff (the step's pair from bucket 2), against float64; split-K sums in a fixed
    order (the same bits twice)."""
    hidden, inter = 4096, 14336
    g = torch.Generator(DEV).manual_seed(30 + m)
    wo = randn(hidden, hidden, g=g, scale=hidden**-0.5)
    wgu = randn(2 * inter, hidden, g=g, scale=hidden**-0.5)
    nw = 1 + randn(hidden, g=g, scale=0.1)
    x, r = randn(m, hidden, g=g), randn(m, hidden, g=g)
    y, xw, ssq = ng.gemv_residual(x, wo, r, next_norm=nw)
    assert rel_err(y, x.double() @ wo.double().T + r.double()) < 1e-2
    act = gus.gate_up_silu(xw, None, wgu, EPS, ssq=ssq)
    gate, up = (rms(y, nw) @ wgu.double().T).split(inter, dim=-1)
    assert rel_err(act, gate * torch.sigmoid(gate) * up) < 1e-2
    again = gus.gate_up_silu(xw, None, wgu, EPS, ssq=ssq)
    assert torch.equal(ng.gemv_residual(x, wo, r, next_norm=nw)[0], y) and torch.equal(again, act)
