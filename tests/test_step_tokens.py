"""The engine's sampling phase (``engine/step_tokens.py``) on the CPU: the fused tokens are looked
up once per batch size and kernel choice; a batch whose rows all take the step's sampling is
sampled in one call (no per-request grouping), one with a request's own sampling goes through
``sample_rows``; the fused argmax is used only for a greedy batch of decode rows alone."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from stepgraph.engine import step_tokens as st
from stepgraph.engine.requests import GREEDY, Request, Sampling


class FakeRunner:
    device = torch.device("cpu")
    max_bs = 4

    def __init__(self) -> None:
        self.kernels = "fused"
        self.calls = 0
        self.greedy_tokens = torch.tensor([7, 8, 9, 10])

    def fused_tokens(self, bs):
        self.calls += 1
        return self.greedy_tokens[:bs] if self.kernels == "fused" else None


def _rows(n, own=()):
    out = []
    for i in range(n):
        r = Request(i, [1], 4)
        if i in own:
            r.sampling, r.generator = Sampling(0.7, 5), torch.Generator().manual_seed(i)
        out.append(r)
    return out


def test_fused_tokens_are_looked_up_once_per_batch_size_and_kernels():
    mr = FakeRunner()
    tokens = st.StepTokens(mr)
    assert tokens.ring is None  # the CPU copies nothing
    assert torch.equal(tokens.fused(2), torch.tensor([7, 8])) and mr.calls == 1
    tokens.fused(2)
    assert mr.calls == 1
    mr.kernels = "reference"
    assert tokens.fused(2) is None and mr.calls == 2


def test_fused_argmax_only_for_a_greedy_batch_of_decode_rows(monkeypatch):
    mr = FakeRunner()
    tokens = st.StepTokens(mr)
    logits = [torch.randn(3, 16)]
    step = tokens.launch(logits, _rows(3), 3, GREEDY, None)
    assert step.tokens.tolist() == [7, 8, 9]  # the step's own argmax
    step = tokens.launch(logits, _rows(3), 2, GREEDY, None)  # a prefill row first
    assert step.tokens.tolist() == logits[0].argmax(-1).tolist()


@pytest.mark.parametrize("own", [(), (1,)])
def test_step_sampling_is_one_call_unless_a_request_samples_its_own(monkeypatch, own):
    calls = []
    real = st.sample_rows
    monkeypatch.setattr(st, "sample_rows", lambda *a: calls.append(1) or real(*a))
    tokens = st.StepTokens(SimpleNamespace(device="cpu", max_bs=4, fused_tokens=lambda bs: None))
    logits = torch.randn(3, 16)
    rows = _rows(3, own)
    step_sampling = Sampling(0.5, 4)
    g = torch.Generator().manual_seed(0)
    got = tokens.launch([logits], rows, 3, step_sampling, g).tokens
    assert len(calls) == len(own)  # sample_rows only where a request has its own sampling
    want = real(logits, rows, step_sampling, torch.Generator().manual_seed(0))
    if own:
        for r in rows:  # the own generators drew once: draw again from the same seeds
            if r.generator is not None:
                r.generator.manual_seed(r.rid)
        want = real(logits, rows, step_sampling, torch.Generator().manual_seed(0))
    assert torch.equal(got, want)  # the same tokens as before, either way
