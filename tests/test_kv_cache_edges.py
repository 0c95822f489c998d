"""The KV cache at its edges (found by mutation testing, scripts/mutation-test): exact byte
counts, the memory check at equality, allocation order, every limit exactly at and one past."""

from __future__ import annotations

import builtins
import io

import pytest
import torch

from stepgraph.errors import ConfigError
from stepgraph.model import kv_cache as kvc
from stepgraph.model.kv_cache import SCRATCH_PAGE, KVCache, PageAllocator


def _cache(**kw) -> KVCache:
    args = dict(
        num_layers=3,
        num_kv_heads=2,
        head_dim=8,
        num_pages=7,
        page_size=4,
        max_context_len=10,
        dtype=torch.float16,
        device="cpu",
    )
    return KVCache(**{**args, **kw})


def test_allocator_hands_out_lowest_ids_first_and_takes_back_in_order():
    alloc = PageAllocator(6)
    assert alloc.num_pages == 6 and alloc.num_free == 5
    assert alloc.allocate(2) == [1, 2]
    assert alloc.allocate(0) == []
    b = alloc.allocate(3)
    assert b == [3, 4, 5] and alloc.num_free == 0  # every usable page, exactly
    with pytest.raises(ConfigError, match="0 free pages, 1 needed.*with more pages\\.$"):
        alloc.allocate(1)
    alloc.free([4, 3])
    assert alloc.allocate(1) == [3]  # the lowest free id again
    alloc.free([1])
    assert alloc.allocate(2) == [1, 4]
    assert PageAllocator(2).allocate(1) == [1]  # the smallest cache: one usable page


def test_allocator_refuses_a_repeated_page_in_one_free():
    alloc = PageAllocator(5)
    pages = alloc.allocate(3)
    with pytest.raises(ConfigError, match="not allocated"):
        alloc.free([pages[0], pages[0]])
    assert alloc.num_free == 1  # nothing was freed
    alloc.free(pages)
    assert alloc.num_free == 4
    for bad in (0, 1, -1):
        with pytest.raises(ConfigError, match="scratch"):
            PageAllocator(bad)


def _meminfo(text: str, monkeypatch) -> None:
    real_open = builtins.open

    def fake_open(path, *a, **kw):
        if path == "/proc/meminfo":
            if text is None:
                raise OSError("no procfs")
            return io.StringIO(text)
        return real_open(path, *a, **kw)

    monkeypatch.setattr(builtins, "open", fake_open)


def test_free_bytes_reads_mem_available_in_kib(monkeypatch):
    info = "MemTotal:       1000 kB\nMemFree:         300 kB\nMemAvailable:    512 kB\n"
    _meminfo(info, monkeypatch)
    assert kvc.free_bytes("cpu") == 512 * 1024
    assert kvc.free_bytes(torch.device("cpu")) == 512 * 1024
    _meminfo("MemTotal: 1000 kB\n", monkeypatch)
    assert kvc.free_bytes("cpu") is None  # no MemAvailable line
    _meminfo(None, monkeypatch)
    assert kvc.free_bytes("cpu") is None
    assert kvc.free_bytes("meta") is None


def test_free_bytes_on_cuda_is_the_drivers_free_count(monkeypatch):
    seen = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: seen.append(d) or (123, 456))
    assert kvc.free_bytes("cuda:0") == 123
    assert seen == [torch.device("cuda:0")]


def test_check_memory_refuses_only_above_free(monkeypatch):
    monkeypatch.setattr(kvc, "free_bytes", lambda device: 3 * 2**30)
    kvc.check_memory(3 * 2**30, 10, "cpu")  # exactly what is free: fits
    with pytest.raises(ConfigError) as info:
        kvc.check_memory(3 * 2**30 + 1, 10, "cpu")
    msg = str(info.value)
    assert "needs 10 pages, 3.00 GiB" in msg and "only 3.00 GiB is free on cpu" in msg
    assert "max_bs or max_context_len" in msg and msg.endswith(
        "(the cache holds max_bs requests of max_context_len tokens), or pass num_pages."
    )
    monkeypatch.setattr(kvc, "free_bytes", lambda device: None)
    kvc.check_memory(10**18, 10, "cpu")  # unknown: not refused


def test_cache_asks_for_its_exact_bytes_before_allocating(monkeypatch):
    asked = []
    monkeypatch.setattr(kvc, "check_memory", lambda *a: asked.append(a))
    kv = _cache()
    # K and V, 3 layers, 7 pages of 4 slots, 2 heads of 8, fp16 (2 bytes)
    assert asked == [(2 * 3 * 7 * 4 * 2 * 8 * 2, 7, "cpu")]
    assert len(kv.k_caches) == len(kv.v_caches) == 3
    for t in (*kv.k_caches, *kv.v_caches):
        assert t.shape == (7, 4, 2, 8) and t.dtype == torch.float16 and t.device.type == "cpu"
        assert not t.any()
    assert len({t.data_ptr() for t in (*kv.k_caches, *kv.v_caches)}) == 6
    assert (kv.page_size, kv.max_context_len, kv.num_pages) == (4, 10, 7)
    assert kv.max_pages_per_request == 3  # ceil(10 / 4)
    assert _cache(max_context_len=8).max_pages_per_request == 2
    assert _cache(max_context_len=1).max_pages_per_request == 1


def test_cache_refused_when_larger_than_free_memory(monkeypatch):
    monkeypatch.setattr(kvc, "free_bytes", lambda device: 2 * 3 * 7 * 4 * 2 * 8 * 2)
    _cache()  # exactly fits
    monkeypatch.setattr(kvc, "free_bytes", lambda device: 2 * 3 * 7 * 4 * 2 * 8 * 2 - 1)
    with pytest.raises(ConfigError, match="needs 7 pages"):
        _cache()


@pytest.mark.parametrize("bad", [dict(page_size=0), dict(max_context_len=0)])
def test_cache_refuses_non_positive_sizes(bad):
    with pytest.raises(ConfigError, match=r"page_size and max_context_len must be >= 1"):
        _cache(**bad)
    _cache(page_size=1, max_context_len=1)  # the smallest valid sizes


def test_check_fits_at_and_one_past_each_limit():
    kv = _cache(num_pages=4, max_context_len=10)  # 3 usable pages of 4 slots
    assert kv.pages_for(0) == 0 and kv.pages_for(4) == 1 and kv.pages_for(5) == 2
    kv.check_fits(10)  # at max_context_len
    with pytest.raises(
        ConfigError, match=r"prompt 3 needs 11 KV slots.*with a larger max_context_len\.$"
    ):
        kv.check_fits(11, "prompt 3")
    big = _cache(num_pages=3, max_context_len=100)  # 2 usable pages of 4 slots
    big.check_fits(8)  # exactly the whole cache
    with pytest.raises(ConfigError, match=r"^request needs 3 pages of 4.*more num_pages\.$"):
        big.check_fits(9)
    assert big.can_reserve(8) and not big.can_reserve(9)
    assert big.reserve(8) == [1, 2] and not big.can_reserve(1) and big.can_reserve(0)


def test_slot_positions_at_and_past_the_edges():
    kv = _cache()
    pages = [5, 2, 6]
    assert [kv.slot(pages, p) for p in (0, 3, 4, 7, 8, 11)] == [20, 23, 8, 11, 24, 27]
    with pytest.raises(ConfigError, match="past the 3 pages"):
        kv.slot(pages, 12)
    with pytest.raises(ConfigError, match="position -1 is negative"):
        kv.slot(pages, -1)
    assert kv.slots(pages, 3, 5) == [23, 8] and kv.slots(pages, 4, 4) == []


def test_block_table_row_at_and_past_the_request_limit():
    kv = _cache()  # 3 pages per request
    assert kv.block_table_row([4, 1, 6]) == [4, 1, 6]
    assert kv.block_table_row([5]) == [5, SCRATCH_PAGE, SCRATCH_PAGE]
    assert kv.block_table_row([]) == [SCRATCH_PAGE] * 3
    with pytest.raises(ConfigError, match="4 pages exceed max_pages_per_request=3"):
        kv.block_table_row([1, 2, 3, 4])
