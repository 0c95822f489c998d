"""No silent minutes: a KV cache that cannot fit in memory is refused before it is allocated,
naming the pages it needs; a slow eager prefill shows progress on stderr, never stdout; a
negative position never indexes another request's page."""

from __future__ import annotations

import pytest
import torch

from stepgraph.engine import Engine
from stepgraph.engine import offline as engine_module
from stepgraph.errors import ConfigError
from stepgraph.model import ModelRunner, kv_cache

from .guards import assert_kv_unchanged, fill_kv_random, kv_snapshot, time_limit


def test_kv_cache_larger_than_memory_is_refused_with_its_pages():
    with time_limit(10), pytest.raises(ConfigError, match=r"needs 10000001 pages, 76.29 GiB"):
        # 1e6 requests of 160 tokens: 1e7 pages of 16 tokens x 512 bytes; nothing is allocated
        ModelRunner.from_preset("tiny", "cpu", torch.float32, max_bs=10**6, max_context_len=160)


def test_kv_cache_checks_against_free_memory(monkeypatch):
    monkeypatch.setattr(kv_cache, "free_bytes", lambda device: 2**20)  # 1 MiB free
    with pytest.raises(ConfigError, match="lower max_bs or max_context_len"):
        ModelRunner.from_preset("tiny", "cpu", torch.float32, max_bs=64, max_context_len=256)
    assert ModelRunner.from_preset("tiny", "cpu", torch.float32, max_bs=1, max_context_len=64)


def test_slow_eager_prefill_shows_progress_on_stderr(monkeypatch, capsys):
    monkeypatch.setattr(engine_module, "PREFILL_PROGRESS_DELAY_S", 0.0)  # "slow" from the start
    mr = ModelRunner.from_preset("tiny", "cpu", torch.float32, max_bs=4, max_context_len=64)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(1, 512, (n,), generator=g).tolist() for n in (5, 17, 9)]
    Engine(mr, "eager").generate(prompts, 2)
    captured = capsys.readouterr()
    assert "prefill" in captured.err and captured.out == ""


def test_fast_prefill_is_quiet(capsys):
    mr = ModelRunner.from_preset("tiny", "cpu", torch.float32, max_bs=2, max_context_len=64)
    Engine(mr, "eager").generate([[3, 4, 5], [6, 7]], 2)
    assert capsys.readouterr().err == ""


def test_negative_position_is_refused_before_anything_is_written():
    mr = ModelRunner.from_preset("tiny", "cpu", torch.float32, max_bs=2, max_context_len=64)
    fill_kv_random(mr.kv_cache, seed=6)
    pages = mr.kv_cache.reserve(40)
    before, free = kv_snapshot(mr.kv_cache), mr.kv_cache.allocator.num_free
    with pytest.raises(ConfigError, match="negative"):
        mr.decode_batch([7, 8], [3, -1], [pages, pages])
    with pytest.raises(ConfigError, match="negative"):
        mr.kv_cache.slot(pages, -16)
    assert_kv_unchanged(mr.kv_cache, before)
    assert mr.kv_cache.allocator.num_free == free
