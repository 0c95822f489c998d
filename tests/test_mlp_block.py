"""``kernels/mlp_block`` on the CPU (Triton interpreter): o_proj, gate-up and down in one
persistent launch compute the bits of the three launches they replace (``gemv_residual`` with
the handoff, ``gate_up_silu`` on it, ``gemv_residual``), are close to a float64 reference,
leave every counter of their sync area at zero (a graph replays the same buffers), refuse what
they cannot run with a ConfigError, and serve the fused step behind ``STEPGRAPH_MLP_BLOCK``."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from stepgraph.errors import ConfigError
from stepgraph.kernels import block_sync
from stepgraph.kernels import mlp_block as mb
from stepgraph.kernels import mlp_block_plan as plan
from stepgraph.kernels.gate_up_silu import gate_up_silu
from stepgraph.kernels.norm_gemv import gemv_residual
from stepgraph.kernels.proj_tiles import Tile, splitk_workspace

EPS = 1e-5
# o_proj: KA 192 in two splits of 128 and 64 (two and one K chunks); gate-up: H in two splits of
# four chunks; down: I in four splits of four chunks each, four gate-up tiles a split
SPLITS = mb.BlockTiles(Tile(32, 64, 4, 1, 2), Tile(32, 32, 4, 3, 2), Tile(64, 32, 4, 5, 4))


def tiles(tma: int) -> mb.BlockTiles:
    """``SPLITS`` with the weights through TMA: o_proj's x from pointers (``tma`` 2), gate-up's
    and down's x by descriptor too (``tma`` 1)."""
    o, g, d = SPLITS.o, SPLITS.gate_up, SPLITS.down
    return mb.BlockTiles(Tile(o.block_n, o.block_k, 4, 1, o.split_k, 2 if tma else 0),
                         Tile(g.block_n, g.block_k, 4, 3, g.split_k, tma),
                         Tile(d.block_n, d.block_k, 4, 5, d.split_k, tma))  # fmt: skip


def weights(m, h, ka, inter, dtype, seed):
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g)).to(dtype)

    return dict(
        o=rnd(m, ka), r=rnd(m, h), wo=rnd(h, ka, scale=ka**-0.5), norm2_w=rnd(h).abs() + 0.5,
        w_gu=rnd(2 * inter, h, scale=h**-0.5), wd=rnd(h, inter, scale=inter**-0.5),
        next_norm=rnd(h).abs() + 0.5,
    )  # fmt: skip


def three_launches(w, t: mb.BlockTiles, next_norm=True):
    """What the step runs without the block, with the block's tiles."""
    r1, xw1, ssq1 = gemv_residual(w["o"], w["wo"], w["r"], next_norm=w["norm2_w"], blocks=t.o)
    a = gate_up_silu(xw1, None, w["w_gu"], EPS, ssq=ssq1, blocks=t.gate_up)
    nn = w["next_norm"] if next_norm else None
    return gemv_residual(a, w["wd"], r1, next_norm=nn, blocks=t.down)


def block(w, t=None, next_norm=True, **kw):
    return mb.mlp_block(w["o"], w["r"], w["wo"], w["norm2_w"], w["w_gu"], EPS, w["wd"],
                        w["next_norm"] if next_norm else None, tiles=t, **kw)  # fmt: skip


def sync_area(device="cpu"):
    return splitk_workspace(torch.device(device), 1, 1)[1]


def poison_partials():
    """NaN in every split-K partial: a read of one this launch did not write shows."""
    splitk_workspace(torch.device("cpu"), 1, 1)[0].fill_(float("nan"))


@pytest.mark.parametrize(
    "dtype, m, h, inter, tma, programs",
    [
        (torch.float32, 2, 256, 512, 0, 1),
        (torch.float32, 3, 240, 500, 0, 3),  # ragged: last tiles, splits and a short down split
        (torch.float16, 17, 256, 512, 1, 4),  # M padded to 32; TMA, x by descriptor
        (torch.float16, 64, 256, 512, 2, 2),  # M = 64; TMA weights, x from pointers
        (torch.float16, 9, 256, 512, 0, 1000),  # more programs than items
        (torch.float32, 5, 256, 512, -1, 3),  # gate-up without split-K, as the 1B's tiles
    ],
)
def test_block_computes_the_three_launches_bits(dtype, m, h, inter, tma, programs):
    w = weights(m, h, 192, inter, dtype, seed=m)
    t = tiles(tma) if tma >= 0 else replace(SPLITS, gate_up=Tile(32, 32, 4, 3, 1))
    want = three_launches(w, t)
    poison_partials()
    got = block(w, t, programs=programs)
    for name, a, b in zip(("r2", "xw2", "ssq2"), got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert torch.equal(a, b), (name, (a.float() - b.float()).abs().max().item())
    assert int(sync_area()[: block_sync.sync_slots(1 + t.down.split_k)].abs().sum()) == 0


def test_block_is_close_to_float64():
    """Against the unfused math in float64 (not the kernels the block reuses)."""
    w = weights(5, 256, 192, 512, torch.float32, seed=7)
    r2 = block(w, SPLITS, next_norm=False)
    d = {k: v.double() for k, v in w.items()}
    r1 = d["r"] + d["o"] @ d["wo"].T
    x = r1 * torch.rsqrt(r1.pow(2).mean(-1, keepdim=True) + EPS) * d["norm2_w"]
    gate, up = (x @ d["w_gu"].T).chunk(2, dim=-1)
    ref = r1 + (F.silu(gate) * up) @ d["wd"].T
    assert ((r2.double() - ref).norm() / ref.norm()).item() < 1e-5


def test_a_second_launch_sees_fresh_counters():
    """Two launches on one sync area with different inputs: each equals its three launches
    (a counter left behind would skip items or wait forever), without the handoff out too."""
    for seed in (1, 2):
        w = weights(6, 256, 192, 512, torch.float32, seed)
        assert torch.equal(block(w, SPLITS, next_norm=False, programs=2),
                           three_launches(w, SPLITS, next_norm=False))  # fmt: skip


def test_stride_schedule(monkeypatch):
    w = weights(4, 256, 192, 512, torch.float32, seed=3)
    want = three_launches(w, SPLITS)
    monkeypatch.setenv(mb.SCHEDULE_ENV, "stride")
    got = block(w, SPLITS, programs=1)  # one program: its items in order, as the queue's
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    with pytest.raises(ConfigError, match="resident"):  # the interpreter would wait forever
        block(w, SPLITS, programs=2)
    monkeypatch.setenv(mb.SCHEDULE_ENV, "static")
    with pytest.raises(ConfigError, match="'queue' or 'stride'"):
        block(w, SPLITS)


@pytest.mark.parametrize("m, ok", [(0, False), (1, True), (2, True), (64, True), (65, False)])
def test_block_rows_at_their_limits(m, ok):
    if ok:  # the 1B's table from two rows, the one-row rule at one
        assert mb.block_tiles(m, 2048, 2048, 8192).gate_up.block_n == (16 if m == 1 else 64)
    else:
        with pytest.raises(ConfigError, match="1 to 64 rows"):
            mb.block_tiles(m, 2048, 2048, 8192)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_one_row_is_the_separate_launches_at_its_tiles(dtype):
    """One row (the GEMV loop, down in four splits, the next qkv too): the block against the
    separate launches at the one-row rule's tiles, bit for bit."""
    from stepgraph.kernels.qkv_rope import qkv_rope

    w = weights(1, 256, 192, 2048, dtype, seed=11)
    t = plan.one_row_tiles(2048, qkv=True)
    assert t.down.split_k == 4
    nq = next_qkv(1, 256, dtype, seed=11, bias=True)
    caches = [c.clone() for c in (nq.k_cache, nq.v_cache)]
    want = three_launches(w, t)
    q = qkv_rope(want[1], None, nq.weight, nq.bias, nq.eps, nq.positions, nq.cos, nq.sin,
                 *caches, nq.slots, nq.n_heads, ssq=want[2], blocks=t.qkv)  # fmt: skip
    poison_partials()
    got = block(w, t, qkv=nq)
    for name, a, b in zip(("r2", "xw2", "ssq2", "q"), got, (*want, q)):
        assert torch.equal(a, b), (name, (a.float() - b.float()).abs().max().item())
    assert torch.equal(nq.k_cache, caches[0]) and torch.equal(nq.v_cache, caches[1])
    assert torch.equal(block(w, t, next_norm=False), three_launches(w, t, next_norm=False))


def test_block_tiles_refusals(monkeypatch):
    def table(o, g, d):
        picks = {"gemv_residual": iter([o, d]), "gate_up_silu_normed": iter([g])}
        monkeypatch.setattr(plan, "tile_for", lambda kernel, *a: next(picks[kernel]))

    table(Tile(32, 64, 4), Tile(32, 32, 8), Tile(64, 32, 4))  # one launch, one warp count
    with pytest.raises(ConfigError, match="one warp count"):
        mb.block_tiles(4, 256, 256, 512)
    table(Tile(32, 64, 4), Tile(48, 32, 4), Tile(64, 32, 4, 3, 4))  # 128 per split, 48 a tile
    with pytest.raises(ConfigError, match="not a multiple"):
        mb.block_tiles(4, 256, 256, 512)
    table(Tile(32, 64, 4), Tile(64, 32, 4), Tile(64, 32, 4, 3, 2))  # 256 per split: fine
    assert mb.block_tiles(4, 256, 256, 512).down.split_k == 2


def test_bad_inputs_name_the_tensor():
    w = weights(4, 256, 192, 512, torch.float32, seed=0)
    with pytest.raises(ConfigError, match="wd must be"):
        block({**w, "wd": w["wd"][:, :256]}, SPLITS)
    with pytest.raises(ConfigError, match=r"w_gu must be .*torch.float32, got .*float16"):
        block({**w, "w_gu": w["w_gu"].half()}, SPLITS)
    with pytest.raises(ConfigError, match="o must be"):
        block({**w, "o": w["o"].T.contiguous().T}, SPLITS)  # rows not contiguous


def test_prefetch_lines(monkeypatch):
    t = Tile(64, 128, 4, 5, 4, 1)  # down at the 1B: 64 rows x 2048 of K a split
    assert mb.prefetch_lines(t, 8192, 2) == 32768 // 128
    monkeypatch.setenv(mb.PREFETCH_ENV, "0")
    assert mb.prefetch_lines(t, 8192, 2) == 0
    monkeypatch.setenv(mb.PREFETCH_ENV, str(1 << 30))  # capped at the tile's whole range
    assert mb.prefetch_lines(t, 8192, 2) == 64 * 2048 * 2 // 128
    assert mb.prefetch_lines(t, 8192, 4) == 64 * 2048 * 4 // 128
    monkeypatch.setenv(mb.PREFETCH_ENV, "200")  # one 128-byte line: a power of two below
    assert mb.prefetch_lines(t, 8192, 2) == 1


def test_check_fault_raises_once():
    sync = torch.zeros(8, dtype=torch.int32)
    block_sync.check_fault(sync, "x")  # nothing marked
    sync[block_sync.FAULT] = 1
    with pytest.raises(RuntimeError, match="would hang"):
        block_sync.check_fault(sync, "x")
    assert int(sync[block_sync.FAULT]) == 0


@pytest.mark.parametrize("with_qkv", [False, True])
@pytest.mark.parametrize("bs", [3, 17])
def test_the_step_with_the_block_is_bit_for_bit_the_step_without(bs, with_qkv, monkeypatch):
    """The fused step at the tiny preset, the norm handoff at every bucket above one: with
    ``MLP_BLOCK`` every layer's second half is one ``mlp_block`` launch (a spy counts them; with
    ``BLOCK_QKV`` every one but the last runs the next layer's qkv too), and the logits, tokens
    and K/V equal those without it."""
    from stepgraph.bench.workload import Point, build_model_runner, decode_batch, fill_kv_random
    from stepgraph.model import fused_decode, fused_mlp

    mr = build_model_runner("tiny", "cpu", torch.float32, max_bs=17, max_context=64)
    fill_kv_random(mr)
    monkeypatch.setattr(fused_decode, "REFERENCE_ROWS", range(0))
    monkeypatch.setattr(fused_decode, "_measured", lambda model, rows: True)
    monkeypatch.setattr(fused_decode, "HANDOFF_MIN_BUCKET", 2)
    monkeypatch.setattr(fused_mlp, "BLOCK_QKV", with_qkv)
    calls = []
    monkeypatch.setattr(fused_mlp, "mlp_block", lambda *a, **k: calls.append(k["qkv"] is not None)
                        or mb.mlp_block(*a, **k))  # fmt: skip
    batch, pages = decode_batch(mr, Point(bs, 40), seed=bs)
    kv = (*mr.kv_cache.k_caches, *mr.kv_cache.v_caches)
    kv0 = [c.clone() for c in kv]
    runs = []
    try:
        for on in (False, True):
            monkeypatch.setattr(fused_mlp, "MLP_BLOCK", on)
            for c, c0 in zip(kv, kv0):
                c.copy_(c0)
            mr.attn_backend.init_forward_metadata(batch)
            tokens = torch.full((bs,), -1, dtype=torch.int64)
            logits = fused_decode.fused_decode_step(mr.model, mr.attn_backend, batch.input_ids,
                                                    batch.positions, tokens_out=tokens)  # fmt: skip
            runs.append((logits.clone(), tokens, [c.clone() for c in kv]))
    finally:
        for p in pages:
            mr.kv_cache.release(p)
    layers = mr.config.num_layers  # the block ran once a layer, only when on
    assert calls == [with_qkv] * (layers - 1) + [False]
    (l0, t0, kv_a), (l1, t1, kv_b) = runs
    assert torch.equal(l0, l1) and torch.equal(t0, t1) and (t0 >= 0).all()
    assert all(torch.equal(a, b) for a, b in zip(kv_a, kv_b))


def test_the_plan_names_the_block(monkeypatch):
    from stepgraph.model import fused_mlp, kernel_plan
    from stepgraph.model.config import PRESETS

    cfg = PRESETS["llama-3.2-1b"]
    for on in (False, True):
        monkeypatch.setattr(fused_mlp, "MLP_BLOCK", on)
        monkeypatch.setattr(fused_mlp, "BLOCK_QKV", on)
        paths = {b: p for b, p, _ in kernel_plan.kernel_plan(cfg)}
        named = {b for b, p in paths.items() if "in one launch (STEPGRAPH_MLP_BLOCK)" in p}
        # the handoff's buckets (2 on), where gate-up is fused at every one of them
        assert named == ({b for b in paths if b >= 2} if on else set())
        # the next qkv where it is fused (qkv takes cuBLAS at 33-64 rows)
        qkv = {b for b, p in paths.items() if "with the next layer's qkv" in p}
        assert qkv == ({b for b in paths if 2 <= b <= 32} if on else set())
    monkeypatch.setattr(fused_mlp, "ONE_ROW", True)  # and at one row, with the handoff there
    plans = {b: (p, c) for b, p, c in kernel_plan.kernel_plan(cfg)}
    assert "in one launch (STEPGRAPH_MLP_BLOCK) with the next layer's qkv" in plans[1][0]
    assert "the norm from the sums of squares" in plans[1][1]["lm_head"]


def test_the_grid(monkeypatch):
    cpu = torch.device("cpu")
    assert plan.grid_size(cpu, 512, None, False) == 2  # two "SMs" off CUDA
    monkeypatch.setenv(mb.PER_SM_ENV, "3")
    assert plan.grid_size(cpu, 512, None, False) == 6
    assert plan.grid_size(cpu, 5, None, False) == 5  # at most one an item
    assert plan.grid_size(cpu, 512, 1000, False) == 512
    with pytest.raises(ConfigError, match="programs must be >= 1"):
        plan.grid_size(cpu, 512, 0, False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # compiled: stride takes one a SM
    assert plan.grid_size(cpu, 512, 2, True) == 2
    with pytest.raises(ConfigError, match="resident"):
        plan.grid_size(cpu, 512, 3, True)


def next_qkv(m, h, dtype, seed, bias: bool):
    """The next layer's qkv inputs at 4 query and 2 key/value heads of 64 (HALF 32), caches of
    random contents, distinct slots."""
    g = torch.Generator().manual_seed(seed)
    n_heads, n_kv, hd = 4, 2, 64
    rows = (n_heads + 2 * n_kv) * hd
    ang = torch.rand(64, hd // 2, generator=g) * 6.0
    cos, sin = (torch.cat([f(ang)] * 2, dim=-1).to(dtype) for f in (torch.cos, torch.sin))
    caches = [torch.randn(5, 16, n_kv, hd, generator=g).to(dtype) for _ in range(2)]
    return plan.NextQkv(
        weight=(torch.randn(rows, h, generator=g) * h**-0.5).to(dtype),
        bias=torch.randn(rows, generator=g).to(dtype) if bias else None, eps=1e-6,
        positions=torch.randint(0, 64, (m,), generator=g), cos=cos, sin=sin,
        k_cache=caches[0], v_cache=caches[1], slots=torch.randperm(80, generator=g)[:m],
        n_heads=n_heads,
    )  # fmt: skip


@pytest.mark.parametrize(
    "dtype, m, qkv_tile, bias, tma",
    [
        (torch.float32, 3, Tile(16, 32, 4, 3, 2), True, 0),  # two tiles a head's half, split-K
        (torch.float16, 17, Tile(64, 64, 4, 3, 1), False, 0),  # BLOCK_D above the half: masked
        (torch.float16, 9, Tile(32, 32, 4, 3, 4, 1), True, 1),  # TMA, x by descriptor
    ],
)
def test_the_next_qkv_in_the_block_is_qkv_rope(dtype, m, qkv_tile, bias, tma):
    """The block with the next layer's qkv computes what the block and then ``qkv_rope`` on its
    handoff compute: q, the K/V written into both caches, and r2 with the handoff."""
    from stepgraph.kernels.qkv_rope import qkv_rope

    w = weights(m, 256, 192, 512, dtype, seed=m)
    t = replace(tiles(tma), qkv=qkv_tile)
    nq = next_qkv(m, 256, dtype, seed=m, bias=bias)
    ref_caches = [c.clone() for c in (nq.k_cache, nq.v_cache)]
    want = block(w, t)
    q_want = qkv_rope(want[1], None, nq.weight, nq.bias, nq.eps, nq.positions, nq.cos, nq.sin,
                      *ref_caches, nq.slots, nq.n_heads, ssq=want[2], blocks=qkv_tile)  # fmt: skip
    poison_partials()
    got = block(w, t, qkv=nq, programs=3)
    assert len(got) == 4
    for name, a, b in zip(("r2", "xw2", "ssq2", "q"), got, (*want, q_want)):
        assert torch.equal(a, b), (name, (a.float() - b.float()).abs().max().item())
    assert torch.equal(nq.k_cache, ref_caches[0]) and torch.equal(nq.v_cache, ref_caches[1])
    n = block_sync.sync_slots(1 + t.down.split_k + 1)
    assert int(sync_area()[:n].abs().sum()) == 0


def test_the_next_qkv_needs_its_norm_and_its_shape():
    w = weights(4, 256, 192, 512, torch.float32, seed=0)
    nq = next_qkv(4, 256, torch.float32, seed=0, bias=False)
    with pytest.raises(ConfigError, match="qkv needs next_norm"):
        mb.mlp_block(w["o"], w["r"], w["wo"], w["norm2_w"], w["w_gu"], EPS, w["wd"], qkv=nq)
    with pytest.raises(ConfigError, match="qkv.weight must be"):
        block(w, replace(SPLITS, qkv=Tile(16, 32, 4)), qkv=replace(nq, weight=nq.weight[:, :128]))
    with pytest.raises(ConfigError, match="block_n >= 16"):  # tensor cores: the kernels' check
        block(w, replace(SPLITS, qkv=Tile(8, 32, 4)), qkv=nq)
    with pytest.raises(ConfigError, match="the tiles have none for it"):
        block(w, SPLITS, qkv=nq)
    with pytest.raises(ConfigError, match="BLOCK_D must be a power of two"):
        plan.block_tiles(4, 256, 256, 512, 2, qkv=(256, 24))  # the rule's 16 does not divide 24


def test_maxnreg_switch(monkeypatch):
    monkeypatch.delenv(plan.MAXNREG_ENV, raising=False)
    assert plan.launch_extra() == {}
    monkeypatch.setenv(plan.MAXNREG_ENV, "224")
    assert plan.launch_extra() == {}  # the interpreter has no registers to cap
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert plan.launch_extra() == {"maxnreg": 224}
    for bad in ("23", "256", "many"):  # one past each end, and not a number
        monkeypatch.setenv(plan.MAXNREG_ENV, bad)
        with pytest.raises(ConfigError, match="register count in 24-255"):
            plan.launch_extra()
    for edge in (24, 255):  # at each end
        monkeypatch.setenv(plan.MAXNREG_ENV, str(edge))
        assert plan.launch_extra() == {"maxnreg": edge}


@pytest.mark.parametrize("with_qkv", [False, True])
def test_the_step_at_one_row_with_the_block(with_qkv, monkeypatch):
    """``ONE_ROW``: bs 1 runs the block (its one-row tiles, so not the bits of the one-row
    kernels' tiles) with the norm handoff into and out of it; the logits, tokens and K/V match
    the reference ops, and the block ran once a layer (with the next qkv in all but the last)."""
    from stepgraph.bench.workload import Point, build_model_runner, decode_batch, fill_kv_random
    from stepgraph.model import fused_decode, fused_mlp

    mr = build_model_runner("tiny", "cpu", torch.float32, max_bs=4, max_context=64)
    fill_kv_random(mr)
    for name, value in (("MLP_BLOCK", True), ("ONE_ROW", True), ("BLOCK_QKV", with_qkv)):
        monkeypatch.setattr(fused_mlp, name, value)
    assert fused_decode.handoff(1, mr.model)  # the handoff at one row, for the block
    calls = []
    monkeypatch.setattr(fused_mlp, "mlp_block", lambda *a, **k: calls.append(k["qkv"] is not None)
                        or mb.mlp_block(*a, **k))  # fmt: skip
    batch, pages = decode_batch(mr, Point(1, 30), seed=4)
    kv = (*mr.kv_cache.k_caches, *mr.kv_cache.v_caches)
    try:
        kv0 = [c.clone() for c in kv]
        ref = mr.forward(batch)  # the reference ops (the CPU default)
        kv_ref = [c.clone() for c in kv]
        for c, c0 in zip(kv, kv0):
            c.copy_(c0)
        mr.attn_backend.init_forward_metadata(batch)
        tokens = torch.full((1,), -1, dtype=torch.int64)
        logits = fused_decode.fused_decode_step(mr.model, mr.attn_backend, batch.input_ids,
                                                batch.positions, tokens_out=tokens)  # fmt: skip
    finally:
        for p in pages:
            mr.kv_cache.release(p)
    assert calls == [with_qkv] * (mr.config.num_layers - 1) + [False]
    assert ((logits - ref).norm() / ref.norm()).item() < 1e-5
    assert torch.equal(tokens, ref.argmax(-1))
    assert max((a - b).abs().max().item() for a, b in zip(kv, kv_ref)) < 1e-5
