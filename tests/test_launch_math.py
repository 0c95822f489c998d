"""The launchers' plain-Python ``cdiv`` and ``next_pow2`` give Triton's values, and no launcher
calls Triton's constexpr-function versions from the host."""

from __future__ import annotations

import pathlib
import re

import pytest
import triton

from stepgraph.kernels.launch_math import cdiv, next_pow2

KERNELS = pathlib.Path(__file__).resolve().parents[1] / "stepgraph" / "kernels"


@pytest.mark.parametrize("b", [1, 2, 3, 7, 16, 64, 128, 1000])
def test_cdiv_equals_triton(b):
    for a in range(0, 5 * b + 3):
        assert cdiv(a, b) == triton.cdiv(a, b) == -(-a // b)


def test_next_pow2_equals_triton():
    values = list(range(0, 4100)) + [2**k + d for k in range(12, 40) for d in (-1, 0, 1)]
    for n in values:
        assert next_pow2(n) == triton.next_power_of_2(n), n
    assert [next_pow2(n) for n in (0, 1, 2, 3, 4, 5)] == [0, 1, 2, 4, 4, 8]


def test_no_host_call_of_tritons_constexpr_functions():
    """``triton.cdiv`` / ``triton.next_power_of_2`` in a kernel module's host code cost a
    constexpr-function call each (launch_math's docstring); inside ``@triton.jit`` code the
    kernels use ``tl.cdiv``."""
    pattern = re.compile(r"\btriton\.(cdiv|next_power_of_2)\(")
    found = [
        f"{path.relative_to(KERNELS)}:{i}"
        for path in sorted(KERNELS.rglob("*.py"))
        if path.name != "launch_math.py"
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not found, f"use stepgraph.kernels.launch_math instead: {found}"
