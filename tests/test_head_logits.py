"""``LlamaModel.logits``: float32 logits of the head, into the caller's rows when given (the
graph runner's shared output), the same bits with or without them; which heads cuBLAS writes
in float32 itself on CUDA (``Linear.widens``; the GPU tier runs it)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from stepgraph.model import llama
from stepgraph.model.llama import Linear
from stepgraph.model.model_runner import ModelRunner


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_into_out_equal_the_logits_and_touch_no_other_row(dtype):
    mr = ModelRunner.from_preset("tiny", "cpu", dtype, seed=0, max_bs=8, max_context_len=64)
    vocab = mr.config.vocab_size
    g = torch.Generator().manual_seed(1)
    h = torch.randn(7, mr.config.hidden_size, generator=g).to(dtype)
    ref = mr.model.logits(h)
    assert ref.dtype == torch.float32 and ref.shape == (7, vocab)
    out = torch.full((9, vocab), float("nan"))
    got = mr.model.logits(h, out[:7])
    assert got.data_ptr() == out.data_ptr() and torch.equal(got, ref)
    assert out[7:].isnan().all()
    out.fill_(float("nan"))
    part = mr.model.logits(h, out[:3])  # h carries padding rows past the 3 live ones
    assert part.shape == (3, vocab) and torch.equal(part, ref[:3]) and out[3:].isnan().all()


def fake_x(dtype=torch.bfloat16, cuda=True, dim=2):
    return SimpleNamespace(is_cuda=cuda, dtype=dtype, dim=lambda: dim)


def test_cublas_widens_only_a_bias_free_float32_head_of_half_inputs_on_cuda(monkeypatch):
    monkeypatch.setattr(llama, "_MM_OUT_DTYPE", True)
    head = Linear(8, 16, bias=False)
    assert not head.widens(fake_x())  # out_dtype unset: the input's dtype
    head.out_dtype = torch.float32
    assert head.widens(fake_x()) and head.widens(fake_x(torch.float16))
    assert not head.widens(fake_x(torch.float32))  # nothing to widen
    assert not head.widens(fake_x(cuda=False))  # torch.mm's out_dtype has no CPU kernel
    assert not head.widens(fake_x(dim=3))
    biased = Linear(8, 16, bias=True)
    biased.out_dtype = torch.float32
    assert not biased.widens(fake_x())  # the bias add would need its own pass
    monkeypatch.setattr(llama, "_MM_OUT_DTYPE", False)  # a torch without it
    assert not head.widens(fake_x())
