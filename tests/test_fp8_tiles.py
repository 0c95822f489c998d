"""FP8 weights' own tiles: the loop forms a tile takes with e4m3 weights (swap-AB through
pointers, the weight the MMA's register operand; TMA swap-AB; TMA with x from pointers; the plain
pointer loop) under the Triton interpreter against float64 over the dequantized weights, at 1,
2, 16, 17 and 64 rows, K not a multiple of the chunk, ragged column tiles, scales of 0 and huge;
``FP8_TILES`` and its rule as pure functions of the bucket; the plan reading them; the bench's
memory check counting the FP8 model it builds beside the first."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch

from stepgraph.errors import ConfigError
from stepgraph.kernels.proj import proj_tiles
from stepgraph.kernels.proj.gate_up_silu import gate_up_silu
from stepgraph.kernels.proj.norm_gemv import gemv_residual
from stepgraph.kernels.proj.proj_tiles import (
    SWAP_POINTERS,
    TARGET_PROGRAMS,
    Tile,
    block_m,
    fp8_default_tile,
    loop_mode,
    tile_for,
    tma_descriptors,
)
from stepgraph.kernels.proj.qkv_rope import qkv_rope, qkv_tile
from stepgraph.kernels.proj.tile_table import FP8_TILES
from stepgraph.model.fp8_weight import quantize_per_channel
from stepgraph.tuning import DecodeTuning, ProjTables
from tests.conftest import rel_err
from tests.references import check_qkv_rope, rms64

TOL = {torch.float32: 1e-5, torch.float16: 3e-3}
EPS = 1e-5
FORMS = {  # every loop form a tensor-core tile can take, with a split of K for two of them
    "swap": Tile(16, 64, 4, 2, 1, SWAP_POINTERS),
    "swap-split": Tile(32, 32, 4, 2, 2, SWAP_POINTERS),
    "tma-swap": Tile(16, 64, 4, 2, 2, 1),
    "tma-x": Tile(16, 64, 4, 2, 1, 2),
    "pointers": Tile(16, 32, 4, 2, 1, 0),
}


def fp8(w: torch.Tensor, zero_row: int | None = None, huge_row: int | None = None):
    """``w`` per channel in e4m3: ``(data, scale, the float64 dequantized weight)``."""
    q = quantize_per_channel(w.float())
    scale = q.scale.clone()
    if zero_row is not None:
        scale[zero_row] = 0.0
    if huge_row is not None:
        scale[huge_row] = 1e30
    return q.data, scale, q.data.double() * scale.double()[:, None]


def inputs(m, k, n, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = (2 * torch.randn(m, k, generator=g)).to(dtype)
    nw = (1 + 0.1 * torch.randn(k, generator=g)).to(dtype)
    w = torch.randn(n, k, generator=g) * k**-0.5
    return x, nw, w


# qkv_rope's shapes here: 4 heads and 2 KV heads of 32, K 80, a cache of 5 pages of 8
QKV_HEADS, QKV_KV_HEADS, QKV_HD, QKV_PAGES, QKV_PS, QKV_K = 4, 2, 32, 5, 8, 80
QKV_N = (QKV_HEADS + 2 * QKV_KV_HEADS) * QKV_HD


def check_qkv_rope_fp8(
    x,
    nw,
    data,
    scale,
    tile,
    qkv64,
    bias=None,
    heads=(QKV_HEADS, QKV_KV_HEADS, QKV_HD),
    cache=(QKV_PAGES, QKV_PS),
    positions=None,
    slots=None,
    tol=None,
    w_block=None,
):
    """``qkv_rope`` of ``x`` (normed in the prologue with ``nw``, or taken as normed with None)
    on the e4m3 ``data``/``scale`` (and ``bias``) at ``tile``, with ``heads`` (q heads, KV
    heads, head_dim) over a cache of ``cache`` (pages, page size), at ``positions`` and cache
    ``slots`` (default: random), checked against ``qkv64``, the float64 projection it should
    match, within ``tol`` (default twice this file's tolerance for x's dtype); ``w_block``:
    ``scale`` is per block of that size."""
    from .test_fused_step_kernels import rope_tables

    (n_heads, n_kv, hd), (pages, ps) = heads, cache
    m, dtype = x.shape[0], x.dtype
    g = torch.Generator().manual_seed(11)
    cos_t, sin_t = rope_tables(hd, 64, dtype, g)
    if positions is None:
        positions = torch.randint(0, 64, (m,), generator=g)
        slots = torch.randperm(pages * ps, generator=g)[:m]
    k_cache = torch.randn(pages, ps, n_kv, hd, generator=g).to(dtype)
    v_cache = torch.randn(pages, ps, n_kv, hd, generator=g).to(dtype)
    k0, v0 = k_cache.clone(), v_cache.clone()
    q = qkv_rope(
        x,
        nw,
        data,
        bias,
        EPS,
        positions,
        cos_t,
        sin_t,
        k_cache,
        v_cache,
        slots,
        n_heads,
        blocks=tile,
        w_scale=scale,
        w_block=w_block,
    )
    caches = (k_cache, v_cache), (k0, v0)
    tol = 2 * TOL[dtype] if tol is None else tol
    check_qkv_rope(q, qkv64, positions, cos_t, sin_t, *caches, slots, n_heads, tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("m", [2, 16, 17, 64])
def test_gemv_residual_fp8_every_form(nan_empty, dtype, form, m):
    # K 144: two chunks of 64 and a partial one (16-byte rows for TMA); N 40: a ragged tile
    k, n = 144, 40
    x, _, w = inputs(m, k, n, dtype, m * 7 + len(form))
    data, scale, w64 = fp8(w, zero_row=1, huge_row=33)
    res = torch.randn(m, n, generator=torch.Generator().manual_seed(2)).to(dtype)
    tile = FORMS[form]
    y = gemv_residual(x, data, res, blocks=tile, w_scale=scale)
    ref = x.double() @ w64.T + res.double()
    keep = [c for c in range(n) if c != 33]
    assert rel_err(y[:, keep], ref[:, keep]) < TOL[dtype]
    assert torch.equal(y[:, 1], res[:, 1])  # scale 0: the projection is 0, the residual stays
    if dtype == torch.float32:  # 1e30 x sums of O(10): in float32's range, unclipped
        assert rel_err(y[:, 33], ref[:, 33]) < TOL[dtype] and y[:, 33].abs().max() > 1e29
    # the form ran as named: descriptors for the TMA tiles, the swap constexpr for tma 3
    descs = tma_descriptors(tile, m, x, data, tile.block_n)
    assert (descs is not None) == (tile.tma in (1, 2))
    assert loop_mode(tile, m, descs) == tile.tma


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("form", ["swap", "swap-split", "tma-swap", "tma-x"])
@pytest.mark.parametrize("m", [2, 17])
def test_gate_up_silu_fp8_every_form(nan_empty, dtype, form, m):
    k, inter = 144, 24  # pairs: one full 16-row tile and a ragged one
    x, nw, w = inputs(m, k, 2 * inter, dtype, m + k)
    data, scale, w64 = fp8(w, zero_row=inter + 2)  # an up row: that output is 0
    out = gate_up_silu(x, nw, data, EPS, blocks=FORMS[form], w_scale=scale)
    gate, up = (rms64(x, nw) @ w64.T).split(inter, dim=-1)
    assert rel_err(out, gate * torch.sigmoid(gate) * up) < 2 * TOL[dtype]
    assert torch.all(out[:, 2] == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("form", ["swap", "swap-split", "tma-swap"])
@pytest.mark.parametrize("m", [2, 17])
def test_qkv_rope_fp8_every_form(nan_empty, dtype, form, m):
    x, nw, w = inputs(m, QKV_K, QKV_N, dtype, 3 * m)
    data, scale, w64 = fp8(w)
    check_qkv_rope_fp8(x, nw, data, scale, FORMS[form], rms64(x, nw) @ w64.T)


A8_FORMS = {  # W8A8 in every loop form
    "a8-swap": Tile(16, 64, 4, 2, 1, SWAP_POINTERS, 1),
    "a8-swap-split": Tile(32, 32, 4, 2, 2, SWAP_POINTERS, 1),
    "a8-tma-swap": Tile(16, 64, 4, 2, 2, 1, 1),
    "a8-tma-x": Tile(16, 64, 4, 2, 1, 2, 1),
    "a8-pointers": Tile(16, 32, 4, 2, 1, 0, 1),
}


def pow2(e: torch.Tensor) -> torch.Tensor:
    """2^e as float32 for integer e in [-126, 127], built from its bits (exact on any device)."""
    return ((e.to(torch.int32) + 127) << 23).view(torch.float32)


def quantized_x(x: torch.Tensor, block_k: int) -> torch.Tensor:
    """``x`` as W8A8 tiles see it, in float64: each row of each ``block_k`` chunk scaled by
    2^(e - 7) (its absmax in [2^e, 2^(e + 1))), rounded to e4m3 (torch: nearest, ties to even),
    scaled back."""
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for k0 in range(0, x.shape[1], block_k):
        xf = x[:, k0 : k0 + block_k].float()
        amax = xf.abs().amax(dim=1)
        e = (((amax.view(torch.int32) >> 23) & 0xFF) - 127).clamp(-100, 127)
        q = (xf * pow2(7 - e)[:, None]).to(torch.float8_e4m3fn)  # exact scaling in float32
        out[:, k0 : k0 + block_k] = q.double() * pow2(e - 7).double()[:, None]
    return out


@pytest.mark.parametrize("form", list(A8_FORMS))
@pytest.mark.parametrize("m", [1, 2, 16, 17, 64])
def test_gemv_residual_w8a8_every_form(nan_empty, form, m):
    """W8A8: against float64 over the same quantized x (tight), and over x itself (loose: e4m3
    keeps 4 significant bits); scale 0 and huge; a row of zeros; K 144 (a partial chunk)."""
    k, n, dtype = 144, 40, torch.float16
    x, _, w = inputs(m, k, n, dtype, m * 3 + len(form))
    wide, zero = m > 1, m > 2
    if zero:
        x[m - 1] = 0  # a row of zeros: its scale is 2^-107, its products 0
    if wide:
        x[0, :5] *= 1e3  # one row's chunk 0 ranging wide: small values go subnormal or to 0
    data, scale, w64 = fp8(w, zero_row=1, huge_row=33)
    res = torch.randn(m, n, generator=torch.Generator().manual_seed(2)).to(dtype)
    tile = A8_FORMS[form]
    y = gemv_residual(x, data, res, blocks=tile, w_scale=scale)
    keep = [c for c in range(n) if c != 33]
    ref = quantized_x(x, tile.block_k) @ w64.T + res.double()
    assert rel_err(y[:, keep], ref[:, keep]) < TOL[dtype]
    assert torch.equal(y[:, 1], res[:, 1]) and (not zero or torch.equal(y[m - 1], res[m - 1]))
    plain = x.double() @ w64.T + res.double()  # rows past the wide one: e4m3's 4 bits
    assert rel_err(y[int(wide) :, keep], plain[int(wide) :, keep]) < 5e-2
    assert torch.isinf(y[int(wide) : m - int(zero), 33]).all()  # 1e30 overflows float16


@pytest.mark.parametrize("form", ["a8-swap", "a8-tma-swap", "a8-pointers"])
@pytest.mark.parametrize("m", [1, 2, 17])
def test_gate_up_and_qkv_w8a8(nan_empty, form, m):
    tile, dtype = A8_FORMS[form], torch.float16
    k, inter = 144, 24
    x, nw, w = inputs(m, k, 2 * inter, dtype, m + 5)
    data, scale, w64 = fp8(w, zero_row=inter + 2)
    out = gate_up_silu(x, None, data, EPS, blocks=tile, w_scale=scale)
    gate, up = (quantized_x(x, tile.block_k) @ w64.T).split(inter, dim=-1)
    assert rel_err(out, gate * torch.sigmoid(gate) * up) < 2 * TOL[dtype]
    assert torch.all(out[:, 2] == 0)
    normed = gate_up_silu(x, nw, data, EPS, blocks=tile, w_scale=scale)  # norm in the prologue
    gate, up = (rms64(x, nw) @ w64.T).split(inter, dim=-1)
    assert rel_err(normed, gate * torch.sigmoid(gate) * up) < 0.12  # silu(gate) * up: twice
    # qkv on a normed x (the handoff's and the separate norm's form)
    x, _, w = inputs(m, QKV_K, QKV_N, dtype, 3 * m)
    data, scale, w64 = fp8(w)
    check_qkv_rope_fp8(x, None, data, scale, tile, quantized_x(x, tile.block_k) @ w64.T)


def test_w8a8_is_for_fp8_weights_and_two_byte_activations():
    """float32 activations and bf16 weights ignore ``a8`` (the float32 path stays exact against
    float64 over the dequantized weights); one row is the GEMV; a8 needs 32 of K a chunk."""
    t = Tile(16, 64, 4, 2, 1, SWAP_POINTERS, 1)
    x16, x32 = torch.zeros(2, 8, dtype=torch.float16), torch.zeros(2, 8)
    assert proj_tiles.act_e4m3(t, 2, True, x16) and not proj_tiles.act_e4m3(t, 2, True, x32)
    assert not proj_tiles.act_e4m3(t, 2, False, x16)
    assert proj_tiles.launch_block_m(t, 1, True, x16) == 16  # one row: tensor cores, M padded
    assert proj_tiles.launch_block_m(t, 1, True, x32) == 1  # float32: the GEMV
    assert proj_tiles.launch_block_m(t, 1, False, x16) == 1  # bf16 weights: the GEMV
    assert proj_tiles.launch_block_m(dataclasses.replace(t, a8=0), 1, True, x16) == 1
    assert not proj_tiles.act_e4m3(dataclasses.replace(t, a8=0), 2, True, x16)
    x, _, w = inputs(17, 144, 40, torch.float32, 9)
    data, scale, w64 = fp8(w)
    y = gemv_residual(x, data, None, blocks=t, w_scale=scale)
    assert rel_err(y, x.double() @ w64.T) < 1e-5  # float32: dequantized, not W8A8
    with pytest.raises(ConfigError, match="block_k >= 32"):
        proj_tiles.check_tile("gemv_residual", Tile(16, 16, 4, 2, 1, SWAP_POINTERS, 1), 2)
    with pytest.raises(ConfigError, match="block_n >= 16"):  # one row: tensor cores too
        proj_tiles.check_tile("gemv_residual", Tile(8, 64, 4, 2, 1, SWAP_POINTERS, 1), 1)
    with pytest.raises(ConfigError, match="a8 must be 0 or 1"):
        proj_tiles.check_tile("gemv_residual", Tile(16, 64, 4, 2, 1, SWAP_POINTERS, 2), 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("k", [200, 4096 + 48])
def test_one_row_fp8_rule_tile(nan_empty, dtype, k):
    """One row: the rule's GEMV tile for e4m3 (block_k in bytes), K past a chunk's multiple."""
    n = 40
    x, _, w = inputs(1, k, n, dtype, k)
    data, scale, w64 = fp8(w, zero_row=0)
    tile = tile_for("gemv_residual", 1, n, k, x.element_size(), fp8=True)
    assert tile == fp8_default_tile("gemv_residual", 1, n, k, x.element_size())
    y = gemv_residual(x, data, None, w_scale=scale)
    assert rel_err(y, x.double() @ w64.T) < TOL[dtype] and torch.all(y[:, 0] == 0)


def test_fp8_rule_counts_bytes_and_programs():
    """One row: 2048 of K and 8k weights a program (of each half where paired), 4 warps, K
    under 2048 in one chunk; from 2 rows swap-AB through pointers, 64 weight rows (qkv 32),
    128 of K, split K until 2 x 132 programs, one chunk a split, or the reduce's partials at
    SPLIT_REGS."""
    shapes = {
        "gemv_residual": [(2048, 2048), (2048, 8192), (4096, 14336)],
        "gate_up_silu_normed": [(16384, 2048), (28672, 4096)],
        "qkv_rope_normed": [(3072, 2048), (6144, 4096)],
    }
    for kernel, sizes in shapes.items():
        for n, k in sizes:
            assert fp8_default_tile(kernel, 1, n, k) == Tile(4, 2048, 4)
            for m in (2, 16, 17, 64):
                t = fp8_default_tile(kernel, m, n, k)
                assert t.tma == SWAP_POINTERS and t.block_n == (32 if "qkv" in kernel else 64)
                parts = 2 if kernel in proj_tiles.PAIRED else 1
                programs = -(-n // parts // t.block_n) * t.split_k
                partials = t.split_k * block_m(m) * t.block_n * parts
                assert t.block_k == 128 and partials <= proj_tiles.SPLIT_REGS
                assert (
                    programs >= TARGET_PROGRAMS
                    or k // (2 * t.split_k) < t.block_k  # one more split: under a chunk
                    or 2 * partials > proj_tiles.SPLIT_REGS
                ), (kernel, n, k, m, t)
                assert k // t.split_k >= t.block_k  # every split a whole chunk at least
    # K short of 2048 (Qwen2.5-0.5B's 896): one chunk of the next power of two, 8 rows; 2049:
    # two chunks of 2048; few rows: no more programs' rows than the weight has
    assert fp8_default_tile("gemv_residual", 1, 896, 896) == Tile(8, 1024, 4)
    assert fp8_default_tile("gemv_residual", 1, 896, 2049) == Tile(4, 2048, 4)
    assert fp8_default_tile("gemv_residual", 1, 2, 1024) == Tile(2, 1024, 4)
    # 8 splits of 64 x 64 spilled registers on sm_90, 4 did not
    assert fp8_default_tile("gemv_residual", 64, 2048, 2048).split_k == 4
    # float32 activations: shorter chunks (the x tile is twice the bytes)
    assert fp8_default_tile("gemv_residual", 8, 2048, 2048, 4).block_k == 64


def test_fp8_tiles_are_read_per_bucket_and_fall_back_to_the_rule():
    key16, key1 = ("gemv_residual", 2048, 2048, 16), ("gemv_residual", 2048, 2048, 1)
    mine, one = Tile(64, 128, 4, 4, 8, SWAP_POINTERS), Tile(16, 1024, 8)
    tables = ProjTables(fp8_tiles={key16: mine, key1: one})
    for m in (2, 3, 4, 5, 16):  # the 16-row class, the 4-row keys absent
        assert tile_for("gemv_residual", m, 2048, 2048, 2, tables, fp8=True) == mine
    assert tile_for("gemv_residual", 1, 2048, 2048, 2, tables, fp8=True) == one
    rule17 = fp8_default_tile("gemv_residual", 17, 2048, 2048)
    assert tile_for("gemv_residual", 17, 2048, 2048, 2, tables, fp8=True) == rule17  # one past
    # bf16 weights never read the FP8 table; float32 activations take the rule
    assert tile_for("gemv_residual", 16, 2048, 2048, 2, tables) != mine
    assert tile_for("gemv_residual", 16, 2048, 2048, 4, tables, fp8=True) == fp8_default_tile(
        "gemv_residual", 16, 2048, 2048, 4
    )
    # qkv at one row: a table tile is the kernel's BLOCK_D as is; the rule's is halved
    q1 = ("qkv_rope", 3072, 2048, 1)
    tq = ProjTables(fp8_tiles={q1: Tile(8, 2048, 8)})
    assert qkv_tile(True, 1, 3072, 2048, 32, 2, tq, True) == Tile(8, 2048, 8)
    rule, none = fp8_default_tile("qkv_rope", 1, 3072, 2048), ProjTables(fp8_tiles={})
    assert qkv_tile(True, 1, 3072, 2048, 32, 2, none, True).block_n == rule.block_n // 2
    with pytest.raises(ValueError, match=r"tables.fp8_tiles"):
        ProjTables(fp8_tiles={key16: (64, 128)})


def test_a_tile_whose_fp8_pipeline_overflows_shared_memory_takes_the_rule():
    key = ("gemv_residual", 2048, 2048, 64)
    big = Tile(256, 256, 8, 8, 1, SWAP_POINTERS)  # 8 x (64 x 2 + 256) x 256 bytes: 768 KB
    tables = ProjTables(fp8_tiles={key: big})
    with pytest.warns(UserWarning, match="over SMEM_BUDGET"):
        t = tile_for("gemv_residual", 64, 2048, 2048, 2, tables, fp8=True)
    assert t == fp8_default_tile("gemv_residual", 64, 2048, 2048)


def test_check_tile_refuses_an_unknown_loop_form():
    proj_tiles.check_tile("gemv_residual", Tile(16, 16, 4, 2, 1, SWAP_POINTERS), 2)
    with pytest.raises(ConfigError, match="tma must be 0"):
        proj_tiles.check_tile("gemv_residual", Tile(16, 16, 4, 2, 1, 4), 2)
    assert loop_mode(Tile(16, 16, 4, 2, 1, SWAP_POINTERS), 1, None) == 0  # one row: the GEMV


def test_the_fp8_plan_takes_fp8_tiles_and_keeps_the_head_in_bf16():
    from stepgraph.model.config import PRESETS
    from stepgraph.model.decode import kernel_plan, step_plan

    shapes = dataclasses.replace(
        kernel_plan.config_shapes(PRESETS["llama-3.2-1b"]), weight_format="fp8-channel"
    )
    o, down = ("gemv_residual", *shapes.o_proj, 16), ("gemv_residual", *shapes.down, 16)
    mine = Tile(64, 128, 4, 4, 8, SWAP_POINTERS)
    tuning = DecodeTuning(tables=ProjTables(fp8_tiles={o: mine}))
    plan = step_plan.plan_step(shapes, 8, 8, tuning)
    assert plan.fused and plan.o_proj.tile == mine
    assert plan.down.tile == fp8_default_tile(*down[:1], 8, *down[1:3])
    assert plan.gate_up.tile.tma == SWAP_POINTERS  # the handoff's _normed kernel, the rule
    assert plan.lm_head.tile == tile_for("lm_head", 8, *shapes.lm_head)  # bf16's table
    one = step_plan.plan_step(shapes, 1, 1, tuning)
    assert one.o_proj.tile == fp8_default_tile("gemv_residual", 1, *shapes.o_proj)
    assert one.qkv.tile == qkv_tile(True, 1, 3072, 2048, 32, 2, ProjTables(fp8_tiles={}), True)
    # the shipped table: its one-row tiles
    shipped = step_plan.plan_step(shapes, 1, 1, DecodeTuning())
    assert shipped.o_proj.tile == FP8_TILES[("gemv_residual", 2048, 2048, 1)]
    assert shipped.qkv.tile == FP8_TILES[("qkv_rope", 3072, 2048, 1)]


def test_fp8_tiles_count_as_measured_for_unmeasured_shapes():
    from stepgraph.model.decode import step_plan

    s = step_plan.StepShapes(
        qkv=(384, 256),
        o_proj=(256, 256),
        gate_up=(1024, 256),
        down=(256, 512),
        lm_head=(1000, 256),
        attention=(4, 2, 64),
        weight_format="fp8-channel",
    )
    assert step_plan.reference_reason(s, 8, DecodeTuning()) == step_plan.UNMEASURED
    keys = {
        ("qkv_rope", 384, 256, 16),
        ("qkv_rope_normed", 384, 256, 16),
        ("gemv_residual", 256, 256, 16),
        ("gate_up_silu", 1024, 256, 16),
        ("gemv_residual", 256, 512, 16),
    }
    fp8_tiles = {key: Tile(16, 64, 4, 2, 1, SWAP_POINTERS) for key in keys}
    tables = ProjTables(fp8_tiles=fp8_tiles, tiles={("lm_head", 1000, 256, 16): Tile(64, 64)})
    assert step_plan.reference_reason(s, 8, DecodeTuning(tables=tables)) is None
    # the LM head stays in the model dtype: an FP8 tile for it does not count
    fp8_tiles[("lm_head", 1000, 256, 16)] = Tile(64, 64)
    tables = ProjTables(fp8_tiles=fp8_tiles)
    assert step_plan.reference_reason(s, 8, DecodeTuning(tables=tables)) == step_plan.UNMEASURED


@pytest.mark.parametrize("quant", ["fp8", "fp8-block"])
def test_bench_memory_counts_the_fp8_model(monkeypatch, quant):
    from stepgraph.bench.args import check_bench_args, quantized_model_bytes
    from stepgraph.bench.workload import bench_bytes, weight_bytes
    from stepgraph.cli_args import UsageError, model_config
    from stepgraph.model import ModelRunner, kv_cache
    from stepgraph.model.fp8_linear import LOAD_BLOCKS

    mr = ModelRunner.from_preset(
        "tiny", "cpu", torch.bfloat16, quantization=quant, max_bs=2, max_context_len=64
    )
    cfg = model_config("tiny")
    parts = bench_bytes(cfg, torch.bfloat16, 2, 16 + 64)
    fp8_parts = quantized_model_bytes(parts, cfg, torch.bfloat16, LOAD_BLOCKS[quant])
    assert cfg.tie_word_embeddings  # so every weight the model holds is one a step reads
    assert fp8_parts["FP8 model's weights"] == weight_bytes(mr)
    assert fp8_parts["FP8 model's KV cache"] == parts["KV cache"]
    need = sum(parts.values()) + sum(fp8_parts.values())
    args = argparse.Namespace(
        device="cuda",
        dtype="bfloat16",
        batch_sizes="2",
        contexts="16",
        model="tiny",
        modes="exact",
        json=None,
        plot=None,
        tp=1,
        quantization=quant,
        serve=False,
        prefill=False,
    )
    monkeypatch.setattr("stepgraph.bench.args.check_mode_flags", lambda a: None)
    monkeypatch.setattr("stepgraph.bench.args.bench_modes", lambda *a: None)
    monkeypatch.setattr(kv_cache, "free_bytes", lambda device: need)
    check_bench_args(args)  # exactly what is free: it fits
    monkeypatch.setattr(kv_cache, "free_bytes", lambda device: need - 1)
    with pytest.raises(UsageError, match=r"FP8 model's weights .*drop --quantization"):
        check_bench_args(args)
    args.quantization = None  # without the second model it fits
    check_bench_args(args)
