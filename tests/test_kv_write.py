"""write_kv: each new token lands in its flat slot, nothing else changes, bad input is named."""

from __future__ import annotations

import pytest
import torch

from stepgraph.errors import ConfigError
from stepgraph.kernels.elementwise.kv_write import write_kv


def caches(seed, pages=6, ps=16, n_kv=2, hd=64, dtype=torch.float16):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(pages, ps, n_kv, hd, generator=g).to(dtype)
    return k, torch.randn(pages, ps, n_kv, hd, generator=g).to(dtype), g


@pytest.mark.parametrize("ps, dtype", [(16, torch.float16), (64, torch.bfloat16)])
def test_writes_each_slot_and_nothing_else(ps, dtype):
    kc, vc, g = caches(1, ps=ps, dtype=dtype)
    k0, v0 = kc.clone(), vc.clone()
    loc = torch.tensor([0, ps - 1, ps, 5 * ps + 3], dtype=torch.int64)  # page edges
    k = torch.randn(4, 2, 64, generator=g).to(dtype)
    v = torch.randn(4, 2, 64, generator=g).to(dtype)
    write_kv(kc, vc, k, v, loc)
    for i, slot in enumerate(loc.tolist()):
        page, off = divmod(slot, ps)
        assert torch.equal(kc[page, off], k[i]) and torch.equal(vc[page, off], v[i])
        k0[page, off], v0[page, off] = k[i], v[i]
    assert torch.equal(kc, k0) and torch.equal(vc, v0)


@pytest.mark.parametrize(
    "change, frag",
    [
        ({"k": lambda k: k[:, :1]}, "k must be [3, 2, 64]"),
        ({"v": lambda v: v[:2]}, "v must be [3, 2, 64]"),
        ({"k": lambda k: k.float()}, "k must be torch.float16"),
        ({"loc": lambda x: x.int()}, "out_cache_loc must be a [bs] torch.int64"),
        ({"vc": lambda c: c[:, :8]}, "k_cache and v_cache"),
    ],
)
def test_bad_input(change, frag):
    kc, vc, g = caches(2)
    args = {
        "kc": kc,
        "vc": vc,
        "k": torch.randn(3, 2, 64, generator=g).half(),
        "v": torch.randn(3, 2, 64, generator=g).half(),
        "loc": torch.tensor([1, 2, 3]),
    }
    for name, fn in change.items():
        args[name] = fn(args[name])
    with pytest.raises(ConfigError) as info:
        write_kv(*args.values())
    assert frag in str(info.value)
