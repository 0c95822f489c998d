"""The split ladder: monotone, one tile a split below the cap (never less than two thirds of
one), fills the GPU; the earlier power-of-two ladder (``SplitLadder.pow2_splits``) beside."""

from __future__ import annotations

import pytest

from stepgraph.kernels.decode.splits import (
    BLOCK_N,
    DEFAULT_LADDER,
    H200_NUM_SMS,
    LADDER_MAX_SPLITS,
    MIN_SPLIT_KEYS,
    PROGRAMS_PER_SM,
    SplitLadder,
    fa_split_keys,
    ladder_cap,
    ladder_steps,
    least_keys,
    num_splits_for,
)

POW2 = SplitLadder(pow2_splits=True)

T_MAX = 131072
GRIDS = [  # (n_kv_heads, bs, num_sms, max_splits)
    (8, 1, H200_NUM_SMS, 64),
    (8, 8, H200_NUM_SMS, 64),
    (8, 32, H200_NUM_SMS, 64),
    (2, 1, H200_NUM_SMS, 64),
    (1, 1, 132, 48),  # cap above a non-power-of-two max_splits: the clamp adds a step
    (4, 3, 108, 64),
    (8, 64, H200_NUM_SMS, 64),  # more (request, head) pairs than programs wanted
]


def test_min_split_keys_is_the_tuned_tile():
    # two fallback tiles; one tile of the tuned variant (Llama-3.2-1B's attention)
    from stepgraph.kernels.decode.flash_decode import DEFAULT_VARIANTS

    assert MIN_SPLIT_KEYS == 2 * BLOCK_N == 128
    assert {v.block_n for v in DEFAULT_VARIANTS.values()} == {MIN_SPLIT_KEYS}


@pytest.mark.parametrize("n_kv, bs, sms, max_splits", GRIDS)
def test_ladder_monotone_and_bounded(n_kv, bs, sms, max_splits):
    prev = 0
    changes = 0
    for t in range(1, T_MAX + 1, 7):  # dense sweep; ladder_steps below covers every t
        ns = num_splits_for(t, n_kv, bs, sms, max_splits)
        assert 1 <= ns <= max_splits
        assert ns >= prev, f"ns fell from {prev} to {ns} at t_kv={t}"
        changes += ns != prev and prev != 0
        prev = ns
    steps = ladder_steps(n_kv, bs, sms, max_splits, t_max=T_MAX)
    assert steps[0][0] == 1
    assert [t for t, _ in steps] == sorted({t for t, _ in steps})
    assert all(a[1] < b[1] for a, b in zip(steps, steps[1:])), steps
    assert len(steps) - 1 <= LADDER_MAX_SPLITS
    assert changes <= len(steps) - 1
    pow2 = ladder_steps(n_kv, bs, sms, max_splits, t_max=T_MAX, ladder=POW2)
    assert len(pow2) - 1 <= 16  # the earlier ladder: log2(cap) steps, and a clamp's


@pytest.mark.parametrize("n_kv, bs, sms, max_splits", GRIDS)
def test_split_keys_gives_back_ns_and_at_least_one_tile(n_kv, bs, sms, max_splits):
    for t in list(range(1, 600)) + [1023, 1024, 1025, 4095, 4097, 32767, 32768, 99999, T_MAX]:
        sk = fa_split_keys(t, n_kv, bs, sms)
        least = least_keys(ladder_cap(n_kv, bs, sms))
        assert 3 * sk >= 2 * least  # never under two thirds of a tile
        ns = -(-t // sk)
        assert num_splits_for(t, n_kv, bs, sms, max_splits) == max(1, min(max_splits, ns))
        if ns == 1:
            assert sk >= least
        elif ns < ladder_cap(n_kv, bs, sms):  # below the cap: one tile a split
            assert sk <= least
        if ns > 1:  # every split but the last holds sk keys; the last one at least one key
            assert t - (ns - 1) * sk >= 1
        sk2 = fa_split_keys(t, n_kv, bs, sms, ladder=POW2)
        ns2 = -(-t // sk2)
        assert sk2 >= least and (ns2 == 1 or ns2 & (ns2 - 1) == 0), "pow2: powers of two"


def test_llama_1b_step_counts_on_h200():
    def counts(pps=None, ladder=DEFAULT_LADDER):
        return {
            bs: len(ladder_steps(8, bs, H200_NUM_SMS, 64, programs_per_sm=pps, ladder=ladder)) - 1
            for bs in (1, 8, 32)
        }

    assert PROGRAMS_PER_SM == 4
    # a split every 128 keys up to the cap: 64 at one row, 8 at bs 8; 2 (from 768) at bs 32
    assert counts() == {1: 63, 8: 7, 32: 1}
    assert ladder_steps(8, 1, H200_NUM_SMS, 64)[-1] == (63 * 128 + 1, 64)
    assert counts(ladder=POW2) == {1: 6, 8: 3, 32: 1}  # the earlier ladder
    assert ladder_steps(8, 1, H200_NUM_SMS, 64, ladder=POW2)[-1] == (8192, 64)
    # the first ladder (2 per SM) is still one argument away
    assert counts(pps=2, ladder=POW2) == {1: 5, 8: 2, 32: 0}
    assert counts(pps=2) == {1: 31, 8: 3, 32: 0}


def test_one_tile_a_split_just_past_a_power_of_two():
    # 535 keys at one row: five splits of 107 (one 128-key tile each), where the power-of-two
    # ladder took four of 134 (two tiles each, the second nearly empty)
    assert num_splits_for(535, 8, 1, H200_NUM_SMS, 64) == 5
    assert fa_split_keys(535, 8, 1, H200_NUM_SMS) == 107
    assert num_splits_for(535, 8, 1, H200_NUM_SMS, 64, ladder=POW2) == 4
    assert fa_split_keys(535, 8, 1, H200_NUM_SMS, ladder=POW2) == 134
    # at the limits: 2 * 128 keys two splits, one more key three; the cap at 63 * 128 + 1
    assert [num_splits_for(t, 8, 1, H200_NUM_SMS, 64) for t in (255, 256, 257)] == [1, 2, 3]
    assert [num_splits_for(t, 8, 1, H200_NUM_SMS, 64) for t in (8064, 8065)] == [63, 64]
    with pytest.raises(ValueError, match="pow2_splits"):
        SplitLadder(pow2_splits=1)


@pytest.mark.parametrize("pps", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("n_kv, bs, sms, max_splits", GRIDS[:4])
def test_every_programs_per_sm_keeps_the_contract(pps, n_kv, bs, sms, max_splits):
    prev = 0
    ts = [1, 63, 64, 127, 128, 129, 1000, 4095, 4096, 4097, 32768, 99999, T_MAX]
    for t in ts:
        sk = fa_split_keys(t, n_kv, bs, sms, pps)
        ns = num_splits_for(t, n_kv, bs, sms, max_splits, pps)
        assert 3 * sk >= 2 * MIN_SPLIT_KEYS and ns == max(1, min(max_splits, -(-t // sk))) >= prev
        prev = ns
    steps = ladder_steps(n_kv, bs, sms, max_splits, programs_per_sm=pps)
    assert len(steps) - 1 <= LADDER_MAX_SPLITS
    programs = bs * n_kv * num_splits_for(T_MAX, n_kv, bs, sms, 64, pps)
    assert programs <= max(pps * sms, bs * n_kv)


@pytest.mark.parametrize("bs", [1, 2, 8, 16, 32])
def test_long_context_fills_the_gpu(bs):
    n_kv, sms = 8, H200_NUM_SMS
    programs = bs * n_kv * num_splits_for(T_MAX, n_kv, bs, sms, 64)
    assert sms <= programs <= PROGRAMS_PER_SM * sms
    assert ladder_cap(n_kv, bs, sms) <= LADDER_MAX_SPLITS


def test_short_context_is_one_split():
    assert num_splits_for(1, 8, 1, H200_NUM_SMS, 64) == 1
    assert num_splits_for(127, 8, 1, H200_NUM_SMS, 64) == 1
    assert num_splits_for(0, 8, 1, H200_NUM_SMS, 64) == 1


def test_max_splits_clamps():
    assert num_splits_for(T_MAX, 1, 1, H200_NUM_SMS, 4) == 4
    assert num_splits_for(T_MAX, 1, 1, H200_NUM_SMS, 1) == 1


@pytest.mark.parametrize("args", [(-1, 8, 1, 132), (10, 0, 1, 132), (10, 8, 0, 132), (10, 8, 1, 0)])
def test_bad_arguments(args):
    with pytest.raises(ValueError, match="split ladder"):
        fa_split_keys(*args)


def test_bad_programs_per_sm():
    with pytest.raises(ValueError, match="programs_per_sm"):
        fa_split_keys(10, 8, 1, 132, 0)


def test_bad_max_splits():
    with pytest.raises(ValueError, match="max_splits"):
        num_splits_for(10, 8, 1, 132, 0)


def test_min_keys_default_field_and_refusals():
    from stepgraph.kernels.decode.splits import MIN_SPLIT_KEYS_DEFAULT, SplitLadder

    assert SplitLadder().min_keys == MIN_SPLIT_KEYS_DEFAULT == 128
    assert SplitLadder(min_keys=64).min_keys == 64  # one fallback tile: the A/B field
    for bad in (0, 32, 96, -64, 64.0):  # below one tile, or not a multiple of it, or no int
        with pytest.raises(ValueError, match="split.min_keys"):
            SplitLadder(min_keys=bad)


def test_cap2_min_keys_field():
    from stepgraph.kernels.decode import splits

    assert splits.SplitLadder().cap2_min_keys == splits.CAP2_MIN_SPLIT_KEYS_DEFAULT == 384
    assert splits.SplitLadder(cap2_min_keys=64).cap2_min_keys == 64
    for bad in (0, -64, 100):
        with pytest.raises(ValueError, match="split.cap2_min_keys"):
            splits.SplitLadder(cap2_min_keys=bad)


def test_cap2_least_applies_at_cap_two_only():
    from stepgraph.kernels.decode import splits

    ladder = splits.SplitLadder(cap2_min_keys=384)
    # bs 16 (cap 4), 17 and 33 (cap 2), 34 (cap 1) with 8 KV heads on 132 SMs
    assert [splits.ladder_cap(8, bs, 132) for bs in (16, 17, 33, 34)] == [4, 2, 2, 1]
    assert splits.num_splits_for(767, 8, 16, 132, 64, ladder=ladder) == 4  # 128 the least
    assert splits.num_splits_for(767, 8, 17, 132, 64, ladder=ladder) == 1  # one below 768
    assert splits.num_splits_for(768, 8, 33, 132, 64, ladder=ladder) == 2
    assert splits.num_splits_for(100_000, 8, 34, 132, 64, ladder=ladder) == 1
    assert splits.num_splits_for(767, 8, 17, 132, 64) == 1  # the default ladder: the same
    # a global least above 384 still wins (the larger of the two)
    ladder = splits.SplitLadder(min_keys=512, cap2_min_keys=384)
    assert splits.num_splits_for(1023, 8, 32, 132, 64, ladder=ladder) == 1
    assert splits.num_splits_for(1024, 8, 32, 132, 64, ladder=ladder) == 2
    ladder = splits.SplitLadder(min_keys=128, cap2_min_keys=128)  # back to one rule
    assert splits.num_splits_for(256, 8, 32, 132, 64, ladder=ladder) == 2


def test_wide_heads_take_64_keys_a_split_at_the_limit_and_one_past():
    from stepgraph.kernels.decode import splits

    assert splits.WIDE_MIN_SPLIT_KEYS == splits.WIDE_MIN_SPLIT_KEYS_DEFAULT == BLOCK_N == 64
    ns = lambda t, hd, bs=1: num_splits_for(t, 8, bs, H200_NUM_SMS, 64, head_dim=hd)  # noqa: E731
    # head_dim 128 (cap 64 at one row): 1 split below 128 keys, then one a 64 keys
    assert [ns(t, 128) for t in (127, 128, 129, 255, 256, 257)] == [1, 2, 3, 4, 4, 5]
    assert [ns(t, 64) for t in (127, 128, 255, 256, 257)] == [1, 1, 1, 2, 3]  # 128 keys a split
    assert [ns(t, None) for t in (255, 256)] == [1, 2]  # no head_dim: the 64 ladder
    assert ns(4096, 128) == 64 and ns(4096, 64) == 32 and ns(8192, 64) == 64
    assert ns(100, 65) == 1 and ns(128, 65) == 2  # any head wider than 64
    # cap 2 (17-33 rows) keeps its own least for every head_dim
    assert [ns(t, 128, 32) for t in (767, 768)] == [1, 2]
    for t in (1, 63, 64, 65, 127, 128, 200, 4095, 4097, T_MAX):  # 2/3 of a 64-key tile or more
        sk = fa_split_keys(t, 8, 1, H200_NUM_SMS, head_dim=128)
        assert 3 * sk >= 2 * 64 and num_splits_for(t, 8, 1, H200_NUM_SMS, 64, head_dim=128) == min(
            64, -(-t // sk)
        )
    steps = ladder_steps(8, 1, H200_NUM_SMS, 64, head_dim=128)
    assert steps == [(1, 1), (128, 2)] + [((k - 1) * 64 + 1, k) for k in range(3, 65)]
    pow2 = ladder_steps(8, 1, H200_NUM_SMS, 64, head_dim=128, ladder=POW2)
    assert pow2 == [(1, 1), (128, 2), (256, 4), (512, 8), (1024, 16), (2048, 32), (4096, 64)]


def test_ladder_for_hands_out_one_monotone_ladder_a_head_dim():
    from stepgraph.kernels.decode import splits

    assert splits.ladder_for(None) is splits.ladder_for(64) is fa_split_keys
    wide = splits.ladder_for(128)
    assert wide is splits.ladder_for(128) and wide.monotone and wide.head_dim == 128
    for t in (1, 127, 128, 300, 4096, 5000):
        for bs in (1, 3, 8, 32):
            assert wide(t, 8, bs, 132) == fa_split_keys(t, 8, bs, 132, head_dim=128)
    # another ladder: a bound copy of its own (exact mode retunes with what eager takes)
    other = splits.SplitLadder(wide_min_keys=128)
    mine = splits.ladder_for(128, other)
    assert mine is splits.ladder_for(128, other) and mine.monotone and mine.ladder == other
    assert mine(4096, 8, 1, 132) == fa_split_keys(4096, 8, 1, 132, head_dim=128, ladder=other)
    assert splits.ladder_for(64, splits.SplitLadder(min_keys=256)) is not fa_split_keys


def test_wide_min_keys_field():
    from stepgraph.kernels.decode import splits

    assert splits.SplitLadder().wide_min_keys == 64
    assert splits.SplitLadder(wide_min_keys=128).wide_min_keys == 128
    for bad in (0, 32, -64):
        with pytest.raises(ValueError, match="split.wide_min_keys"):
            splits.SplitLadder(wide_min_keys=bad)


def test_programs_per_sm_field():
    from stepgraph.kernels.decode import splits

    assert splits.SplitLadder(programs_per_sm=8).programs_per_sm == 8
    for bad in (0, -1):
        with pytest.raises(ValueError, match="split.programs_per_sm"):
            splits.SplitLadder(programs_per_sm=bad)
    assert splits.ladder_cap(8, 8, 132) == 8  # 4 a SM: pow2_floor(528 // 64)
    eight = splits.SplitLadder(programs_per_sm=8)
    assert splits.ladder_cap(8, 8, 132, ladder=eight) == 16
    assert splits.num_splits_for(4096, 8, 8, 132, 64, ladder=eight) == 16
    assert splits.ladder_cap(8, 8, 132, 4, eight) == 8  # an explicit one still wins
