"""``kernels/proj/head_scale``: the cuBLAS LM head's rows on the norm handoff, scaled by 1 / RMS
into float32 logits, and their greedy tokens by the folded reduce, in one launch; under the Triton
interpreter against float64 and ``torch.argmax``, with the logits poisoned first, a vocabulary
of several programs a row (the last one ragged), ties, and the row limit at and past 64."""

from __future__ import annotations

import pytest
import torch

from stepgraph.errors import ConfigError
from stepgraph.kernels.proj import head_scale as hs
from stepgraph.kernels.proj.proj_tiles import splitk_workspace
from tests.conftest import rel_err


def _inputs(m: int, v: int, dtype, seed: int, hidden: int = 48, parts: int = 6):
    g = torch.Generator().manual_seed(seed)
    raw = torch.randn(m, v, generator=g).to(dtype)
    r = torch.randn(m, hidden, generator=g, dtype=torch.float64) * 2
    ssq = torch.stack([(c * c).sum(1) for c in r.chunk(parts, 1)], 1).float()
    return raw, r, ssq


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m", [1, 3, 17])
def test_scaled_logits_and_tokens_against_float64_and_torch(monkeypatch, dtype, m):
    monkeypatch.setattr(hs, "BLOCK_V", 64)  # 5 programs a row at V = 300, the last ragged
    v, hidden, eps = 300, 48, 1e-5
    raw, r, ssq = _inputs(m, v, dtype, seed=m)
    raw[0, 7] = raw[0, 250] = raw[0].abs().max() + 1  # a tie across programs: the first wins
    logits = torch.full((m, v), float("nan"))
    tokens = torch.full((m,), -5, dtype=torch.int64)
    out = hs.head_scale(raw, ssq, hidden, eps, logits_out=logits, tokens_out=tokens)
    assert out is logits
    inv = (r.pow(2).mean(1, keepdim=True) + eps).rsqrt()
    assert rel_err(logits, raw.double() * inv) < 1e-6
    assert torch.equal(tokens, torch.argmax(logits, -1))
    assert tokens[0] == 7
    assert int(splitk_workspace(torch.device("cpu"), 1, 1)[1][0]) == 0  # the ticket reset


def test_without_tokens_only_the_logits(monkeypatch):
    monkeypatch.setattr(hs, "BLOCK_V", 64)
    raw, r, ssq = _inputs(2, 130, torch.float32, seed=5)
    logits = hs.head_scale(raw, ssq, 48, 1e-6)
    inv = (r.pow(2).mean(1, keepdim=True) + 1e-6).rsqrt()
    assert logits.dtype == torch.float32 and rel_err(logits, raw.double() * inv) < 1e-6


def test_limits_and_bad_inputs_name_the_problem(monkeypatch):
    monkeypatch.setattr(hs, "BLOCK_V", 64)
    raw, _, ssq = _inputs(65, 70, torch.float32, seed=9)
    hs.head_scale(raw[:64], ssq, 48, 1e-5, tokens_out=torch.empty(64, dtype=torch.int64))
    with pytest.raises(ConfigError, match="1-64"):  # one row past the limit
        hs.head_scale(raw, ssq, 48, 1e-5)
    with pytest.raises(ConfigError, match="needs ssq"):
        hs.head_scale(raw[:2], None, 48, 1e-5)
    for hidden in (0, True):
        with pytest.raises(ConfigError, match="hidden"):
            hs.head_scale(raw[:2], ssq, hidden, 1e-5)
    with pytest.raises(ConfigError, match="logits_out"):
        hs.head_scale(raw[:2], ssq, 48, 1e-5, logits_out=torch.empty(2, 70, dtype=torch.float64))
    with pytest.raises(ConfigError, match="ssq must be"):
        hs.head_scale(raw[:2], ssq[:1], 48, 1e-5)  # a row short
