"""Exact split geometry at every boundary, against tables written by hand (not against the
ladder functions under test):

- the ladder's steps for four grids, and keys per split at chosen lengths;
- every step boundary of those grids swept on the fake driver, up and then down: the exec's
  grid and combine count equal the table and eager's count (``num_splits_for``);
- one workspace reused from 8 splits to 2 without poisoning (exact mode shrinking), against the
  float64 reference, and the combine handed finite stale partials past ``n_splits``.
"""

from __future__ import annotations

import pytest
import torch

from stepgraph.graph_update import fa_apply, fa_plan, kernel_nodes
from stepgraph.kernels.decode.reference import paged_decode_reference
from stepgraph.kernels.decode.splits import (
    H200_NUM_SMS,
    SplitLadder,
    fa_split_keys,
    ladder_cap,
    ladder_steps,
    num_splits_for,
)

from .fake_driver import FakeDriver
from .test_flash_decode import fd, make_case, poisoned_workspace, rel_err

SMS = H200_NUM_SMS  # 132
POW2 = SplitLadder(pow2_splits=True)
# (n_kv_heads, bs, max_splits) -> the earlier (power-of-two) ladder's steps [(first t_kv, ns),
# ...], worked out by hand: cap = min(64, pow2_floor(4 * 132 // (bs * n_kv))); ns = min(cap,
# pow2_floor(t // 128)), then clamped to max_splits (128: splits.MIN_SPLIT_KEYS; where cap == 2,
# 384 in place of 128: splits.CAP2_MIN_SPLIT_KEYS).
POW2_LADDERS = {
    (8, 1, 64): [(1, 1), (256, 2), (512, 4), (1024, 8), (2048, 16), (4096, 32), (8192, 64)],
    (8, 8, 64): [(1, 1), (256, 2), (512, 4), (1024, 8)],  # cap 528 // 64 = 8
    (8, 32, 64): [(1, 1), (768, 2)],  # cap pow2_floor(528 // 256 = 2): 384 keys the least
    (8, 17, 64): [(1, 1), (768, 2)],  # 136 pairs: cap 2, the class's first bs
    (8, 16, 64): [(1, 1), (256, 2), (512, 4)],  # 128 pairs: cap 4, 128 keys the least
    (1, 1, 48): [(1, 1), (256, 2), (512, 4), (1024, 8), (2048, 16), (4096, 32), (8192, 48)],
    (2, 4, 16): [(1, 1), (256, 2), (512, 4), (1024, 8), (2048, 16)],  # cap 64, clamped at 16
    (8, 64, 64): [(1, 1)],  # 512 (request, head) pairs: cap pow2_floor(max(1, 1)) = 1
}
# The ladder: ns = min(cap, ceil(t / least)) from 2 * least keys (one split below), clamped to
# max_splits: 2 splits at 2 * least, then one more every least keys, (k - 1) * least + 1 for k.
# (cap, least, clamp) per grid, by hand from the caps above.
TILE_GRIDS = {
    (8, 1, 64): (64, 128),
    (8, 8, 64): (8, 128),
    (8, 32, 64): (2, 384),
    (8, 17, 64): (2, 384),
    (8, 16, 64): (4, 128),
    (1, 1, 48): (64, 128),
    (2, 4, 16): (64, 128),
    (8, 64, 64): (1, 128),
}


def tile_steps(cap: int, least: int, clamp: int) -> list[tuple[int, int]]:
    top = min(cap, clamp)
    if top == 1:
        return [(1, 1)]
    return [(1, 1), (2 * least, 2)] + [((k - 1) * least + 1, k) for k in range(3, top + 1)]


LADDERS = {g: tile_steps(cap, least, g[2]) for g, (cap, least) in TILE_GRIDS.items()}
CAPS = {(8, 1): 64, (8, 8): 8, (8, 32): 2, (1, 1): 64, (2, 4): 64, (8, 64): 1, (4, 3): 32}
# (t_kv, n_kv, bs) -> keys per split, by hand: max(128, ceil(t / ns))
KEYS = {
    (0, 8, 1): 128,
    (1, 8, 1): 128,
    (255, 8, 1): 255,  # ns 1: one split holds it all
    (256, 8, 1): 128,
    (257, 8, 1): 86,  # ns 3, ceil(257 / 3)
    (1000, 8, 1): 125,  # ns ceil(1000 / 128) = 8
    (100_000, 8, 1): 1563,  # ns 64, ceil(100000 / 64)
    (100_000, 8, 8): 12_500,  # ns 8
    (5000, 8, 32): 2500,  # ns 2
    (767, 8, 32): 767,  # cap 2: ns 1 below 2 * 384 keys
    (768, 8, 32): 384,
    (769, 8, 32): 385,
    (300, 8, 32): 384,  # ns 1, and never fewer than the cap-2 least
    (5000, 8, 64): 5000,  # ns 1
}


def ns_from_table(steps: list[tuple[int, int]], t: int) -> int:
    return [ns for start, ns in steps if start <= t][-1]


@pytest.mark.parametrize("grid", list(LADDERS))
def test_ladder_steps_equal_the_hand_written_table(grid):
    n_kv, bs, max_splits = grid
    for ladder, table in ((SplitLadder(), LADDERS), (POW2, POW2_LADDERS)):
        assert ladder_steps(n_kv, bs, SMS, max_splits, ladder=ladder) == table[grid]
        for t, ns in table[grid]:  # each step's first length, and the length before it
            assert num_splits_for(t, n_kv, bs, SMS, max_splits, ladder=ladder) == ns
            if t > 1:
                assert num_splits_for(t - 1, n_kv, bs, SMS, max_splits, ladder=ladder) < ns


def test_caps_and_keys_per_split_equal_the_hand_written_values():
    assert {k: ladder_cap(*k, SMS) for k in CAPS} == CAPS
    assert {k: fa_split_keys(t, n_kv, bs, SMS) for k in KEYS for t, n_kv, bs in [k]} == KEYS
    assert ladder_cap(8, 1, SMS, programs_per_sm=2) == 32  # pow2_floor(264 // 8 = 33)
    assert ladder_cap(8, 1, 10, programs_per_sm=1) == 1  # 10 // 8 = 1


# Driver-level parameter sizes of our kernels, as on the device (see test_graph_update_flash.py).
MAIN_SIZES = [8, 8, 8, 8, 4, 4, 4, 8, 8]
COMBINE_SIZES = [8, 4, 8, 8, 4, 4, 8, 8]


def test_every_step_boundary_up_then_down_on_the_fake_driver():
    """One graph holds a main/combine pair per grid of LADDERS (each captured with its clamp as
    the bucket's split count, as the model captures with ns(max_context)); fa_apply is driven
    across every boundary t-1, t, t+1, rising and then falling."""
    fdrv = FakeDriver()
    g = fdrv.new_graph()
    k_main = fdrv.cuda.kernel("_split_kv_kernel", MAIN_SIZES)
    k_comb = fdrv.cuda.kernel("_combine_kernel", COMBINE_SIZES)
    order, pairs = [], []
    for i, ((n_kv, bs, _), steps) in enumerate(LADDERS.items()):
        bucket = steps[-1][1]
        ptr = (i + 1) << 20
        m = fdrv.cuda.add_kernel_node(
            g,
            k_main,
            [ptr, 1 << 30, 2 << 30, 3 << 30, 0x3E000000, 64, 128, 0, 0],
            (bs, n_kv, bucket),
        )
        c = fdrv.cuda.add_kernel_node(
            g, k_comb, [ptr, bucket, 4 << 30, 5 << 30, 64, 8, 0, 0], (bs, 4 * n_kv, 1)
        )
        order += [m, c]
        pairs.append((m, c, n_kv, bs, bucket, steps))
    fdrv.chain(g, order)
    t_max = 8192
    plan = fa_plan(kernel_nodes(g, driver=fdrv), max_t_kv=t_max, num_sms=SMS)
    ex = fdrv.cuda.instantiate(g)
    edges = sorted({t + d for *_, steps in pairs for t, _ in steps for d in (-1, 0, 1)})
    ts = [t for t in edges if 1 <= t <= t_max] + [t_max]
    for t in ts + ts[::-1]:
        fa_apply(plan, ex, t)
        for m, c, n_kv, bs, bucket, steps in pairs:
            want = ns_from_table(steps, t)
            grid_z = fdrv.exec_grid(ex, m)[2]
            n_splits = int.from_bytes(fdrv.exec_arg(ex, c, 1), "little", signed=True)
            assert (grid_z, n_splits) == (want, want), f"t_kv={t}, grid {(n_kv, bs, bucket)}"
            assert want == num_splits_for(t, n_kv, bs, SMS, bucket)  # what eager launches
            assert fdrv.exec_grid(ex, m)[:2] == (bs, n_kv)


def test_workspace_reused_from_8_splits_to_2_unpoisoned():
    """Exact mode shrinking: the graph's workspace still holds 8 finite partials per row from
    the longer step when the next one runs 2 splits; the combine must read only 2."""
    c = make_case(61, [512, 449, 480], n_heads=4, n_kv=1, hd=64, ps=16)  # 8 live splits of 64
    ws = poisoned_workspace(3, 4, 64, 8)
    out = torch.full_like(c.q, float("nan"))
    ref = paged_decode_reference(c.q, c.k, c.v, c.bt, c.lens, 0.125, compute_dtype=torch.float64)
    fd.flash_decode(
        c.q, c.k, c.v, c.bt, c.lens, num_splits=8, workspace=ws, out=out, sm_scale=0.125
    )
    assert rel_err(out, ref) < 2e-6
    assert torch.isfinite(ws.partial_lse).all()  # every one of the 8 splits was live
    out.fill_(float("nan"))
    fd.flash_decode(
        c.q, c.k, c.v, c.bt, c.lens, num_splits=2, workspace=ws, out=out, sm_scale=0.125
    )
    assert rel_err(out, ref) < 2e-6


def test_combine_reads_exactly_n_splits_of_finite_partials():
    g = torch.Generator().manual_seed(62)
    bs, n_heads, hd, ms = 2, 3, 64, 8
    ws = poisoned_workspace(bs, n_heads, hd, ms)
    ws.partial_lse.copy_(torch.randn(bs, n_heads, ms, generator=g))  # all finite: all "live"
    ws.partial_o.copy_(torch.randn(bs, n_heads, ms, hd, generator=g))
    for n in (1, 2, 3, 7, 8):
        out = torch.full((bs, n_heads, hd), float("nan"))
        fd._combine_kernel[(bs, n_heads)](
            ws.partial_o,
            n,
            ws.partial_lse,
            out,
            *ws.partial_o.stride()[:3],
            *ws.partial_lse.stride()[:2],
            *out.stride()[:2],
            HEAD_DIM=hd,
            SPLITS_PAD=ms,
        )
        w = torch.softmax(ws.partial_lse[..., :n].double(), -1)
        want = (w[..., None] * ws.partial_o[..., :n, :].double()).sum(2)
        torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-6, msg=f"n={n}")
