"""Integer helpers of the launchers' host code: ``cdiv`` and ``next_pow2``.

Triton's ``triton.cdiv`` and ``triton.next_power_of_2`` are constexpr functions (3.5 and
later): a host call goes through their wrapper, which unwraps every argument, and cost about a
sixth of an eager decode step's host time (about 400 calls a step for Llama-3.2-1B,
docs/experiments.md#launch-arithmetic-in-plain-python). The eager step runs three times a
bucket while the runner captures, so this is capture time too. Same values, plain ints.
"""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints, ``b > 0`` (``triton.cdiv``)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The least power of two ``>= n`` for ``n >= 1``, and 0 for 0 (``triton.next_power_of_2``)."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


__all__ = ["cdiv", "next_pow2"]
