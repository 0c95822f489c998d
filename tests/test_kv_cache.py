"""Paged KV cache: page 0 is never handed out, slots and block-table rows, freeing, errors."""

from __future__ import annotations

import random

import pytest
import torch

from stepgraph.errors import ConfigError
from stepgraph.model.kv_cache import SCRATCH_PAGE, KVCache, PageAllocator


def _cache(num_pages: int = 9, page_size: int = 4, max_context_len: int = 16) -> KVCache:
    return KVCache(
        num_layers=2,
        num_kv_heads=2,
        head_dim=8,
        num_pages=num_pages,
        page_size=page_size,
        max_context_len=max_context_len,
        dtype=torch.float32,
        device="cpu",
    )


def test_allocator_never_hands_out_scratch_page():
    rng = random.Random(0)
    alloc = PageAllocator(12)
    held: list[list[int]] = []
    seen: set[int] = set()
    for _ in range(200):  # random allocate/free churn
        if held and (rng.random() < 0.5 or alloc.num_free == 0):
            alloc.free(held.pop(rng.randrange(len(held))))
        else:
            pages = alloc.allocate(rng.randint(1, max(1, alloc.num_free)))
            seen.update(pages)
            held.append(pages)
        live = [p for pages in held for p in pages]
        assert SCRATCH_PAGE not in live
        assert len(live) == len(set(live))  # no page owned twice
        assert alloc.num_free + len(live) == 11
    assert seen == set(range(1, 12))  # every usable page was used at some point


def test_allocate_too_many_takes_nothing():
    alloc = PageAllocator(4)
    alloc.allocate(2)
    with pytest.raises(ConfigError, match="1 free pages, 2 needed"):
        alloc.allocate(2)
    assert alloc.num_free == 1


def test_double_free_raises():
    alloc = PageAllocator(4)
    pages = alloc.allocate(2)
    alloc.free(pages)
    with pytest.raises(ConfigError, match="not allocated"):
        alloc.free(pages)
    with pytest.raises(ConfigError, match="not allocated"):
        alloc.free([SCRATCH_PAGE])


def test_slots_and_block_table_rows():
    kv = _cache()
    assert kv.max_pages_per_request == 4
    a = kv.reserve(6)  # 2 pages
    b = kv.reserve(9)  # 3 pages
    assert len(a) == 2 and len(b) == 3 and not set(a) & set(b)
    assert kv.slots(b, 0, 9) == [b[p // 4] * 4 + p % 4 for p in range(9)]
    assert kv.block_table_row(a) == a + [SCRATCH_PAGE, SCRATCH_PAGE]
    with pytest.raises(ConfigError, match="past the 2 pages"):
        kv.slot(a, 8)
    # every slot of every request is distinct and outside scratch page 0
    all_slots = kv.slots(a, 0, 8) + kv.slots(b, 0, 12)
    assert len(set(all_slots)) == len(all_slots) and min(all_slots) >= kv.page_size
    kv.release(a)
    assert kv.allocator.num_free == 8 - 3


def test_admission_errors_leave_cache_untouched():
    kv = _cache(num_pages=4, max_context_len=32)  # 3 usable pages of 4 tokens
    held = kv.reserve(4)
    with pytest.raises(ConfigError, match="max_context_len=32"):
        kv.reserve(33)
    with pytest.raises(ConfigError, match="3 usable pages"):
        kv.reserve(13)  # fits max_context_len, not the whole cache
    with pytest.raises(ConfigError, match="2 free pages, 3 needed"):
        kv.reserve(12)  # fits an empty cache, not now
    assert kv.allocator.num_free == 2 and kv.can_reserve(8) and not kv.can_reserve(9)
    kv.release(held)
    assert len(kv.reserve(12)) == 3


def test_config_errors():
    with pytest.raises(ConfigError, match="scratch"):
        PageAllocator(1)
    with pytest.raises(ConfigError, match="page_size"):
        _cache(page_size=0)
