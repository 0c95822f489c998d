"""The fused projections at several rows (``tl.dot``, M padded to 16/32/64, split-K) under the
Triton interpreter, float32 and float16, bs 1, 2, 3, 17 and 64, at odd sizes whose K loops run
several chunks and whose column tiles end ragged; float64 references written here, outputs
poisoned with NaN first. The tile rule of ``proj_tiles`` is checked as a pure function."""

from __future__ import annotations

import pytest
import torch

from stepgraph.errors import ConfigError
from stepgraph.kernels.proj import proj_tiles
from stepgraph.kernels.proj.gate_up_silu import gate_up_silu
from stepgraph.kernels.proj.norm_gemv import gemv_residual, norm_gemv
from stepgraph.kernels.proj.proj_tiles import Tile, block_m, default_tile, tile_for
from stepgraph.kernels.proj.qkv_rope import qkv_rope
from stepgraph.kernels.sampling.lm_head_argmax import lm_head_argmax
from tests.conftest import rel_err
from tests.references import check_qkv_rope, rms64

TOL = {torch.float32: 1e-5, torch.float16: 3e-3}
EPS = 1e-5
ROWS = [1, 2, 3, 17, 64]


def rand(g, *shape, scale=1.0):
    return scale * torch.randn(*shape, generator=g)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("split_k", [1, 3])
def test_gemv_residual_rows(nan_empty, dtype, m, split_k):
    # K = 80 in chunks of 32: 3 chunks (the last ragged); N = 40 in tiles of 16: 3 tiles
    g = torch.Generator().manual_seed(100 * m + split_k)
    k, n = 80, 40
    x, w = rand(g, m, k).to(dtype), rand(g, n, k, scale=k**-0.5).to(dtype)
    res = rand(g, m, n).to(dtype)
    tile = Tile(16, 32, 4, None, split_k) if m > 1 or split_k > 1 else Tile(8, 32, 4)
    y = gemv_residual(x, w, res, blocks=tile)
    assert y.shape == (m, n) and y.dtype == dtype
    assert rel_err(y, x.double() @ w.double().T + res.double()) < TOL[dtype]
    # deterministic (split order fixed), the tickets left at zero, in place on the residual
    assert torch.equal(gemv_residual(x, w, res, blocks=tile), y)
    assert not proj_tiles._WORKSPACES or all(
        int(t.abs().sum()) == 0 for _, t in proj_tiles._WORKSPACES.values()
    )
    res2 = res.clone()
    assert gemv_residual(x, w, res2, out=res2, blocks=tile) is res2 and torch.equal(res2, y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m, split_k", [(2, 2), (17, 1), (64, 2)])
def test_norm_gemv_rows(nan_empty, dtype, m, split_k):
    g = torch.Generator().manual_seed(m)
    k, n = 72, 33
    x, nw = rand(g, m, k, scale=2).to(dtype), (1 + rand(g, k, scale=0.1)).to(dtype)
    w, b = rand(g, n, k, scale=k**-0.5).to(dtype), rand(g, n).to(dtype)
    y = norm_gemv(x, nw, w, b, EPS, torch.float32, blocks=Tile(16, 16, 4, 2, split_k))
    assert y.dtype == torch.float32
    assert rel_err(y, rms64(x, nw) @ w.double().T + b.double()) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("split_k", [1, 2])
def test_gate_up_silu_rows(nan_empty, dtype, m, split_k):
    g = torch.Generator().manual_seed(7 * m)
    k, inter = 48, 24  # 2 tiles of 16 pairs (the second ragged), 3 chunks of K
    x, nw = rand(g, m, k, scale=2).to(dtype), (1 + rand(g, k, scale=0.1)).to(dtype)
    w = rand(g, 2 * inter, k, scale=k**-0.5).to(dtype)
    tile = Tile(16, 16, 4, None, split_k) if m > 1 or split_k > 1 else None
    out = gate_up_silu(x, nw, w, EPS, blocks=tile)
    gate, up = (rms64(x, nw) @ w.double().T).split(inter, dim=-1)
    assert out.shape == (m, inter)
    assert rel_err(out, gate * torch.sigmoid(gate) * up) < 2 * TOL[dtype]


@pytest.mark.parametrize("tma", [0, 1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m, hd, split_k", [(2, 16, 1), (3, 64, 3), (17, 16, 2), (64, 64, 1)])
def test_qkv_rope_rows(nan_empty, monkeypatch, tma, dtype, m, hd, split_k):
    # tma 1 and 2: the TMA tiles (tma_tiles), a spy counting their descriptors (boxes run past
    # the half at hd 16)
    # hd 16: BLOCK_D 16 > HALF 8 (one masked tile a head); hd 64: two tiles of 16 a head
    n_heads, n_kv, ps, k = 4, 2, 8, 40
    pages = (m + ps - 1) // ps + 2
    g = torch.Generator().manual_seed(m + hd)
    n = (n_heads + 2 * n_kv) * hd
    x, nw = rand(g, m, k, scale=2).to(dtype), (1 + rand(g, k, scale=0.1)).to(dtype)
    w, b = rand(g, n, k, scale=k**-0.5).to(dtype), rand(g, n).to(dtype)
    ang = torch.rand(80, hd // 2, generator=g, dtype=torch.float64) * 6
    emb = torch.cat((ang, ang), -1)
    cos_t, sin_t = emb.cos().to(dtype), emb.sin().to(dtype)
    positions = torch.randint(0, 80, (m,), generator=g)
    slots = torch.randperm(pages * ps, generator=g)[:m]
    k_cache = rand(g, pages, ps, n_kv, hd).to(dtype)
    v_cache = rand(g, pages, ps, n_kv, hd).to(dtype)
    k0, v0 = k_cache.clone(), v_cache.clone()
    tile = Tile(16, 16, 4, None, split_k, tma) if m > 1 else None
    descs = []
    real = proj_tiles.descriptor
    monkeypatch.setattr(proj_tiles, "descriptor", lambda *a: descs.append(a) or real(*a))
    q = qkv_rope(
        x, nw, w, b, EPS, positions, cos_t, sin_t, k_cache, v_cache, slots, n_heads, blocks=tile
    )
    assert len(descs) == (0 if tma == 0 else 3 - tma)
    qkv = rms64(x, nw) @ w.double().T + b.double()
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m", [2, 17, 64])
def test_lm_head_argmax_rows(nan_empty, dtype, m):
    g = torch.Generator().manual_seed(3 * m)
    k, vocab = 40, 70  # 5 programs of 16 columns, the last ragged
    x, nw = rand(g, m, k, scale=2).to(dtype), (1 + rand(g, k, scale=0.1)).to(dtype)
    w = rand(g, vocab, k, scale=k**-0.5).to(dtype)
    w[50] = w[20]  # a tie across programs: the first index wins
    logits, tokens = lm_head_argmax(x, nw, w, EPS, blocks=Tile(16, 16, 4, None, 1 + m % 3))
    ref = rms64(x, nw) @ w.double().T
    assert logits.dtype == torch.float32 and rel_err(logits, ref) < TOL[dtype]
    assert torch.equal(tokens, logits.argmax(-1))


def test_tile_rule():
    assert [block_m(m) for m in (1, 2, 16, 17, 33, 64)] == [1, 16, 16, 32, 64, 64]
    for kernel, n, k in [
        ("qkv_rope", 3072, 2048),
        ("gemv_residual", 2048, 2048),
        ("gate_up_silu", 16384, 2048),
        ("gemv_residual", 2048, 8192),
        ("lm_head", 128256, 2048),
    ]:
        for m in (2, 8, 17, 48, 64):
            t = tile_for(kernel, m, n, k)
            assert t.block_n >= 16 and t.block_k >= 16 and t.block_k <= k
    # narrow outputs split K until two programs an SM (each split keeps >= 512 of K)
    assert default_tile("gemv_residual", 8, 2048, 8192).split_k == 2
    assert default_tile("gemv_residual", 8, 2048, 512).split_k == 1
    assert default_tile("gate_up_silu", 1, 16384, 2048).block_n == 8  # bs=1: proj_blocks / 2
    with pytest.raises(ConfigError, match="block_n >= 16"):
        proj_tiles.check_tile("lm_head", Tile(8, 32), 2)
    with pytest.raises(ConfigError, match="split_k must be >= 1"):
        proj_tiles.check_tile("lm_head", Tile(16, 32, split_k=0), 2)


def test_every_table_tile_fits_and_one_that_does_not_is_named(monkeypatch):
    """Each shipped tile fits ``SMEM_BUDGET`` at every row count its key serves (else the step
    would run the rule's tile in silence, as 8B gate-up tiles of 128 pairs or 256 of K once did);
    a tile that does not fit warns once, naming it, and the rule's tile runs."""
    import dataclasses

    from stepgraph.tuning import DecodeTuning

    shipped = DecodeTuning().tables
    for (kernel, n, k, key), tile in shipped.tiles.items():
        rows = range(2, 5) if key == 4 else range(key // 2 + 1, key + 1) if key > 16 else [key]
        for m in rows:
            assert tile_for(kernel, m, n, k) == tile, (kernel, n, k, m)
    budget = proj_tiles.SMEM_BUDGET
    # gate-up's pairs: stages x (16 + 2 * 32 rows) x 256 of K x 2 bytes: 5 stages are the
    # budget exactly, 6 one stage past it
    fits, big = Tile(32, 256, 4, 5), Tile(32, 256, 4, 6)
    assert proj_tiles.smem_bytes("gate_up_silu", fits, 8, 2) == budget
    assert proj_tiles.smem_bytes("gate_up_silu", big, 8, 2) > budget
    key = ("gate_up_silu", 1024, 512, 16)
    fitting = dataclasses.replace(shipped, tiles={**shipped.tiles, key: fits})
    assert tile_for("gate_up_silu", 8, 1024, 512, tables=fitting) == fits
    over = dataclasses.replace(shipped, tiles={**shipped.tiles, key: big})
    named = r"gate_up_silu: the table's Tile\(block_n=32.*240 KB.* 16 rows"
    with pytest.warns(UserWarning, match=named):
        got = tile_for("gate_up_silu", 8, 1024, 512, tables=over)
    assert got == default_tile("gate_up_silu", 8, 1024, 512) != big
