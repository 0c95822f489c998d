"""Test tiers. ``tests/`` runs on the CPU in CI; ``tests/gpu/`` carries the ``cuda`` marker and
skips cleanly without a GPU.

Without a GPU the Triton kernels run under the interpreter. ``TRITON_INTERPRET`` is read when a
kernel is decorated, so it is set here, before any test module imports ``stepgraph.kernels``.
"""

from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # Tiny ops on few cores: one intra-op thread avoids OpenMP spin contention (100x on 2 cores).
    torch.set_num_threads(1)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``|out - ref| / |ref|`` (Frobenius norms, in float64); fails on an unwritten (NaN)
    element first, so a kernel that skips part of its output cannot pass."""
    assert not out.isnan().any(), "an output element was never written (still NaN)"
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.fixture
def nan_empty(monkeypatch):
    """Make every ``torch.empty``/``empty_like`` the code under test allocates start poisoned
    (NaN, or -1 for integers), so an element it never writes shows."""
    empty, empty_like = torch.empty, torch.empty_like
    poison = lambda t: t.fill_(float("nan") if t.is_floating_point() else -1)  # noqa: E731
    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(empty_like(*a, **k)))


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (cuda marker); run scripts/gpu-check")
    for item in items:
        if f"{os.sep}tests{os.sep}gpu{os.sep}" in str(item.path):
            item.add_marker(pytest.mark.cuda)
        if not HAS_CUDA and "cuda" in item.keywords:
            item.add_marker(skip)
