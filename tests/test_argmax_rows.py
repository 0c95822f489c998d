"""``argmax_rows`` against ``torch.argmax`` under the interpreter: ties (first occurrence), NaN
(the maximum), -0.0 against +0.0, infinities, rows of -inf, several parts per row and a reduce
that loops, at V exactly a multiple of the part width and one past it."""

from __future__ import annotations

import pytest
import torch

from stepgraph.kernels.sampling.argmax_rows import argmax_rows


def _logits(m: int, v: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, v, generator=g)
    x = (x * 2).round() / 2  # few distinct values: ties across parts and within one
    return x.to(dtype)


def _check(x: torch.Tensor, **kw) -> None:
    out = torch.full((x.shape[0],), -7, dtype=torch.int64)
    got = argmax_rows(x, out, **kw)
    assert got is out
    assert out.tolist() == torch.argmax(x, -1).tolist()


@pytest.mark.parametrize("m", [1, 2, 3, 17])
@pytest.mark.parametrize("v", [64, 65, 1000, 4096])
def test_random_rows_with_ties(m, v):
    _check(_logits(m, v, seed=m * 7 + v), block_v=64)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_logits(dtype):
    _check(_logits(5, 777, seed=3, dtype=dtype), block_v=128)


def test_special_values():
    x = _logits(8, 300, seed=5)
    x[0, 250] = float("nan")  # NaN beats everything, even a later +inf
    x[0, 260] = float("inf")
    x[1, 10], x[1, 200] = float("inf"), float("inf")  # first of two +inf
    x[2] = float("-inf")  # all -inf: column 0
    x[3] = -0.0
    x[3, 120] = 0.0  # -0.0 == +0.0: column 0
    x[4] = -5.0
    x[4, 299] = -4.5  # every value negative, the max in the last column
    x[5, 3], x[5, 290] = float("nan"), float("nan")  # the first NaN
    x[6] = float("nan")
    x[7, 0] = -float("nan")  # a negative NaN is a NaN too
    _check(x, block_v=64)


def test_the_reduce_loops_over_more_than_one_block():
    x = _logits(3, 20000, seed=9)  # block_v 16: 1250 parts, two passes of 1024
    x[1, 5 * 16 + 3] = x[1, 1029 * 16 + 1] = 100.0  # parts 5 and 1029: one lane, two passes
    x[2, 1029 * 16] = x[2, 5 * 16 + 9] = 100.0
    _check(x, block_v=16)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match=r"\[M, V\]"):
        argmax_rows(torch.randn(4))
    with pytest.raises(ValueError, match="rows contiguous"):
        argmax_rows(torch.randn(6, 4).t())
