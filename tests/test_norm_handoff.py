"""The norm handoff (``kernels/proj/norm_handoff``) under the Triton interpreter: ``gemv_residual``
leaves ``xw = y * next_norm`` and each row's sum of squares per column tile beside the residual
``y`` it writes, and the next projection (``qkv_rope``, ``gate_up_silu``, the LM head) given
``xw`` and the sums computes the projection of ``RMSNorm(y)``. Float64 references written here;
rows 1, 3, 17 and 64 (BLOCK_M 1, 16, 32, 64), column tiles ending ragged, split-K, outputs
poisoned first. The consumers are also given sums four times too large, which must halve what
the norm gives: a kernel that ignored them cannot pass."""

from __future__ import annotations

import pytest
import torch

from stepgraph.errors import ConfigError
from stepgraph.kernels.proj.gate_up_silu import gate_up_silu
from stepgraph.kernels.proj.norm_gemv import gemv_residual, norm_gemv
from stepgraph.kernels.proj.norm_handoff import ssq_args
from stepgraph.kernels.proj.proj_tiles import Tile
from stepgraph.kernels.proj.qkv_rope import qkv_rope
from stepgraph.kernels.sampling.lm_head_argmax import lm_head_argmax
from tests.conftest import rel_err
from tests.references import check_qkv_rope, rms64

TOL = {torch.float32: 2e-5, torch.float16: 3e-3}
EPS = 1e-6  # small beside mean(x^2) ~ 1: four times the sums halve the normed x


def rand(g, *shape, scale=1.0):
    return scale * torch.randn(*shape, generator=g)


def tile_sums(y: torch.Tensor, block_n: int) -> torch.Tensor:
    """float64 sums of squares of y [M, N] per column tile of block_n (the last one ragged)."""
    yd = y.double()
    return torch.stack([(c * c).sum(-1) for c in yd.split(block_n, dim=-1)], dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "m, tile",
    [
        (1, Tile(16, 32, 4)),
        (3, Tile(16, 16, 4, 2, 3)),
        (17, Tile(16, 32, 4, 2, 2)),
        (64, Tile(32, 16, 4, 2, 1)),
        (3, Tile(16, 16, 4, 2, 2, 1)),
    ],
)
def test_residual_hands_over(nan_empty, dtype, m, tile):
    # N = 40: tiles of 16 end ragged (3 of them), of 32 too (2); K = 96 in 3-6 chunks
    g = torch.Generator().manual_seed(7 * m + tile.split_k)
    k, n = 96, 40
    x, w = rand(g, m, k).to(dtype), rand(g, n, k, scale=k**-0.5).to(dtype)
    res, nw = rand(g, m, n).to(dtype), (1 + 0.1 * rand(g, n)).to(dtype)
    y, xw, sums = gemv_residual(x, w, res, blocks=tile, next_norm=nw)
    assert sums.shape == (m, -(-n // tile.block_n)) and sums.dtype == torch.float32
    assert torch.equal(y, gemv_residual(x, w, res, blocks=tile))  # the same y, bit for bit
    assert rel_err(y, x.double() @ w.double().T + res.double()) < TOL[dtype]
    assert rel_err(sums, tile_sums(y, tile.block_n)) < 1e-6  # of y as stored
    assert torch.equal(xw, (y.float() * nw.float()).to(dtype))  # rounded once


def _handed(g, m, k, dtype, block_n=16):
    """A residual stream r [m, k], a norm weight, and what a gemv_residual hands over for it:
    xw = r * norm_w (rounded) and the sums of squares of r per tile of block_n columns."""
    r = rand(g, m, k).to(dtype)
    nw = (1 + 0.1 * rand(g, k)).to(dtype)
    xw = (r.float() * nw.float()).to(dtype)
    return r, nw, xw, tile_sums(r, block_n).float().contiguous()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m", [1, 3, 17, 64])
def test_gate_up_from_handoff(nan_empty, dtype, m):
    g = torch.Generator().manual_seed(m)
    k, inter = 80, 24  # K in 5 chunks of 16; 24 pairs in tiles of 16: ragged
    r, nw, xw, sums = _handed(g, m, k, dtype)
    w = rand(g, 2 * inter, k, scale=k**-0.5).to(dtype)
    tile = Tile(16, 16, 4, 2, 2) if m > 1 else None
    gate, up = (rms64(r, nw, EPS) @ w.double().T).split(inter, dim=-1)
    got = gate_up_silu(xw, None, w, EPS, blocks=tile, ssq=sums)
    assert rel_err(got, gate * torch.sigmoid(gate) * up) < 5 * TOL[dtype]
    gate, up = gate / 2, up / 2
    got = gate_up_silu(xw, None, w, EPS, blocks=tile, ssq=4 * sums)
    assert rel_err(got, gate * torch.sigmoid(gate) * up) < 5 * TOL[dtype]


@pytest.mark.parametrize("m", [1, 3, 17])
def test_qkv_rope_from_handoff(nan_empty, m):
    g = torch.Generator().manual_seed(100 + m)
    k, n_heads, n_kv, hd, pages, page = 64, 4, 2, 32, 6, 4
    r, nw, xw, sums = _handed(g, m, k, torch.float32)
    w = rand(g, (n_heads + 2 * n_kv) * hd, k, scale=k**-0.5)
    bias = 0.1 * rand(g, w.shape[0])
    pos = torch.randint(0, 50, (m,), generator=g)
    ang = pos.new_tensor(range(64))[:, None] * 0.1 * torch.arange(1, hd // 2 + 1)[None, :]
    cos_t, sin_t = torch.cos(ang).repeat(1, 2), torch.sin(ang).repeat(1, 2)
    k_cache, v_cache = rand(g, pages, page, n_kv, hd), rand(g, pages, page, n_kv, hd)
    caches0 = (k_cache.clone(), v_cache.clone())
    slots = torch.randperm(pages * page, generator=g)[:m]
    tile = Tile(16, 16, 4, 2, 2) if m > 1 else None
    for scale, sums_in in ((1.0, sums), (0.5, 4 * sums)):
        q = qkv_rope(
            xw,
            None,
            w,
            bias,
            EPS,
            pos,
            cos_t,
            sin_t,
            k_cache,
            v_cache,
            slots,
            n_heads,
            blocks=tile,
            ssq=sums_in,
        )
        qkv = rms64(r, nw, EPS) * scale @ w.double().T + bias.double()  # bias after the norm
        check_qkv_rope(q, qkv, pos, cos_t, sin_t, (k_cache, v_cache), caches0, slots, n_heads, 1e-5)


@pytest.mark.parametrize("m", [1, 3, 17])
def test_lm_head_from_handoff(nan_empty, m):
    g = torch.Generator().manual_seed(200 + m)
    k, vocab = 64, 300  # the vocab in several programs, the last ragged
    r, nw, xw, sums = _handed(g, m, k, torch.float32)
    w = rand(g, vocab, k, scale=k**-0.5)
    blocks = Tile(64, 32, 4) if m > 1 else (64, 32, 4)
    logits, tokens = lm_head_argmax(xw, None, w, EPS, blocks=blocks, ssq=sums)
    want = rms64(r, nw, EPS) @ w.double().T
    assert rel_err(logits, want) < 1e-5
    assert torch.equal(tokens, want.argmax(-1))
    half = norm_gemv(xw, None, w, None, EPS, torch.float32, blocks=blocks, ssq=4 * sums)
    assert rel_err(half, 0.5 * want) < 1e-5


def test_one_norm_a_consumer():
    r = torch.randn(3, 32)
    w, nw, sums = torch.randn(64, 32), torch.ones(32), torch.ones(3, 2)
    with pytest.raises(ConfigError, match="norm_w or ssq, not both"):
        gate_up_silu(r, nw, w, EPS, ssq=sums)
    with pytest.raises(ConfigError, match="norm_gemv: needs norm_w"):
        norm_gemv(r, None, w)


def test_ssq_args_limits():
    x = torch.zeros(3, 8)
    ok = torch.zeros(3, 5)
    assert ssq_args(None, 3, x) == (x, 0, 0, 0)
    t, stride, parts, pad = ssq_args(ok, 3, x)
    assert t is ok and (stride, parts, pad) == (5, 5, 8)
    assert ssq_args(torch.zeros(3, 1), 3, x)[1:] == (1, 1, 1)  # rows exactly m, one part
    assert ssq_args(torch.zeros(4, 1), 3, x)[2:] == (1, 1)  # more rows than m: fine
    for bad in (
        torch.zeros(2, 5),  # one row short of m = 3
        torch.zeros(3, 0),  # no parts
        torch.zeros(3, 5, dtype=torch.float64),
        torch.zeros(3, 5, dtype=torch.bfloat16),
        torch.zeros(15),
        torch.zeros(5, 3).T,  # rows not contiguous
        [[0.0] * 5] * 3,
    ):
        with pytest.raises(ConfigError, match="ssq must be"):
            ssq_args(bad, 3, x)
