from __future__ import annotations

import gc

import pytest

from stepgraph import capture
from stepgraph.errors import CaptureError


def test_model_capture_mode_sets_flag_and_refuses_nesting():
    assert not capture.is_capture_mode()
    with capture.model_capture_mode():
        assert capture.is_capture_mode()
        with pytest.raises(CaptureError, match="already in progress"):
            with capture.model_capture_mode():
                pass
        assert capture.is_capture_mode()
    assert not capture.is_capture_mode()


def test_capture_mode_resets_after_an_exception():
    with pytest.raises(ValueError):
        with capture.model_capture_mode():
            raise ValueError("boom")
    assert not capture.is_capture_mode()


def test_freeze_gc_freezes_and_unfreezes():
    before = gc.get_freeze_count()
    with capture.freeze_gc():
        assert gc.get_freeze_count() > before
    assert gc.get_freeze_count() == before
    with capture.freeze_gc(enabled=False):
        assert gc.get_freeze_count() == before


def test_global_pool_helpers_back_onto_one_state_object():
    old = capture.get_global_graph_memory_pool()
    try:
        capture.set_global_graph_memory_pool(("pool", 7))
        assert capture.get_global_graph_memory_pool() == ("pool", 7)
        assert capture.STATE.pool.handle == ("pool", 7)
    finally:
        capture.set_global_graph_memory_pool(old)


def test_capture_stats_sum_buckets():
    stats = capture.CaptureStats(
        [
            capture.BucketStats(8, 0.5, 0, 3 * 2**20),
            capture.BucketStats(4, 0.25, 3 * 2**20, 4 * 2**20),
        ]
    )
    assert stats.seconds == 0.75 and stats.pool_bytes == 4 * 2**20
    assert stats.summary() == "captured 2 buckets in 0.75 s, pool 4.0 MiB"
