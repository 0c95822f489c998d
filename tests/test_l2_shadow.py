"""The attention's L2 prefetch of the next weights (``kernels/l2_shadow``) on the CPU: the
switch's grammar and its refusals, the region checks at and one past each limit, and that the
split-KV kernels take the regions and give the same output with them (under the interpreter
the prefetch itself is compiled out; tests/gpu/test_l2_shadow_gpu.py runs it)."""

from __future__ import annotations

import pytest
import torch

from stepgraph.errors import ConfigError
from stepgraph.kernels.decode_inputs import DecodeWorkspace
from stepgraph.kernels.flash_decode import flash_decode
from stepgraph.kernels.l2_shadow import shadow_args, shadow_kwargs, shadow_spec


@pytest.mark.parametrize(
    "value, want",
    [("0", (False, 0.0, False)), ("", (False, 0.0, False)), ("o", (True, 0.0, False)),
     ("o,gu=0.25", (True, 0.25, False)), ("o,gu=1@end", (True, 1.0, True)),
     ("gu=0.5", (False, 0.5, False)), (" o @end", (True, 0.0, True))],
)  # fmt: skip
def test_spec(value, want):
    assert shadow_spec(value) == want


@pytest.mark.parametrize("value", ["o,gu=0", "o,gu=1.01", "o,gu=x", "q", "o@start", "1"])
def test_spec_refusals_name_the_switch(value):
    with pytest.raises(ConfigError, match="STEPGRAPH_SHADOW_PREFETCH"):
        shadow_spec(value)


def test_region_limits():
    w, dummy = torch.randn(6, 40), torch.randn(3)
    args, n = shadow_args([(w, 40)], dummy)  # cols = K: the whole rows
    assert n == 1 and args[:4] == [w, 6, 40, 40] and args[4:] == [dummy, 0, 0, 0]
    assert shadow_args([], dummy) == ([dummy, 0, 0, 0] * 2, 0)
    assert shadow_args(None, dummy)[1] == 0
    with pytest.raises(ConfigError, match="0 < cols <= 40"):
        shadow_args([(w, 41)], dummy)  # one past K
    with pytest.raises(ConfigError, match="0 < cols"):
        shadow_args([(w, 0)], dummy)
    with pytest.raises(ConfigError, match="contiguous rows"):
        shadow_args([(w.t(), 3)], dummy)
    assert shadow_args([(w, 1), (w, 2)], dummy)[1] == 2  # two: the most
    with pytest.raises(ConfigError, match="at most 2 regions, got 3"):
        shadow_args([(w, 1)] * 3, dummy)


def test_kwargs():
    o, gu = torch.randn(8, 16), torch.randn(32, 16)
    assert shadow_kwargs(o, gu, (False, 0.0, False)) == {}
    kw = shadow_kwargs(o, gu, (True, 0.25, True))
    assert kw["shadow_end"] is True and [c for _, c in kw["shadow"]] == [16, 4]
    assert kw["shadow"][0][0] is o and kw["shadow"][1][0] is gu
    assert [c for _, c in shadow_kwargs(o, gu, (False, 0.01, False))["shadow"]] == [1]


@pytest.mark.parametrize("fold", [False, True])
@pytest.mark.parametrize("end", [False, True])
def test_split_kernels_take_the_regions(fold, end):
    g = torch.Generator().manual_seed(3 + fold + 2 * end)
    bs, n_heads, n_kv, hd, pages, page = 3, 4, 2, 16, 6, 8
    q = torch.randn(bs, n_heads, hd, generator=g)
    kc, vc = (torch.randn(pages, page, n_kv, hd, generator=g) for _ in range(2))
    table = torch.randperm(pages, generator=g)[: 2 * bs].reshape(bs, 2).to(torch.int32)
    lens = torch.tensor([16, 1, 9], dtype=torch.int32)
    w1, w2 = torch.randn(5, 24, generator=g), torch.randn(7, 24, generator=g)

    def run(**shadow):
        ws = DecodeWorkspace.allocate(bs, n_heads, hd, 4, q.device)
        return flash_decode(q, kc, vc, table, lens, num_splits=3, workspace=ws,
                            fold_combine=fold, **shadow)  # fmt: skip

    want = run()
    got = run(shadow=[(w1, 24), (w2, 5)], shadow_end=end)
    assert torch.equal(got, want)
