"""The fused projections' TMA paths (``Tile.tma`` 1: weight and x through host descriptors,
the swap-AB K loop; 2: the weight by descriptor, x from pointers; ``tma_tiles``) under the
Triton interpreter, float32 and float16, at rows 2, 3, 17 and 64 (qkv_rope's in
``test_small_m_kernels``), K in several chunks, column tiles ending ragged, split-K; float64
references written here, outputs poisoned first. A spy checks the descriptor path really ran
(and that misaligned tensors and ``STEPGRAPH_TMA=0`` take the pointer loop instead)."""

from __future__ import annotations

import pytest
import torch

from stepgraph.kernels.proj import proj_tiles, tma_tiles
from stepgraph.kernels.proj.gate_up_silu import gate_up_silu
from stepgraph.kernels.proj.norm_gemv import gemv_residual, norm_gemv
from stepgraph.kernels.proj.proj_tiles import Tile
from stepgraph.kernels.proj.qkv_rope import qkv_rope
from stepgraph.kernels.sampling.lm_head_argmax import lm_head_argmax
from stepgraph.tuning import DecodeTuning
from tests.conftest import rel_err
from tests.references import rms64, rope64

TOL = {torch.float32: 1e-5, torch.float16: 3e-3}
EPS = 1e-5


@pytest.fixture
def spy(monkeypatch):
    """Counts the descriptors the launchers build (two a TMA launch)."""
    calls = []
    real = proj_tiles.descriptor

    def counting(t, rows, cols):
        calls.append((tuple(t.shape), rows, cols))
        return real(t, rows, cols)

    monkeypatch.setattr(proj_tiles, "descriptor", counting)
    return calls


def rand(g, *shape, scale=1.0):
    return scale * torch.randn(*shape, generator=g)


@pytest.mark.parametrize("tma", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m, split_k", [(2, 1), (3, 3), (17, 2), (64, 1)])
def test_gemv_residual_tma(nan_empty, spy, tma, dtype, m, split_k):
    # K = 96 in chunks of 16: 6 chunks (2 a split at split_k 3); N = 40 in tiles of 16: ragged
    g = torch.Generator().manual_seed(10 * m + split_k)
    k, n = 96, 40
    x, w = rand(g, m, k).to(dtype), rand(g, n, k, scale=k**-0.5).to(dtype)
    res = rand(g, m, n).to(dtype)
    tile = Tile(16, 16, 4, 2, split_k, tma)
    y = gemv_residual(x, w, res, blocks=tile)
    want = [((n, k), 16, 16), ((m, k), proj_tiles.block_m(m), 16)]
    assert spy == want[: 3 - tma]  # tma 2: x from pointers, no descriptor
    assert rel_err(y, x.double() @ w.double().T + res.double()) < TOL[dtype]
    # the tickets are left at zero: the next split-K launch starts clean
    assert all(int(t.abs().sum()) == 0 for _, t in proj_tiles._WORKSPACES.values())
    pointers = gemv_residual(x, w, res, blocks=Tile(16, 16, 4, 2, split_k))
    assert len(spy) == 3 - tma  # tma=0: no descriptor
    assert rel_err(y, pointers) < TOL[dtype]


@pytest.mark.parametrize("tma", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m, split_k", [(2, 2), (17, 1), (64, 2)])
def test_norm_gemv_tma(nan_empty, spy, tma, dtype, m, split_k):
    g = torch.Generator().manual_seed(m)
    k, n = 64, 33
    x, nw = rand(g, m, k, scale=2).to(dtype), (1 + rand(g, k, scale=0.1)).to(dtype)
    w, b = rand(g, n, k, scale=k**-0.5).to(dtype), rand(g, n).to(dtype)
    y = norm_gemv(x, nw, w, b, EPS, torch.float32, blocks=Tile(16, 16, 4, 2, split_k, tma))
    assert len(spy) == 3 - tma
    assert rel_err(y, rms64(x, nw) @ w.double().T + b.double()) < TOL[dtype]


@pytest.mark.parametrize("tma", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m, split_k", [(2, 1), (3, 2), (17, 1), (64, 2)])
def test_gate_up_silu_tma(nan_empty, spy, tma, dtype, m, split_k):
    g = torch.Generator().manual_seed(7 * m)
    k, inter = 48, 24  # 2 tiles of 16 pairs (the second ragged: its gate box runs into up)
    x, nw = rand(g, m, k, scale=2).to(dtype), (1 + rand(g, k, scale=0.1)).to(dtype)
    w = rand(g, 2 * inter, k, scale=k**-0.5).to(dtype)
    out = gate_up_silu(x, nw, w, EPS, blocks=Tile(16, 16, 4, None, split_k, tma))
    assert len(spy) == 3 - tma
    gate, up = (rms64(x, nw) @ w.double().T).split(inter, dim=-1)
    assert rel_err(out, gate * torch.sigmoid(gate) * up) < 2 * TOL[dtype]


@pytest.mark.parametrize("tma", [1, 2])
@pytest.mark.parametrize("m", [2, 17])
def test_lm_head_argmax_tma(nan_empty, spy, tma, m):
    g = torch.Generator().manual_seed(3 * m)
    k, vocab = 48, 70  # 5 programs of 16 columns, the last ragged (its box reads zeros)
    x, nw = rand(g, m, k, scale=2).to(torch.float16), (1 + rand(g, k, scale=0.1)).half()
    w = rand(g, vocab, k, scale=k**-0.5).to(torch.float16)
    w[50] = w[20]  # a tie across programs: the first index wins
    logits, tokens = lm_head_argmax(x, nw, w, EPS, blocks=Tile(16, 16, 4, None, 1, tma))
    assert len(spy) == 3 - tma
    assert rel_err(logits, rms64(x, nw) @ w.double().T) < TOL[torch.float16]
    assert torch.equal(tokens, logits.argmax(-1))


def test_pointer_loop_where_tma_cannot(nan_empty, spy, monkeypatch):
    g = torch.Generator().manual_seed(5)
    k, n, m = 64, 40, 3
    w = rand(g, n, k, scale=k**-0.5).half()
    res = rand(g, m, n).half()
    tile = Tile(16, 16, 4, 2, 1, 1)
    wide = rand(g, m, k + 4).half()  # row stride 136 bytes: not 16-byte aligned
    x = wide[:, :k]
    want = x.double() @ w.double().T + res.double()
    assert rel_err(gemv_residual(x, w, res, blocks=tile), want) < 3e-3 and spy == []
    assert rel_err(gemv_residual(x.contiguous(), w, res, blocks=tile), want) < 3e-3
    assert len(spy) == 2
    off = DecodeTuning(tma=False)
    assert rel_err(gemv_residual(x.contiguous(), w, res, blocks=tile, tuning=off), want) < 3e-3
    assert len(spy) == 2  # switched off: the pointer loop
    # tma 2 reads x from pointers: a misaligned x keeps the weight's descriptor
    assert rel_err(gemv_residual(x, w, res, blocks=Tile(16, 16, 4, 2, 1, 2)), want) < 3e-3
    assert len(spy) == 3
    gemv_residual(x[:1].contiguous(), w, res[:1], blocks=tile)  # one row: the GEMV, never TMA
    assert len(spy) == 3


def test_tma_limits():
    # stride alignment exactly at 16 bytes and one element past it
    assert tma_tiles.tma_ready(torch.zeros(3, 8, dtype=torch.float16))
    assert not tma_tiles.tma_ready(torch.zeros(3, 12, dtype=torch.float16)[:, :8])
    assert tma_tiles.tma_ready(torch.zeros(3, 4, dtype=torch.float32))
    assert not tma_tiles.tma_ready(torch.zeros(3, 5, dtype=torch.float32))
    assert not tma_tiles.tma_ready(torch.zeros(4, 8, dtype=torch.float16).t())  # not row-major
    assert not tma_tiles.tma_ready(torch.zeros(8, dtype=torch.float16))  # 1-D
    base = torch.zeros(40, dtype=torch.float16)
    assert not tma_tiles.tma_ready(base[1:33].view(4, 8))  # base 2 bytes off
    # boxes: powers of two up to 256 a side
    assert tma_tiles.box_fits(256, 256, 64)
    assert not tma_tiles.box_fits(512, 128, 16)
    assert not tma_tiles.box_fits(64, 96, 16)
    x, w = torch.zeros(8, 512), torch.zeros(32, 512)
    assert proj_tiles.tma_descriptors(Tile(16, 512, 4, 1, 1, True), 8, x, w, 16) is None
    assert proj_tiles.tma_descriptors(Tile(16, 256, 4, 1, 1, True), 8, x, w, 16) is not None


def test_prefetch_lines():
    assert tma_tiles.PREFETCH_BYTES == DecodeTuning().l2_prefetch_bytes == 16384  # the default
    assert tma_tiles.prefetch_lines(64, 2048, 4, 128, 2, False, 16384) == 128
    assert tma_tiles.prefetch_lines(64, 2048, 4, 128, 2, False) == 128
    assert tma_tiles.prefetch_lines(64, 2048, 4, 128, 2, True) == 64  # shared by two row sets
    assert tma_tiles.prefetch_lines(8, 64, 4, 16, 2, False) == 2  # a 256-byte range: all of it
    assert tma_tiles.prefetch_lines(64, 2048, 4, 128, 2, False, 0) == 0  # off
    # 64 KB of one row set (128-byte lines, a power of two), or the program's whole range
    assert tma_tiles.prefetch_lines(64, 2048, 4, 128, 2, False, 65536) == 512  # 64 x 512 x 2 B
    assert tma_tiles.prefetch_lines(64, 2048, 1, 128, 2, False, 65536) == 512  # capped at 64 KB
    assert tma_tiles.prefetch_lines(64, 2048, 1, 128, 2, True, 65536) == 256  # both share it
    for bad in (-1, 1.5):
        with pytest.raises(ValueError, match="l2_prefetch_bytes"):
            DecodeTuning(l2_prefetch_bytes=bad)
    assert tma_tiles.prefetch_lines(16, 48, 3, 16, 2, False) == 4  # 16 x 16 x 2 = 512 B
    assert tma_tiles.prefetch_lines(16, 96, 1, 16, 2, False) == 16  # 24 lines -> 16


@pytest.mark.parametrize("tma", [0, 1, 2])
@pytest.mark.parametrize("m", [3, 17])
def test_normed_variants(nan_empty, spy, tma, m):
    """``norm_w=None``: x was normed by its own kernel; the kernels read it as it is (the
    ``_normed`` table entries, ``proj_tiles.SEPARATE_NORM``)."""
    dtype = torch.float16
    g = torch.Generator().manual_seed(40 + m + tma)
    k, inter = 48, 24
    x = rand(g, m, k).to(dtype)
    w = rand(g, 2 * inter, k, scale=k**-0.5).to(dtype)
    out = gate_up_silu(x, None, w, EPS, blocks=Tile(16, 16, 4, None, 2, tma))
    gate, up = (x.double() @ w.double().T).split(inter, dim=-1)
    assert rel_err(out, gate * torch.sigmoid(gate) * up) < 2 * TOL[dtype]
    n_heads, n_kv, hd, ps = 4, 2, 16, 8
    n = (n_heads + 2 * n_kv) * hd
    wq, b = rand(g, n, k, scale=k**-0.5).to(dtype), rand(g, n).to(dtype)
    ang = torch.rand(80, hd // 2, generator=g, dtype=torch.float64) * 6
    emb = torch.cat((ang, ang), -1)
    cos_t, sin_t = emb.cos().to(dtype), emb.sin().to(dtype)
    positions = torch.randint(0, 80, (m,), generator=g)
    slots = torch.randperm(4 * ps, generator=g)[:m]
    kc, vc = rand(g, 4, ps, n_kv, hd).to(dtype), rand(g, 4, ps, n_kv, hd).to(dtype)
    q = qkv_rope(
        x,
        None,
        wq,
        b,
        EPS,
        positions,
        cos_t,
        sin_t,
        kc,
        vc,
        slots,
        n_heads,
        blocks=Tile(16, 16, 4, None, 1, tma),
    )
    qkv = x.double() @ wq.double().T + b.double()
    cos, sin = cos_t[positions].double(), sin_t[positions].double()
    want = rope64(qkv[:, : n_heads * hd].view(m, n_heads, hd), cos, sin)
    assert rel_err(q, want) < 2 * TOL[dtype]
    assert len(spy) == (0 if tma == 0 else 2 * (3 - tma))
    # the tables: the _normed names are their own keys, paired as their fused kernels
    assert proj_tiles.default_tile("qkv_rope_normed", 8, 3072, 2048) == proj_tiles.default_tile(
        "qkv_rope", 8, 3072, 2048
    )


def test_separate_norm_choice():
    import dataclasses

    assert proj_tiles.separate_norm("qkv_rope", 8, 3072, 2048)  # measured: 1B's qkv at 16
    assert not proj_tiles.separate_norm("qkv_rope", 8, 3072, 4096)  # another shape
    none = dataclasses.replace(DecodeTuning().tables, separate_norm=set())
    assert not proj_tiles.separate_norm("qkv_rope", 8, 3072, 2048, tables=none)
    t = dataclasses.replace(none, separate_norm_everywhere={("gate_up_silu", 16)})
    assert proj_tiles.separate_norm("gate_up_silu", 16, 16384, 2048, tables=t)
    assert not proj_tiles.separate_norm("gate_up_silu", 17, 16384, 2048, tables=t)  # BLOCK_M 32
    assert not proj_tiles.separate_norm("gate_up_silu", 1, 16384, 2048, tables=t)  # one row
    assert not proj_tiles.separate_norm("gate_up_silu", 16, 16384, 2048, 4, t)  # float32
    with pytest.raises(ValueError, match="tables.separate_norm_everywhere"):
        dataclasses.replace(none, separate_norm_everywhere={("gate_up", 16)})


def test_sweep_tiles_file_and_pairs(tmp_path, monkeypatch):
    """``STEPGRAPH_PROJ_TILES`` (a sweep's ``--tiles-out``) adds its tiles to
    ``DecodeTuning.default()``'s tables and takes the key out of ``cublas``, so the same device
    run tries the sweep's choice (read at the call); the ``kernel:BLOCK_M`` text parses as
    pairs."""
    import json

    from stepgraph import env
    from stepgraph.tuning_text import parse_pairs

    key = ("qkv_rope", 3072, 2048, 64)
    monkeypatch.delenv(env.PROJ_TILES, raising=False)
    assert key in DecodeTuning.default().tables.cublas
    path = tmp_path / "tiles.json"
    path.write_text(json.dumps({"qkv_rope,3072,2048,64": [32, 128, 4, 3, 4, 1]}))
    monkeypatch.setenv(env.PROJ_TILES, str(path))
    tables = DecodeTuning.default().tables
    assert tables.tiles[key] == Tile(32, 128, 4, 3, 4, 1)
    assert key not in tables.cublas and not proj_tiles.prefer_cublas("qkv_rope", 40, 3072, 2048)
    assert proj_tiles.tile_for("qkv_rope", 40, 3072, 2048).tma == 1  # the default: the file's
    monkeypatch.delenv(env.PROJ_TILES)
    assert key in DecodeTuning.default().tables.cublas  # the next call: the shipped tables
    pairs = parse_pairs("tables.cublas_everywhere", "qkv_rope:16, gate_up_silu:32,")
    assert pairs == {("qkv_rope", 16), ("gate_up_silu", 32)}
    assert parse_pairs("tables.cublas_everywhere", "") == set()


def test_tma_descriptors_only_where_a_tile_asks():
    x, w = torch.zeros(8, 64, dtype=torch.float16), torch.zeros(48, 64, dtype=torch.float16)
    assert proj_tiles.tma_descriptors(Tile(16, 16, 4, 2, 1, 0), 8, x, w, 16) is None  # pointers
    assert proj_tiles.tma_descriptors(Tile(16, 16, 4, 2, 1, 1), 1, x[:1], w, 16) is None  # GEMV
    assert proj_tiles.tma_descriptors(Tile(16, 16, 4, 2, 1, 3), 8, x, w, 16) is None  # no kind 3
    wd, xd = proj_tiles.tma_descriptors(Tile(16, 16, 4, 2, 1, 1), 8, x, w, 16)
    assert wd.block_shape == [16, 16] and xd.block_shape == [16, 16] and wd.base is w
    wd, xd = proj_tiles.tma_descriptors(Tile(16, 16, 4, 2, 1, 2), 8, x, w, 16)
    assert xd is x  # kind 2 reads x from pointers


def test_tile_table_is_launchable():
    """Every measured tile fits the shared-memory budget and its kernel's limits, every TMA tile's
    boxes are TMA boxes, and every separate-norm choice has its ``_normed`` tile (else the rule
    would run unmeasured)."""
    tables = DecodeTuning().tables
    for (kernel, n, k, bm), tile in tables.tiles.items():
        m = bm  # any row count of the bucket takes its tiles
        assert proj_tiles.tile_for(kernel, m, n, k) == tile, (kernel, bm)
        proj_tiles.check_tile(kernel, tile, m)
        if tile.tma:
            assert tile.tma in (1, 2) and tma_tiles.box_fits(tile.block_n, tile.block_k, bm)
    for kernel, n, k, bm in tables.separate_norm:
        assert (f"{kernel}_normed", n, k, bm) in tables.tiles
        assert (kernel, n, k, bm) not in tables.cublas  # cublas is checked first


@pytest.mark.parametrize(
    "m, keys", [(1, (1,)), (2, (4, 16)), (4, (4, 16)), (5, (16,)), (16, (16,)), (17, (32,))]
)
def test_table_rows_at_the_small_class_edges(m, keys, monkeypatch):
    """2-4 rows look up the small class (key 4) before 16; 5 rows on, 16 alone; 1 and 17 their
    own classes. (No table entry has a key 4: one is put in for the test.)"""
    from stepgraph.kernels.proj.proj_tiles import table_rows, tile_for
    from stepgraph.kernels.proj.tile_table import TILES, Tile

    assert table_rows(m) == keys
    o = ("gemv_residual", 2048, 2048)
    if 2 <= m <= 16:  # the 1B's o_proj: its 16-row tile, or a 2-4 row tile where one is
        assert tile_for(o[0], m, *o[1:]) == TILES[(*o, 16)]
        import dataclasses

        shipped = DecodeTuning().tables
        small = {**shipped.tiles, (*o, 4): Tile(32, 512, 4, 1, 4)}
        tables = dataclasses.replace(shipped, tiles=small)
        assert tile_for(o[0], m, *o[1:], tables=tables) == small[(*o, 4 if m <= 4 else 16)]
