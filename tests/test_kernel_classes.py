"""Eager runs a live batch of ``bs`` rows; a graph (and so exact mode) runs the bucket it pads
to. Exact equals eager only if every kernel choice of the fused step is the same for ``bs`` and
its bucket: the reference rows, the tile class, cuBLAS or fused per projection, the tile, and
the folded attention. Checked for every bs to 80 against the default buckets of several max_bs
(pure: no kernel runs). The first version of the bs 2-64 step failed it at bs 5-7 (reference
rows, graph of 8) and 33 (folded attention at 48)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from stepgraph.buckets import default_capture_sizes, pad_to_bucket, replay_bucket
from stepgraph.kernels.decode.splits import num_splits_for
from stepgraph.kernels.proj.proj_tiles import KERNELS, TILES, block_m, prefer_cublas, tile_for
from stepgraph.model import ModelRunner
from stepgraph.model.decode.fused_decode import FUSED_MAX_BS, kernel_class, reference_rows
from stepgraph.runner import CudaGraphRunner, RunnerConfig

SHAPES = sorted({(kernel, n, k) for kernel, n, k, _ in TILES})


def _choices(bs: int, buckets: list[int]) -> tuple:
    fused = bs <= FUSED_MAX_BS
    # the class eager takes with a graph runner of these buckets attached (it lends them to the
    # backend: geometry_bs), which above 64 rows is not the default geometry's (65 alone is 65;
    # with max_bs 256 it replays in 80, whose ladder caps at two splits where 65's caps at four)
    cls = kernel_class(bs, SimpleNamespace(geometry_bs=lambda b: replay_bucket(b, buckets)))
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
        if _choices(bs, buckets) != _choices(pad_to_bucket(bs, buckets), buckets)
    ]
    assert differ == []


def test_the_table_covers_every_kernel():
    assert {kernel for kernel, _, _ in SHAPES} <= set(KERNELS) and len(SHAPES) >= 4


def _eager_splits(backend, bs: int, t_kv: int) -> int:
    batch = SimpleNamespace(
        batch_size=bs,
        max_seq_len=t_kv,
        seq_lens_cpu=None,
        block_table=None,
        seq_lens=None,
        out_cache_loc=None,
    )
    backend.init_forward_metadata(batch)
    return backend.meta.num_splits


@pytest.mark.parametrize("n_kv", [8, 2])
def test_eager_split_count_is_the_ladder_at_the_graph_bucket(n_kv):
    """Mode exact retunes its bucket's graph with the ladder at the bucket's rows
    (``fa_apply``: the main's grid); eager takes the ladder at the same rows. Qwen2.5-0.5B's two
    KV heads at 1000 keys, or eight at 1000: 33 rows alone take more splits than the graph of 48."""
    mr = ModelRunner.from_preset("tiny", "cpu", max_bs=8, max_context_len=4096)
    backend = mr.attn_backend
    backend.use_kernel, backend.num_sms, backend.num_kv_heads = True, 132, n_kv
    for buckets in (None, [1, 3, 8, 40, 64]):
        backend.graph_buckets = buckets
        for bs in range(1, 65):
            bucket = pad_to_bucket(bs, buckets or default_capture_sizes(64))
            for t_kv in (1, 64, 333, 1000, 4096):
                want = num_splits_for(t_kv, n_kv, bucket, 132, backend.max_splits)
                assert _eager_splits(backend, bs, t_kv) == want, (buckets, bs, t_kv)
    backend.graph_buckets = None
    if n_kv == 8:  # a case the loop checks: 33 rows alone would take 2 splits, 48 take 1
        assert _eager_splits(backend, 33, 1000) == 1 != num_splits_for(1000, 8, 33, 132, 32)


def test_a_graph_runner_lends_its_buckets_to_eager_steps_until_shutdown():
    mr = ModelRunner.from_preset("tiny", "cpu", max_bs=8)
    runner = CudaGraphRunner(mr, RunnerConfig(capture_bs=[1, 3, 8], show_progress=False))
    backend = mr.attn_backend
    assert [backend.geometry_bs(bs) for bs in (1, 2, 3, 4, 8, 9)] == [1, 3, 3, 8, 8, 9]
    assert [kernel_class(bs, backend) for bs in (2, 4)] == [3, 8]
    runner.shutdown()
    assert [backend.geometry_bs(bs) for bs in (2, 3, 4, 9, 64, 65)] == [2, 4, 4, 16, 64, 65]
