"""graph_update.flash and the split-kernel registry on the fake driver: pairing, retuning, no-op,
clamp, invalidation, both rules, user specs and every error path. Expected split counts are
computed here straight from the formulas, independently of flash.py."""

from __future__ import annotations

import ctypes
import math
import random
from dataclasses import dataclass

import pytest

from stepgraph.errors import ConfigError, GraphUpdateError
from stepgraph.graph_update import (
    FLASH_DECODE_SPEC,
    SplitKernelRegistry,
    SplitKernelSpec,
    fa_apply,
    fa_plan,
    kernel_nodes,
    register_split_kernel,
    unregister_split_kernel,
)
from stepgraph.graph_update.registry import DEFAULT_REGISTRY

from .fake_driver import FakeDriver

SMS = 132
# Driver-level signatures: 8 = pointer, 4 = int32/f32 (as Triton lays out our kernels).
MAIN_SIZES = [8, 8, 8, 8, 4, 4, 4, 8, 8]  # partial_o, lse, q, k, sm_scale, strides, 2 scratch
COMBINE_SIZES = [8, 4, 8, 8, 4, 4, 8, 8]  # partial_o, n_splits, lse, out, strides, 2 scratch
OTHER_SIZES = [8, 8, 4, 4, 8, 8]


def toy_split_keys(t_kv: int, n_kv_heads: int, bs: int, num_sms: int) -> int:
    """A ladder that is deliberately not monotone in ns and uses every argument."""
    level = min(6, (t_kv * n_kv_heads // (bs * num_sms)).bit_length() // 2)
    return 32 << level


def expected_ns(t_kv: int, n_kv: int, bs: int, bucket: int) -> int:
    return min(bucket, max(1, math.ceil(t_kv / toy_split_keys(t_kv, n_kv, bs, SMS))))


@dataclass
class Layer:
    main: int  # node ids
    combine: int
    ptr: int
    bs: int
    n_kv: int
    bucket: int


def build(
    rng,
    n_layers,
    *,
    shared_ptr=False,
    same_geometry=False,
    main_name="_split_kv_kernel",
    combine_name="_combine_kernel",
    fd=None,
    g=None,
):
    """A captured step: other kernels and non-kernel nodes around L main/combine pairs, chained in
    capture order, with the driver's node order shuffled."""
    fd = fd or FakeDriver()
    g = g if g is not None else fd.new_graph()
    k_main = fd.cuda.kernel(main_name, MAIN_SIZES)
    k_comb = fd.cuda.kernel(combine_name, COMBINE_SIZES)
    k_other = fd.cuda.kernel("matmul_kernel", OTHER_SIZES)
    order, layers = [], []
    shared = rng.randrange(1, 2**40) * 256
    geometry = (rng.randrange(1, 9), rng.choice([1, 2, 4, 8]), rng.randrange(1, 65))
    for _ in range(n_layers):
        bs, n_kv, bucket = (
            geometry
            if same_geometry
            else (rng.randrange(1, 9), rng.choice([1, 2, 4, 8]), rng.randrange(1, 65))
        )
        ptr = shared if shared_ptr else rng.randrange(1, 2**40) * 256
        for _ in range(rng.randrange(0, 3)):
            vals = [rng.randrange(2**40) * 16 for _ in range(2)] + [3, 4, 0, 0]
            order.append(fd.cuda.add_kernel_node(g, k_other, vals, (rng.randrange(1, 99), 1, 1)))
            if rng.random() < 0.3:
                order.append(fd.cuda.add_node(g, rng.choice(["MEMSET", "MEMCPY", "EMPTY"])))
        mv = [ptr] + [rng.randrange(2**40) * 16 for _ in range(3)] + [0x3E000000, 64, 128, 0, 0]
        m = fd.cuda.add_kernel_node(g, k_main, mv, (bs, n_kv, bucket))
        cv = [ptr, bucket] + [rng.randrange(2**40) * 16 for _ in range(2)] + [64, 8, 0, 0]
        c = fd.cuda.add_kernel_node(g, k_comb, cv, (bs, 4 * n_kv, 1))
        order += [m, c]
        layers.append(Layer(m, c, ptr, bs, n_kv, bucket))
    fd.chain(g, order)
    rng.shuffle(fd.cuda.graphs[g])
    return fd, g, layers


def exec_splits(fd, ex, layer):
    grid_z = fd.exec_grid(ex, layer.main)[2]
    n_splits = int.from_bytes(fd.exec_arg(ex, layer.combine, 1), "little", signed=True)
    return grid_z, n_splits


def check_exec(fd, ex, g, layers, t_kv, also_edited=()):
    fa = {n for lay in [*layers, *also_edited] for n in (lay.main, lay.combine)}
    captured = fd.cuda.instantiate(g)  # what the template says (it must stay untouched)
    for lay in layers:
        ns = expected_ns(t_kv, lay.n_kv, lay.bs, lay.bucket)
        assert exec_splits(fd, ex, lay) == (ns, ns)
        assert fd.exec_grid(ex, lay.main)[:2] == (lay.bs, lay.n_kv)
        for node, skip in ((lay.main, None), (lay.combine, 1)):
            cap = fd.cuda.execs[captured].state[node][1]
            now = fd.cuda.execs[ex].state[node][1]
            assert [a for i, a in enumerate(now) if i != skip] == [
                a for i, a in enumerate(cap) if i != skip
            ]
    for node, state in fd.cuda.execs[captured].state.items():
        if node not in fa:  # everything else replays as captured
            assert fd.cuda.execs[ex].state[node] == state


def test_pairs_by_pointer_and_retunes_every_layer_under_shuffles():
    rng = random.Random(10)
    for _ in range(15):
        fd, g, layers = build(rng, rng.randrange(1, 17))
        max_t = rng.randrange(1, 200_000)
        plan = fa_plan(kernel_nodes(g, driver=fd), max_t_kv=max_t, num_sms=SMS)
        pairs = {(int(m.main.handle), int(m.combine.handle)) for m in plan.mains}
        assert pairs == {(lay.main, lay.combine) for lay in layers}
        for m in plan.mains:
            lay = next(x for x in layers if x.main == int(m.main.handle))
            assert (m.bucket_splits, m.bs, m.n_kv_heads, m.ns) == (
                lay.bucket,
                lay.bs,
                lay.n_kv,
                None,
            )
        ex = fd.cuda.instantiate(g)
        applied = {lay.main: None for lay in layers}
        for _ in range(25):
            t = rng.randrange(1, max_t + 1)
            before = len(fd.cuda.pushes)
            pushed = fa_apply(plan, ex, t, split_keys=toy_split_keys)
            now = {lay.main: expected_ns(t, lay.n_kv, lay.bs, lay.bucket) for lay in layers}
            assert pushed == 2 * sum(now[k] != applied[k] for k in now)
            assert len(fd.cuda.pushes) - before == pushed
            assert {m.ns for m in plan.mains} == set(now.values())
            applied = now
            check_exec(fd, ex, g, layers, t)


def test_shared_workspace_pairs_in_graph_order():
    rng = random.Random(11)
    for _ in range(10):
        fd, g, layers = build(rng, rng.randrange(2, 17), shared_ptr=True)
        plan = fa_plan(kernel_nodes(g, driver=fd), max_t_kv=100_000, num_sms=SMS)
        pairs = [(int(m.main.handle), int(m.combine.handle)) for m in plan.mains]
        assert pairs == [(lay.main, lay.combine) for lay in layers]  # capture order
        ex = fd.cuda.instantiate(g)
        t = rng.randrange(1, 100_001)
        fa_apply(plan, ex, t, split_keys=toy_split_keys)
        check_exec(fd, ex, g, layers, t)


def test_shared_pointer_that_does_not_alternate_is_refused():
    rng = random.Random(12)
    fd, g, layers = build(rng, 3, shared_ptr=True)
    # reorder the capture so two mains run back to back: main0 main1 comb0 comb1 main2 comb2
    chain = [
        layers[0].main,
        layers[1].main,
        layers[0].combine,
        layers[1].combine,
        layers[2].main,
        layers[2].combine,
    ]
    fd.cuda.edges[g] = list(zip(chain, chain[1:]))
    with pytest.raises(GraphUpdateError, match=r"_split_kv_kernel: argument 0 .*do not alternate"):
        fa_plan(kernel_nodes(g, driver=fd), max_t_kv=1000, num_sms=SMS)


def test_noop_when_count_has_not_stepped_and_clamp_to_bucket():
    rng = random.Random(13)
    fd, g, layers = build(rng, 16, same_geometry=True)
    lay = layers[0]
    plan = fa_plan(kernel_nodes(g, driver=fd), max_t_kv=1 << 17, num_sms=SMS)
    ex = fd.cuda.instantiate(g)
    assert fa_apply(plan, ex, 5000, split_keys=toy_split_keys) == 32
    ts = list(range(1, 1 << 17, 37))
    prev = expected_ns(5000, lay.n_kv, lay.bs, lay.bucket)
    for t in ts:
        ns = expected_ns(t, lay.n_kv, lay.bs, lay.bucket)
        assert fa_apply(plan, ex, t, split_keys=toy_split_keys) == (0 if ns == prev else 32)
        assert fa_apply(plan, ex, t, split_keys=toy_split_keys) == 0  # same t again
        prev = ns
    # the clamp: a ladder asking for more splits than the graph was captured with
    assert fa_apply(plan, ex, 1 << 17, split_keys=lambda *a: 1) in (0, 32)
    assert {m.ns for m in plan.mains} == {lay.bucket}
    assert exec_splits(fd, ex, lay) == (lay.bucket, lay.bucket)


def test_t_kv_out_of_range_and_invalidate_and_new_exec():
    rng = random.Random(14)
    fd, g, layers = build(rng, 4, same_geometry=True)
    plan = fa_plan(kernel_nodes(g, driver=fd), max_t_kv=4096, num_sms=SMS)
    ex = fd.cuda.instantiate(g)
    for bad in (0, -3, 4097):
        with pytest.raises(GraphUpdateError, match=rf"t_kv = {bad} is outside \[1, 4096\]"):
            fa_apply(plan, ex, bad, split_keys=toy_split_keys)
    assert fa_apply(plan, ex, 4096, split_keys=toy_split_keys) == 8
    assert fa_apply(plan, ex, 4096, split_keys=toy_split_keys) == 0
    plan.invalidate()
    assert all(m.ns is None for m in plan.mains)
    assert fa_apply(plan, ex, 4096, split_keys=toy_split_keys) == 8
    # re-instantiation: a fresh exec is the captured graph; the plan notices the new handle
    ex2 = fd.cuda.instantiate(g, old_exec=ex)
    for lay in layers:
        assert exec_splits(fd, ex2, lay) == (lay.bucket, lay.bucket)
    assert fa_apply(plan, ex2, 4096, split_keys=toy_split_keys) == 8
    check_exec(fd, ex2, g, layers, 4096)
    # a push failing half way leaves the plan invalid, so the next apply pushes everything
    fd.cuda.fail_push_after = 3
    with pytest.raises(GraphUpdateError, match="cuGraphExecKernelNodeSetParams failed"):
        fa_apply(plan, ex2, 1, split_keys=lambda *a: 1)
    assert fa_apply(plan, ex2, 1, split_keys=lambda *a: 1) == 8
    assert all(exec_splits(fd, ex2, lay) == (1, 1) for lay in layers)


def test_self_limiting_user_kernel_registered_next_to_ours():
    rng = random.Random(15)
    block_n = rng.choice([16, 64, 128])
    spec = SplitKernelSpec(
        main="my_main",
        combine="my_combine",
        main_ptr_arg=0,
        combine_ptr_arg=0,
        combine_splits_arg=1,
        split_axis=2,
        rule="self_limiting",
        main_splits_arg=5,
        block_n=block_n,
    )
    register_split_kernel(spec)
    try:
        fd, g, ours = build(rng, 3)
        # the user kernel: split count is also argument 5 of the main (an int32 stride slot)
        fd, g, theirs = build(rng, 3, main_name="my_main", combine_name="my_combine", fd=fd, g=g)
        for lay in theirs:  # as captured, the main's count argument equals its grid
            node = fd.cuda.nodes[lay.main]
            off = fd.cuda.kernels[node.kernel_id].layout[5][0]
            fd.write_bytes(ctypes.addressof(node.args) + off, lay.bucket.to_bytes(4, "little"))
        nodes = kernel_nodes(g, driver=fd)
        plan = fa_plan(nodes, max_t_kv=50_000, num_sms=SMS)
        assert len(plan.mains) == 6
        ex = fd.cuda.instantiate(g)
        edges = [k * block_n + d for k in range(70) for d in (0, 1) if 1 <= k * block_n + d]
        ts = rng.sample(range(1, 50_001), 30) + edges + edges[::-1]
        for t in ts:
            fa_apply(plan, ex, t, split_keys=toy_split_keys)
            check_exec(fd, ex, g, ours, t, also_edited=theirs)
            for lay in theirs:
                ns = min(lay.bucket, math.ceil(t / block_n))
                assert exec_splits(fd, ex, lay) == (ns, ns)
                assert int.from_bytes(fd.exec_arg(ex, lay.main, 5), "little") == ns
    finally:
        unregister_split_kernel("my_main")
    assert "my_main" not in DEFAULT_REGISTRY.by_main


def test_empty_plan_is_allowed():
    rng = random.Random(16)
    fd, g, _ = build(rng, 2, main_name="not_ours", combine_name="not_ours_either")
    plan = fa_plan(kernel_nodes(g, driver=fd), max_t_kv=100, num_sms=SMS)
    assert plan.mains == []
    assert fa_apply(plan, fd.cuda.instantiate(g), 50) == 0


def _single(
    sizes_main=MAIN_SIZES,
    sizes_comb=COMBINE_SIZES,
    n_main=1,
    n_comb=1,
    ptrs=None,
    count=8,
    bucket=8,
):
    fd = FakeDriver()
    g = fd.new_graph()
    km = fd.cuda.kernel("_split_kv_kernel", list(sizes_main))
    kc = fd.cuda.kernel("_combine_kernel", list(sizes_comb))
    ptrs = ptrs or [0x1000] * max(n_main, n_comb)
    order = []
    for i in range(n_main):
        order.append(
            fd.cuda.add_kernel_node(g, km, [ptrs[i]] + [0] * (len(sizes_main) - 1), (1, 8, bucket))
        )
    for i in range(n_comb):
        vals = ([ptrs[i], count] + [0] * len(sizes_comb))[: len(sizes_comb)]
        order.append(fd.cuda.add_kernel_node(g, kc, vals, (1, 32, 1)))
    fd.chain(g, order)
    return kernel_nodes(g, driver=fd)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(n_comb=0), r"_split_kv_kernel: argument 0 .*0x1000 has no combine"),
        (dict(n_main=0), r"_combine_kernel: argument 0 .*0x1000 has no main"),
        (dict(n_comb=2), r"_combine_kernel: argument 0 .*shared by 1 _split_kv_kernel and 2"),
        (dict(n_main=2), r"_split_kv_kernel: argument 0 .*shared by 2 _split_kv_kernel and 1"),
        (dict(n_main=2, n_comb=2, ptrs=[0x1000, 0x1000]), "do not alternate"),
        (
            dict(sizes_main=[4] + MAIN_SIZES[1:]),
            r"_split_kv_kernel: argument 0 \(pairing pointer\) is 4 bytes",
        ),
        (
            dict(sizes_comb=[8, 8] + COMBINE_SIZES[2:]),
            r"_combine_kernel: argument 1 \(split count, int32\) is 8 bytes",
        ),
        (dict(sizes_comb=[8]), r"_combine_kernel: argument 1 .*does not exist"),
        (
            dict(count=4, bucket=8),
            r"_combine_kernel: argument 1 \(split count\) is 4 at capture.*8",
        ),
    ],
)
def test_plan_errors_name_kernel_argument_and_finding(kwargs, match):
    with pytest.raises(GraphUpdateError, match=match):
        fa_plan(_single(**kwargs), max_t_kv=1000, num_sms=SMS)


def test_distinct_pointers_pair_regardless_of_count_order():
    nodes = _single(n_main=2, n_comb=2, ptrs=[0x1000, 0x2000])
    plan = fa_plan(nodes[::-1], max_t_kv=1000, num_sms=SMS)
    assert [(m.main.order, m.combine.order) for m in plan.mains] == [(0, 2), (1, 3)]
    with pytest.raises(ConfigError, match="max_t_kv >= 1"):
        fa_plan(nodes, max_t_kv=0, num_sms=SMS)


def test_spec_validation_and_registry_conflicts():
    base = dict(
        main="a", combine="b", main_ptr_arg=0, combine_ptr_arg=0, combine_splits_arg=1, split_axis=2
    )
    for bad, match in [
        (dict(rule="other"), "rule"),
        (dict(combine="a"), "must differ"),
        (dict(split_axis=3), "split_axis"),
        (dict(rule="self_limiting"), "block_n"),
        (dict(bs_axis=2), "0, 1, 2 in some order"),
        (dict(combine_splits_arg=0), "share an argument"),
        (dict(main_ptr_arg=-1), ">= 0"),
    ]:
        with pytest.raises(ConfigError, match=match):
            SplitKernelSpec(**{**base, **bad})
    reg = SplitKernelRegistry([SplitKernelSpec(**base)])
    reg.register(SplitKernelSpec(**base))  # the same spec again: fine
    with pytest.raises(ConfigError, match="already registered"):
        reg.register(SplitKernelSpec(**{**base, "combine": "c"}))
    with pytest.raises(ConfigError, match="already registered"):
        reg.register(SplitKernelSpec(**{**base, "main": "b", "combine": "d"}))
    reg.unregister("a")
    assert len(reg) == 0 and not reg.by_combine


def test_default_spec_matches_the_kernel_module_and_its_ladder():
    fd_mod = pytest.importorskip("stepgraph.kernels.decode.split_kv")
    splits = pytest.importorskip("stepgraph.kernels.decode.splits")
    # the names the driver reports are the Triton functions' own names
    assert fd_mod.MAIN_KERNEL_NAME == fd_mod._split_kv_kernel.fn.__name__
    assert fd_mod.COMBINE_KERNEL_NAME == fd_mod._combine_kernel.fn.__name__
    assert FLASH_DECODE_SPEC.main == fd_mod.MAIN_KERNEL_NAME
    assert FLASH_DECODE_SPEC.combine == fd_mod.COMBINE_KERNEL_NAME
    assert FLASH_DECODE_SPEC.main_ptr_arg == fd_mod.MAIN_PARTIAL_O_ARG
    assert FLASH_DECODE_SPEC.combine_ptr_arg == fd_mod.COMBINE_PARTIAL_O_ARG
    assert FLASH_DECODE_SPEC.combine_splits_arg == fd_mod.COMBINE_N_SPLITS_ARG
    assert (FLASH_DECODE_SPEC.split_axis, FLASH_DECODE_SPEC.rule) == (2, "ladder")
    # fa_apply's default ladder is the eager one: same counts as num_splits_for
    rng = random.Random(17)
    fd, g, layers = build(rng, 8)
    plan = fa_plan(kernel_nodes(g, driver=fd), max_t_kv=1 << 17, num_sms=SMS)
    ex = fd.cuda.instantiate(g)
    for t in [1, 2, 127, 128, 129, *rng.sample(range(1, 1 << 17), 40), 1 << 17]:
        fa_apply(plan, ex, t)
        for lay in layers:
            ns = splits.num_splits_for(t, lay.n_kv, lay.bs, SMS, lay.bucket)
            assert exec_splits(fd, ex, lay) == (ns, ns)


def test_without_edges_distinct_pointers_still_pair_and_shared_ones_are_refused():
    rng = random.Random(18)
    for shared in (False, True):
        fd, g, layers = build(rng, 4, shared_ptr=shared)
        fd.cuda.edges.pop(g)  # cuGraphGetEdges now fails: graph order unknown
        nodes = kernel_nodes(g, driver=fd)
        assert all(n.order is None for n in nodes)
        if shared:
            with pytest.raises(GraphUpdateError, match="graph order is unknown"):
                fa_plan(nodes, max_t_kv=1000, num_sms=SMS)
        else:
            assert len(fa_plan(nodes, max_t_kv=1000, num_sms=SMS).mains) == 4


def test_monotone_ladder_table_agrees_with_direct_evaluation():
    from stepgraph.kernels.decode.splits import monotone_steps

    rng = random.Random(19)
    for _ in range(20):
        cuts = sorted(rng.sample(range(2, 5000), rng.randrange(0, 8)))
        f = lambda t, cuts=cuts: 1 + sum(t >= c for c in cuts)  # noqa: E731
        starts, values = monotone_steps(f, 5000)
        assert starts == [1, *sorted(set(cuts))] and values == list(range(1, len(starts) + 1))

    def ladder(t, n_kv, bs, sms):  # keys fixed per (n_kv, bs): ns = ceil(t / keys) never drops
        return 16 * n_kv * bs + sms % 7

    marked = lambda *a: ladder(*a)  # noqa: E731
    marked.monotone = True
    fd, g, layers = build(rng, 6)
    plan = fa_plan(kernel_nodes(g, driver=fd), max_t_kv=20_000, num_sms=SMS)
    ex = fd.cuda.instantiate(g)
    for t in [1, 20_000, *rng.sample(range(1, 20_001), 200)]:
        counts = []
        for fn in (ladder, marked):
            fa_apply(plan, ex, t, split_keys=fn)
            counts.append([exec_splits(fd, ex, lay) for lay in layers])
        want = [
            min(lay.bucket, max(1, math.ceil(t / ladder(t, lay.n_kv, lay.bs, SMS))))
            for lay in layers
        ]
        assert counts[0] == counts[1] == [(n, n) for n in want]


def test_switching_ladders_recomputes_even_inside_a_cached_interval():
    rng = random.Random(20)
    fd, g, layers = build(rng, 3, same_geometry=True)
    plan = fa_plan(kernel_nodes(g, driver=fd), max_t_kv=10_000, num_sms=SMS)
    ex = fd.cuda.instantiate(g)
    one = lambda *a: 1  # noqa: E731  (as many splits as keys: always the bucket)
    one.monotone = True
    big = lambda *a: 10**9  # noqa: E731  (one split)
    big.monotone = True
    for t in rng.sample(range(1, 10_001), 20):
        for fn, want in ((one, min(layers[0].bucket, t)), (big, 1)):
            fa_apply(plan, ex, t, split_keys=fn)
            assert all(exec_splits(fd, ex, lay) == (want, want) for lay in layers)


def test_a_two_argument_ladder_retunes_like_its_four_argument_form():
    """A ladder of signature ``split_keys(t_kv, n_kv)``: fa_apply takes it as is."""
    rng = random.Random(19)
    fd, g, layers = build(rng, 6)
    two = lambda t, n_kv: max(64, t // (2 * n_kv))  # noqa: E731
    plan = fa_plan(kernel_nodes(g, driver=fd), max_t_kv=1 << 16, num_sms=SMS)
    ex = fd.cuda.instantiate(g)
    ts = [1, 64, 65, 1000, *rng.sample(range(1, 1 << 16), 30), 1 << 16, 3]
    for t in ts:
        fa_apply(plan, ex, t, split_keys=two)
        for lay in layers:
            want = max(1, min(lay.bucket, math.ceil(t / two(t, lay.n_kv))))
            assert exec_splits(fd, ex, lay) == (want, want), (t, lay)
    with pytest.raises(TypeError):
        fa_apply(plan, ex, 5, split_keys=lambda t: 64)  # neither signature


def test_the_wide_head_ladder_retunes_as_the_backend_splits():
    """Exact mode over a model with heads wider than 64 retunes with the backend's ladder
    (``default_exec_updater`` takes ``attn_backend.split_keys``): the same counts as
    ``PagedAttentionBackend.splits_for``, which the default ladder would not give (200 keys at
    one row: 2 splits against 1)."""
    from types import SimpleNamespace

    from stepgraph.graph_update.exec_updater import default_exec_updater
    from stepgraph.kernels.decode.splits import fa_split_keys, ladder_for, num_splits_for
    from stepgraph.model.attention import PagedAttentionBackend

    backend = PagedAttentionBackend(
        None,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        device="cpu",
        max_context_len=8192,
        use_kernel=True,
    )
    backend.num_sms = SMS
    assert backend.split_keys is ladder_for(128) is not fa_split_keys
    runner = SimpleNamespace(device="cpu", max_context_len=8192, attn_backend=backend)
    updater = default_exec_updater(runner)
    assert updater.split_keys is backend.split_keys
    plain = SimpleNamespace(device="cpu", max_context_len=64)  # no attn_backend: the default
    assert default_exec_updater(plain).split_keys is None
    narrow = PagedAttentionBackend(
        None,
        num_heads=32,
        num_kv_heads=8,
        head_dim=64,
        device="cpu",
        max_context_len=64,
        use_kernel=True,
    )
    assert narrow.split_keys is fa_split_keys

    rng = random.Random(23)
    fd, g, layers = build(rng, 5)
    plan = fa_plan(kernel_nodes(g, driver=fd), max_t_kv=8192, num_sms=SMS)
    ex = fd.cuda.instantiate(g)
    differs = False
    for t in [1, 127, 128, 129, 200, 255, 256, 8192, *rng.sample(range(1, 8193), 100)]:
        fa_apply(plan, ex, t, split_keys=updater.split_keys)
        for lay in layers:
            want = min(lay.bucket, backend.splits_for(t, lay.bs)) if lay.n_kv == 8 else None
            got = exec_splits(fd, ex, lay)
            assert (
                got[0]
                == got[1]
                == num_splits_for(t, lay.n_kv, lay.bs, SMS, lay.bucket, head_dim=128)
            )
            if want is not None:
                assert got[0] == want
            differs |= got[0] != num_splits_for(t, lay.n_kv, lay.bs, SMS, lay.bucket)
    assert differs  # the wide ladder took other counts than the default somewhere
