"""Eager runs a live batch of ``bs`` rows; a graph (and so exact mode) runs the bucket it pads
to. Exact equals eager only if every kernel choice of the fused step is the same for ``bs`` and
its bucket: the reference rows, the tile class, cuBLAS or fused per projection, the tile, and
the folded attention. Checked for every bs to 80 against the default buckets of several max_bs
(pure: no kernel runs). The first version of the bs 2-64 step failed it at bs 5-7 (reference
rows, graph of 8) and 33 (folded attention at 48)."""

from __future__ import annotations

import pytest

from stepgraph.buckets import default_capture_sizes, pad_to_bucket
from stepgraph.kernels.proj_tiles import KERNELS, TILES, block_m, prefer_cublas, tile_for
from stepgraph.kernels.splits import num_splits_for
from stepgraph.model.fused_decode import FUSED_MAX_BS, kernel_class, reference_rows

SHAPES = sorted({(kernel, n, k) for kernel, n, k, _ in TILES})


def _choices(bs: int) -> tuple:
    fused = bs <= FUSED_MAX_BS
    cls = kernel_class(bs)
    out = [fused, fused and reference_rows(bs), block_m(bs)]
    for kernel, n, k in SHAPES:
        out += [prefer_cublas(kernel, bs, n, k), tile_for(kernel, bs, n, k)]
    for ctx in (512, 4096, 131072):  # the folded attention: one split at any context
        for kv_heads, max_splits in ((8, 32), (2, 64), (1, 16)):
            out.append(num_splits_for(ctx, kv_heads, cls, 132, max_splits) == 1)
    return tuple(out)


@pytest.mark.parametrize("max_bs", [8, 16, 48, 64, 256])
def test_every_batch_and_its_bucket_choose_the_same_kernels(max_bs):
    buckets = default_capture_sizes(max_bs)
    differ = [
        (bs, pad_to_bucket(bs, buckets))
        for bs in range(1, min(max_bs, 80) + 1)
        if _choices(bs) != _choices(pad_to_bucket(bs, buckets))
    ]
    assert differ == []


def test_the_table_covers_every_kernel():
    assert {kernel for kernel, _, _ in SHAPES} <= set(KERNELS) and len(SHAPES) >= 4
