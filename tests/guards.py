"""Helpers for the bad-input and fault tests: a per-test time limit (no pytest-timeout here,
so ``signal.alarm``) and a snapshot of the state a refusal must leave unchanged."""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager

import pytest
import torch


@contextmanager
def time_limit(seconds: int):
    """Fail the test (instead of hanging the suite) if the body runs past ``seconds``."""
    if threading.current_thread() is not threading.main_thread():  # alarm needs the main thread
        yield
        return

    def on_alarm(signum, frame):
        raise TimeoutError(f"test body ran past {seconds} s: a hang")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.fixture(autouse=False)
def limit_20s():
    with time_limit(20):
        yield


def kv_snapshot(kv) -> list[torch.Tensor]:
    """Every layer's K and V outside scratch page 0 (padded rows may write page 0)."""
    return [c[1:].clone() for c in (*kv.k_caches, *kv.v_caches)]


def assert_kv_unchanged(kv, before: list[torch.Tensor]) -> None:
    after = kv_snapshot(kv)
    assert all(torch.equal(a, b) for a, b in zip(before, after)), "KV cache outside page 0 changed"


def fill_kv_random(kv, seed: int = 0) -> None:
    """Fresh random values in every page, so a stray write shows (never zeros)."""
    g = torch.Generator().manual_seed(seed)
    for c in (*kv.k_caches, *kv.v_caches):
        c.copy_(torch.randn(c.shape, generator=g).to(c.dtype))
