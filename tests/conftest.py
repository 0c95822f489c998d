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


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (cuda marker); run scripts/gpu-check")
    for item in items:
        if f"{os.sep}tests{os.sep}gpu{os.sep}" in str(item.path):
            item.add_marker(pytest.mark.cuda)
        if not HAS_CUDA and "cuda" in item.keywords:
            item.add_marker(skip)
