"""Triton's own hash computed in a thread while the weights load (``kernels/triton_setup.py``)."""

from __future__ import annotations

import torch

from stepgraph.kernels import triton_setup
from stepgraph.model import ModelRunner
from stepgraph.model import model_runner as model_runner_module


def test_the_thread_computes_tritons_key_once(monkeypatch):
    monkeypatch.setattr(triton_setup, "_started", None)
    key = triton_setup._triton_key()
    assert key is not None, "Triton's cached triton_key is gone: see triton_setup"
    key.cache_clear()
    thread = triton_setup.start_triton_key()
    assert thread is not None and thread.daemon
    assert triton_setup.start_triton_key() is thread  # once a process
    thread.join(timeout=60)
    assert not thread.is_alive()
    info = key.cache_info()
    assert info.currsize == 1 and info.misses == 1
    key()
    assert key.cache_info().hits == info.hits + 1  # the first compile finds it cached


def test_a_failing_key_is_left_to_the_first_compile(monkeypatch):
    def broken():
        raise OSError("libtriton unreadable")

    broken.cache_info = lambda: None
    monkeypatch.setattr(triton_setup, "_started", None)
    monkeypatch.setattr(triton_setup, "_triton_key", lambda: broken)
    thread = triton_setup.start_triton_key()
    thread.join(timeout=10)
    assert not thread.is_alive()  # swallowed in the thread; nothing raised here


def test_model_runners_start_it_on_cuda_only(monkeypatch):
    calls = []
    monkeypatch.setattr(model_runner_module, "start_triton_key", lambda: calls.append(1))
    ModelRunner.from_preset("tiny", "cpu", torch.float32, max_bs=2, max_context_len=64)
    assert calls == []
    model_runner_module._warm_triton("cuda")
    model_runner_module._warm_triton(torch.device("cuda", 0))
    assert calls == [1, 1]
