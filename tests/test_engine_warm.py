"""The start-up warm-up on the CPU: the prompt lengths cover every specialization class (1, each
side of a multiple of 16, the prefill budget and one chunk past it) within the context, and a
warm-up leaves the engine empty with every KV page free."""

from __future__ import annotations

import dataclasses

import torch

from stepgraph.engine import Engine
from stepgraph.engine.warm import warm_lengths, warm_up
from stepgraph.model import ModelRunner


def test_lengths_cover_each_class_up_to_the_limit():
    got = warm_lengths(300, 128)
    assert got[:3] == [1, 2, 3] and {15, 16, 17, 127, 128, 129, 145, 255, 256, 257} <= set(got)
    assert max(got) == 257 and 258 not in got  # 2 x budget's class, within 300
    assert max(warm_lengths(100, 128)) == 65  # never past the longest prompt that fits
    assert max(warm_lengths(65, 128)) == 65 and max(warm_lengths(64, 128)) == 64


def test_warm_up_leaves_the_engine_empty_and_every_page_free():
    mr = ModelRunner.from_preset("tiny", "cpu", torch.float32, seed=2, max_bs=4, max_context_len=80)
    engine = Engine(mr, max_prefill_tokens=32)
    free = mr.kv_cache.allocator.num_free
    assert warm_up(engine) > 0
    assert not engine.has_unfinished and not engine.finished
    cache = engine.prefix_cache  # finished prompts' pages stay cached, evictable
    available = cache.num_available if cache is not None else mr.kv_cache.allocator.num_free
    assert available == free


def test_warm_up_counts_apart_and_leaves_nothing_cached():
    """The warm-up's requests are counted in ``warm_requests`` only: every other count is as it
    was (a server's metrics see no synthetic traffic), and no warm-up prompt stays cached."""
    mr = ModelRunner.from_preset("tiny", "cpu", torch.float32, seed=2, max_bs=4, max_context_len=80)
    engine = Engine(mr, max_prefill_tokens=32)
    engine.generate([[5, 6, 7]], 2)
    before = dataclasses.replace(engine.stats, batch_sizes=engine.stats.batch_sizes.copy())
    ran = warm_up(engine)
    assert ran > 0 and engine.stats.warm_requests == ran
    assert dataclasses.replace(engine.stats, warm_requests=0) == before
    assert engine.prefix_cache.num_cached == 0
    assert engine.generate([[5, 6, 7]], 2) == engine.generate([[5, 6, 7]], 2)
