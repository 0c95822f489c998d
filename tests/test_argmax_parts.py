"""The LM head's argmax folded into its launch (``argmax_parts``) under the Triton interpreter:
the last program's reduce gives ``torch.argmax``'s tokens (first index on ties, across programs
and inside one), equal to the two-launch path, with reduce loops of one and several steps, and
leaves its ticket at zero for the next launch."""

from __future__ import annotations

import pytest
import torch

from stepgraph.kernels.proj.proj_tiles import Tile, block_m, splitk_workspace
from stepgraph.kernels.sampling.argmax_parts import fold_block
from stepgraph.kernels.sampling.lm_head_argmax import lm_head_argmax
from stepgraph.tuning import ArgmaxFold, DecodeTuning

EPS = 1e-5


def _case(g, m, k=40, vocab=70, dtype=torch.float32):
    x = (2 * torch.randn(m, k, generator=g)).to(dtype)
    nw = (1 + 0.1 * torch.randn(k, generator=g)).to(dtype)
    w = (k**-0.5 * torch.randn(vocab, k, generator=g)).to(dtype)
    w[53] = w[21]  # a tie across programs (16 columns each): the first index wins
    w[22] = w[21]  # and inside one
    x[0] = w[21].float() * 4  # row 0's top logit is the tied one
    return x, nw, w


def _tokens(x, nw, w, tile, fold: bool, monkeypatch, per_thread: int = 8):
    tuning = DecodeTuning(argmax=ArgmaxFold(fold=fold, per_thread=per_thread))
    out = torch.full((x.shape[0],), -5, dtype=torch.int64)  # poisoned
    logits, tokens = lm_head_argmax(x, nw, w, EPS, tokens_out=out, blocks=tile, tuning=tuning)
    assert tokens.data_ptr() == out.data_ptr()
    return logits, tokens


@pytest.mark.parametrize("m", [1, 2, 17])
@pytest.mark.parametrize("split_k", [1, 2])
def test_folded_argmax_equals_torch_and_the_two_launches(monkeypatch, m, split_k):
    g = torch.Generator().manual_seed(10 * m + split_k)
    x, nw, w = _case(g, m)
    tile = Tile(16, 16, 4, None, split_k) if m > 1 else Tile(16, 16, 4)
    logits, folded = _tokens(x, nw, w, tile, True, monkeypatch)
    assert torch.equal(folded, logits.argmax(-1))
    assert int(folded[0]) == 21  # three equal maxima at 21, 22 and 53
    _, two = _tokens(x, nw, w, tile, False, monkeypatch)
    assert torch.equal(folded, two)
    tiles = 5  # cdiv(70, 16): the fold's ticket is the one after the split-K tickets
    assert int(splitk_workspace(x.device, 0, tiles + 1)[1][tiles]) == 0


def test_a_reduce_of_several_steps_and_a_second_launch(monkeypatch):
    # argmax.per_thread 1: 4 warps, BLOCK_M 32 -> BLOCK_P 4
    g = torch.Generator().manual_seed(4)
    x, nw, w = _case(g, 17, vocab=150)  # 10 programs: 3 steps of 4
    assert fold_block(block_m(17), 10, 4, 1) == 4
    tile = Tile(16, 16, 4, None, 1)
    for _ in range(2):  # the ticket the first launch reset serves the second
        x = x + 0.5 * torch.randn(x.shape, generator=g)
        logits, tokens = _tokens(x, nw, w, tile, True, monkeypatch, per_thread=1)
        assert torch.equal(tokens, logits.argmax(-1))


def test_fold_block():
    assert fold_block(1, 4008, 4) == 1024  # one row, 4 warps: 8 a thread
    assert fold_block(16, 501, 8) == 128  # 16 rows, 8 warps
    assert fold_block(1, 600, 8) == 1024  # 8 warps: 2048 a row, the row's 600 rounded up
    assert fold_block(64, 4008, 4) == 16  # 1024 // 64
    assert fold_block(3, 4008, 4) == 256  # 1024 // 3 = 341: the power of two below
    assert fold_block(64, 4008, 1) == 4  # exactly 256 // 64
    assert fold_block(128, 4008, 1) == 2 and fold_block(512, 4008, 1) == 2  # at least 2
    assert fold_block(16, 1, 4) == 2
    assert fold_block(1, 2, 4) == 2 and fold_block(1, 3, 4) == 4


@pytest.mark.parametrize("m, fold_env, launches", [(1, "1", 1), (2, "1", 0), (2, "0", 1)])
def test_one_row_keeps_the_second_launch(monkeypatch, m, fold_env, launches):
    from stepgraph.kernels.sampling import lm_head_argmax as lha

    calls = []

    class Spy:  # the reduce kernel's launches, counted
        def __getitem__(self, grid):
            calls.append(grid)
            return original[grid]

    original = lha._argmax_reduce_kernel
    monkeypatch.setattr(lha, "_argmax_reduce_kernel", Spy())
    g = torch.Generator().manual_seed(9)
    x, nw, w = _case(g, m)
    logits, tokens = _tokens(x, nw, w, Tile(16, 16, 4), fold_env == "1", monkeypatch)
    assert len(calls) == launches and torch.equal(tokens, logits.argmax(-1))
