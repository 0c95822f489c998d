from __future__ import annotations

import random

import pytest

from stepgraph.buckets import (
    default_capture_sizes,
    distribute_tokens,
    pad_to_bucket,
    validate_buckets,
)
from stepgraph.errors import ConfigError, ReplayError


def test_default_capture_sizes():
    assert default_capture_sizes(256) == [1, 2, 4, 8] + list(range(16, 257, 16))
    assert len(default_capture_sizes(256)) == 20
    assert default_capture_sizes(8) == [1, 2, 4, 8]
    assert default_capture_sizes(5) == [1, 2, 4, 5]
    assert default_capture_sizes(40) == [1, 2, 4, 8, 16, 32, 40]


def test_pad_to_bucket_matches_linear_scan():
    buckets = default_capture_sizes(256)
    for n in range(1, 257):
        assert pad_to_bucket(n, buckets) == min(b for b in buckets if b >= n)


def test_pad_to_bucket_errors_name_the_limit():
    with pytest.raises(ReplayError, match=r"largest captured bucket \(8\).*eagerly.*max_bs"):
        pad_to_bucket(9, [1, 2, 4, 8])
    with pytest.raises(ReplayError, match="empty batch"):
        pad_to_bucket(0, [1, 2])


@pytest.mark.parametrize("bad", [[], [0, 1], [2, 1], [1, 1, 2], [1, -4]])
def test_validate_buckets_rejects(bad):
    with pytest.raises(ConfigError):
        validate_buckets(bad)


def test_distribute_tokens():
    assert distribute_tokens(10, 3) == [4, 3, 3]
    assert distribute_tokens(9, 3) == [3, 3, 3]
    assert distribute_tokens(1, 1) == [1]
    rng = random.Random(48)
    for _ in range(200):
        bs = rng.randint(1, 40)
        total = rng.randint(bs, 5000)
        parts = distribute_tokens(total, bs)
        assert sum(parts) == total and len(parts) == bs and min(parts) >= 1
        assert parts[0] - parts[1 % bs] == (total % bs if bs > 1 else 0)
    with pytest.raises(ConfigError):
        distribute_tokens(2, 3)
