"""The folded split-KV kernel (``split_kv_fold``: one launch, the last split of a row merges the
partials, a row that fits in one split is written by split 0) under the Triton interpreter,
against the float64 reference and the two-kernel path; NaN-poisoned pages, partials and output
(from tests/test_flash_decode.py), fp32 and fp16, bs 1, 2, 3 and 17, rows of one and of many
splits in one batch. Also the registry's combine-less spec and its plan (fake driver)."""

from __future__ import annotations

import pytest
import torch

from stepgraph.graph_update.registry import DEFAULT_REGISTRY, FLASH_DECODE_FOLD_SPEC
from stepgraph.kernels.decode.reference import paged_decode_reference
from stepgraph.kernels.decode.split_kv_fold import FOLD_KERNEL_NAME
from tests.conftest import rel_err
from tests.test_flash_decode import make_case, run

TOL = {torch.float32: 1e-5, torch.float16: 3e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "lens, num_splits",
    [
        ([1], 1),
        ([200], 4),
        ([5, 300], 3),
        ([64, 65, 1], 2),
        ([(37 * i) % 260 + 1 for i in range(17)], 4),
    ],
)
def test_fold_matches_reference_and_two_kernels(dtype, lens, num_splits):
    c = make_case(len(lens) * 31 + num_splits, lens, n_heads=8, n_kv=2, hd=32, dtype=dtype)
    ref = paged_decode_reference(c.q.double(), c.k.double(), c.v.double(), c.bt, c.lens)
    got, ws = run(c, num_splits=num_splits, fold_combine=True)
    assert rel_err(got, ref) < TOL[dtype]
    assert int(ws.tickets.abs().sum()) == 0  # every ticket back at zero for the next launch
    two, _ = run(c, num_splits=num_splits)
    assert rel_err(got, two.double()) < TOL[dtype]
    again, _ = run(c, num_splits=num_splits, fold_combine=True)
    assert torch.equal(again, got)  # merged in split order: deterministic


@pytest.mark.parametrize("merge", [3, 4, 8])
def test_merge_block_of_the_class(merge):
    """``merge_splits``: the merge reduces over next_pow2(merge) splits whatever the live count,
    so a count below the class's largest gives the reference's values; below the live count,
    or above the workspace, it is refused."""
    from stepgraph.errors import ConfigError

    lens = [(53 * i) % 300 + 130 for i in range(5)]
    c = make_case(97 + merge, lens, n_heads=6, n_kv=2, hd=32)  # a group of 3: one padded head
    ref = paged_decode_reference(c.q.double(), c.k.double(), c.v.double(), c.bt, c.lens)
    got, ws = run(c, num_splits=3, fold_combine=True, merge_splits=merge)
    assert rel_err(got, ref) < TOL[torch.float32] and int(ws.tickets.abs().sum()) == 0
    for bad in (2, 9):  # one below the live count; one past the workspace's 8
        with pytest.raises(ConfigError, match="merge_splits"):
            run(c, num_splits=3, fold_combine=True, merge_splits=bad)


def test_fold_spec_is_registered_without_combine():
    assert FLASH_DECODE_FOLD_SPEC.main == FOLD_KERNEL_NAME
    assert FLASH_DECODE_FOLD_SPEC.combine is None
    assert DEFAULT_REGISTRY.by_main[FOLD_KERNEL_NAME] is FLASH_DECODE_FOLD_SPEC
    assert None not in DEFAULT_REGISTRY.by_combine


def test_exact_plan_retunes_folded_mains_grid_only():
    """Fake driver: graphs of folded mains (one shared workspace pointer, no combine nodes)
    plan without pairing, and ``fa_apply`` edits grid z alone, one push per main per step."""
    import random

    from stepgraph.graph_update import fa_apply, fa_plan, kernel_nodes
    from stepgraph.kernels.decode.splits import num_splits_for
    from tests.fake_driver import FakeDriver

    rng = random.Random(21)
    fd = FakeDriver()
    g = fd.new_graph()
    kern = fd.cuda.kernel(FOLD_KERNEL_NAME, [8, 8, 8, 8, 4, 4, 4, 8, 8])
    shared = rng.randrange(1, 2**40) * 256
    bs, n_kv, sms, max_t = 8, 8, 132, 4096
    bucket = num_splits_for(max_t, n_kv, bs, sms, 64)
    mains = []
    for _ in range(5):
        vals = [shared] + [rng.randrange(2**40) * 16 for _ in range(3)] + [0x3E000000, 64, 128]
        mains.append(fd.cuda.add_kernel_node(g, kern, vals + [0, 0], (bs, n_kv, bucket)))
    fd.chain(g, mains)
    plan = fa_plan(kernel_nodes(g, driver=fd), max_t_kv=max_t, num_sms=sms)
    assert len(plan.mains) == 5 and all(m.combine is None for m in plan.mains)
    ex = fd.cuda.instantiate(g)
    for t in (17, 600, 4096, 1):
        before = len(fd.cuda.pushes)
        pushed = fa_apply(plan, ex, t)
        assert len(fd.cuda.pushes) - before == pushed and pushed in (0, 5)
        ns = num_splits_for(t, n_kv, bs, sms, 64)
        assert all(fd.exec_grid(ex, m)[2] == min(ns, bucket) for m in mains)
