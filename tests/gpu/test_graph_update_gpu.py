"""graph_update on a real GPU: capture L layers of the split-KV decode kernel (with other kernels
between them), retune the exec per token with fa_apply, and check every replay against eager
(bit for bit) and the float64 reference; re-instantiation; and a self-limiting user kernel.

Skipped without a GPU (conftest adds the ``cuda`` marker to everything under tests/gpu/).
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from stepgraph.graph_update import (
    SplitKernelRegistry,
    SplitKernelSpec,
    fa_apply,
    fa_plan,
    kernel_nodes,
    node_census,
    read_ptr_arg,
)

BS, N_HEADS, N_KV, HEAD_DIM, PAGE = 2, 8, 2, 64, 16
MAX_CTX = 4096
LAYERS = 4


def _num_sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count


def _capture(fn, warmup: int = 2) -> torch.cuda.CUDAGraph:
    """Warm up on a side stream (compiles every Triton variant), then capture and instantiate."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph(keep_graph=True)  # keep the template: its nodes get edited
    with torch.cuda.graph(graph, stream=stream):
        fn()
    graph.instantiate()
    torch.cuda.synchronize()
    return graph


class _Step:
    """L decode-attention layers of static buffers, a matmul and an add between layers."""

    def __init__(self, shared_workspace: bool, seed: int = 0) -> None:
        from stepgraph.kernels.decode.flash_decode import DecodeWorkspace
        from stepgraph.kernels.decode.splits import num_splits_for

        torch.manual_seed(seed)
        dev, dt = "cuda", torch.bfloat16
        self.sms = _num_sms()
        self.max_splits = 64
        pages = MAX_CTX // PAGE
        num_pages = BS * pages + 1
        self.k = torch.randn(num_pages, PAGE, N_KV, HEAD_DIM, device=dev, dtype=dt)
        self.v = torch.randn_like(self.k)
        perm = torch.randperm(num_pages - 1)[: BS * pages] + 1  # page 0 stays unused
        self.block_table = perm.view(BS, pages).to(device=dev, dtype=torch.int32)
        self.seq_lens = torch.full((BS,), MAX_CTX, device=dev, dtype=torch.int32)
        self.qs = [torch.randn(BS, N_HEADS, HEAD_DIM, device=dev, dtype=dt) for _ in range(LAYERS)]
        self.outs = [torch.empty_like(q) for q in self.qs]
        n_ws = 1 if shared_workspace else LAYERS
        self.ws = [
            DecodeWorkspace.allocate(BS, N_HEADS, HEAD_DIM, self.max_splits, dev)
            for _ in range(n_ws)
        ]
        self.a = torch.randn(64, 64, device=dev, dtype=dt)
        self.mm = [torch.empty(64, 64, device=dev, dtype=dt) for _ in range(LAYERS)]
        self.bucket = num_splits_for(MAX_CTX, N_KV, BS, self.sms, self.max_splits)

    def run(self, num_splits: int | None = None, max_seq_len: int | None = None) -> None:
        from stepgraph.kernels.decode.flash_decode import flash_decode

        for layer in range(LAYERS):
            flash_decode(
                self.qs[layer],
                self.k,
                self.v,
                self.block_table,
                self.seq_lens,
                num_splits=num_splits,
                max_seq_len=max_seq_len,
                workspace=self.ws[layer % len(self.ws)],
                out=self.outs[layer],
                num_sms=self.sms,
            )
            torch.mm(self.a, self.a, out=self.mm[layer])
            self.mm[layer].add_(1.0)

    def set_lens(self, t_kv: int, rng: random.Random) -> None:
        lens = [t_kv] + [rng.randrange(1, t_kv + 1) for _ in range(BS - 1)]
        rng.shuffle(lens)
        self.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))

    def eager(self, t_kv: int) -> list[torch.Tensor]:
        """Eager exact: the ladder at the live length, on the same buffers."""
        self.run(max_seq_len=t_kv)
        torch.cuda.synchronize()
        return [o.clone() for o in self.outs]

    def check(self, graph_outs: list[torch.Tensor], t_kv: int) -> None:
        from stepgraph.kernels.decode.reference import paged_decode_reference

        for layer, out in enumerate(graph_outs):
            ref = paged_decode_reference(
                self.qs[layer],
                self.k,
                self.v,
                self.block_table,
                self.seq_lens,
                compute_dtype=torch.float64,
            )
            err = (out.double() - ref).abs().max().item()
            assert err < 2e-2, f"layer {layer}, t_kv={t_kv}: max error {err} vs float64 reference"


def _sweep_points(step: _Step, rng: random.Random) -> list[int]:
    from stepgraph.kernels.decode.splits import ladder_steps

    steps = ladder_steps(N_KV, BS, step.sms, step.max_splits, t_max=MAX_CTX)
    assert len(steps) > 2, steps  # the sweep must cross several ladder steps
    points = {1, 2, MAX_CTX}
    for t, _ in steps:
        points.update(x for x in (t - 1, t, t + 1) if 1 <= x <= MAX_CTX)
    points.update(rng.sample(range(1, MAX_CTX + 1), 10))
    return sorted(points)


@pytest.mark.parametrize("shared_workspace", [False, True])
def test_exact_geometry_matches_eager_at_every_ladder_step(shared_workspace):
    from stepgraph.kernels.decode.splits import num_splits_for

    rng = random.Random(0)
    step = _Step(shared_workspace)
    graph = _capture(lambda: step.run(num_splits=step.bucket))

    nodes = kernel_nodes(graph.raw_cuda_graph())
    census = node_census(graph.raw_cuda_graph())
    assert census["kernel"] == len(nodes) >= 3 * LAYERS
    plan = fa_plan(nodes, max_t_kv=MAX_CTX, num_sms=step.sms)
    assert len(plan.mains) == LAYERS
    assert all(
        m.bucket_splits == step.bucket and (m.bs, m.n_kv_heads) == (BS, N_KV) for m in plan.mains
    )
    ptrs = {read_ptr_arg(m.main, 0) for m in plan.mains}
    assert ptrs == {w.partial_o.data_ptr() for w in step.ws}
    if not shared_workspace:  # pairing by pointer: each main with the combine of its layer
        assert all(read_ptr_arg(m.combine, 0) == read_ptr_arg(m.main, 0) for m in plan.mains)

    points = _sweep_points(step, rng)
    for t in points + points[::-1][1:]:  # up the ladder, then back down on an edited graph
        step.set_lens(t, rng)
        expected = step.eager(t)
        ns = num_splits_for(t, N_KV, BS, step.sms, step.max_splits)
        before = {m.ns for m in plan.mains}
        pushed = fa_apply(plan, graph.raw_cuda_graph_exec(), t)
        assert pushed == (0 if before == {ns} else 2 * LAYERS)
        assert {m.ns for m in plan.mains} == {ns}
        for o in step.outs:
            o.fill_(float("nan"))  # the replay must rewrite every output
        graph.replay()
        torch.cuda.synchronize()
        for layer in range(LAYERS):
            assert torch.equal(step.outs[layer], expected[layer]), f"layer {layer}, t_kv={t}"
        step.check(step.outs, t)

    # Re-instantiation builds a fresh exec from the untouched template: captured geometry, still
    # correct (fixed geometry), until invalidate + apply pushes every node again.
    t = rng.randrange(1, 300)
    step.set_lens(t, rng)
    expected = step.eager(t)
    graph.instantiate()
    graph.replay()
    torch.cuda.synchronize()
    step.check(step.outs, t)
    plan.invalidate()
    assert fa_apply(plan, graph.raw_cuda_graph_exec(), t) == 2 * LAYERS
    graph.replay()
    torch.cuda.synchronize()
    for layer in range(LAYERS):
        assert torch.equal(step.outs[layer], expected[layer])


# -- a self-limiting split kernel of our own --------------------------------------------------
def _self_limiting_kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def sl_main(partial_ptr, x_ptr, t_ptr, BLOCK_N: tl.constexpr):
        # Split s of ns = min(grid.y, ceil(t / BLOCK_N)) sums its share of x[:t]; the rest exit.
        split = tl.program_id(1)
        t = tl.load(t_ptr)
        n_blocks = tl.cdiv(t, BLOCK_N)
        ns = tl.minimum(tl.num_programs(1), n_blocks)
        if split < ns:
            per = tl.cdiv(n_blocks, ns)
            acc = tl.zeros([BLOCK_N], dtype=tl.float32)
            for b in range(split * per, tl.minimum((split + 1) * per, n_blocks)):
                offs = b * BLOCK_N + tl.arange(0, BLOCK_N)
                acc += tl.load(x_ptr + offs, mask=offs < t, other=0.0)
            tl.store(partial_ptr + split, tl.sum(acc))

    @triton.jit(do_not_specialize=["n_splits"])
    def sl_combine(
        partial_ptr, n_splits, t_ptr, out_ptr, BLOCK_N: tl.constexpr, SPLITS_PAD: tl.constexpr
    ):
        ns = tl.minimum(n_splits, tl.cdiv(tl.load(t_ptr), BLOCK_N))
        offs = tl.arange(0, SPLITS_PAD)
        tl.store(out_ptr, tl.sum(tl.load(partial_ptr + offs, mask=offs < ns, other=0.0)))

    return sl_main, sl_combine


def test_self_limiting_user_kernel():
    block_n, bucket, max_t, layers = 128, 32, 4096, 3
    sl_main, sl_combine = _self_limiting_kernels()
    spec = SplitKernelSpec(
        main="sl_main",
        combine="sl_combine",
        main_ptr_arg=0,
        combine_ptr_arg=0,
        combine_splits_arg=1,
        split_axis=1,
        rule="self_limiting",
        block_n=block_n,
    )
    registry = SplitKernelRegistry([spec])
    dev = "cuda"
    x = torch.randn(layers, max_t, device=dev, dtype=torch.float32)
    t_dev = torch.full((1,), max_t, device=dev, dtype=torch.int32)
    partials = [torch.zeros(bucket, device=dev) for _ in range(layers)]
    outs = [torch.zeros(1, device=dev) for _ in range(layers)]
    other = torch.zeros(256, device=dev)

    def step():
        for i in range(layers):
            sl_main[(1, bucket)](partials[i], x[i], t_dev, BLOCK_N=block_n)
            other.mul_(0.5)
            sl_combine[(1,)](
                partials[i], bucket, t_dev, outs[i], BLOCK_N=block_n, SPLITS_PAD=bucket
            )

    graph = _capture(step)
    plan = fa_plan(
        kernel_nodes(graph.raw_cuda_graph()), max_t_kv=max_t, num_sms=_num_sms(), registry=registry
    )
    assert len(plan.mains) == layers
    rng = random.Random(1)
    ts = sorted(set(rng.sample(range(1, max_t + 1), 20)) | {1, block_n, block_n + 1, max_t})
    for t in ts + ts[::-1]:
        t_dev.fill_(t)
        fa_apply(plan, graph.raw_cuda_graph_exec(), t)
        ns = min(bucket, math.ceil(t / block_n))
        assert [m.ns for m in plan.mains] == [ns] * layers, (t, [m.ns for m in plan.mains])
        assert [m.main.grid[1] for m in plan.mains] == [ns] * layers, (
            t,
            ns,
            [m.main.grid for m in plan.mains],
        )
        for o in outs:
            o.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for i in range(layers):
            ref = x[i, :t].double().sum().item()
            assert abs(outs[i].item() - ref) < 1e-3 * math.sqrt(t) + 1e-4, (i, t)


# -- a split kernel that trusts its launch geometry: a missing push shows ---------------------
def _non_clamping_kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def nc_main(partial_ptr, x_ptr, t_ptr, geom_ptr, BLOCK_N: tl.constexpr):
        # No clamp of its own: ns = grid.y as launched (or as pushed into the exec); split s
        # sums blocks [s * per, (s + 1) * per) of x[:t], an empty split writes 0.
        split = tl.program_id(1)
        ns = tl.num_programs(1)
        t = tl.load(t_ptr)
        n_blocks = tl.cdiv(t, BLOCK_N)
        per = tl.cdiv(n_blocks, ns)
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for b in range(split * per, tl.minimum((split + 1) * per, n_blocks)):
            offs = b * BLOCK_N + tl.arange(0, BLOCK_N)
            acc += tl.load(x_ptr + offs, mask=offs < t, other=0.0)
        tl.store(partial_ptr + split, tl.sum(acc))
        if split == 0:
            tl.store(geom_ptr, ns)  # the split count this launch really ran

    @triton.jit(do_not_specialize=["n_splits"])
    def nc_combine(partial_ptr, n_splits, out_ptr, geom_ptr, SPLITS_PAD: tl.constexpr):
        # No clamp either: sums exactly n_splits partials (NaN-poisoned past what main wrote)
        offs = tl.arange(0, SPLITS_PAD)
        tl.store(out_ptr, tl.sum(tl.load(partial_ptr + offs, mask=offs < n_splits, other=0.0)))
        tl.store(geom_ptr + 1, n_splits)

    return nc_main, nc_combine


def test_user_kernel_without_its_own_clamp_needs_every_push():
    """The self-limiting kernel above would hide a missing push (it clamps itself). These read
    their split count from the grid and the argument only, and record both: every replay must
    run exactly ``min(bucket, ceil(t / block_n))`` splits in both kernels, and sum right."""
    block_n, bucket, max_t, layers = 128, 32, 4096, 3
    nc_main, nc_combine = _non_clamping_kernels()
    spec = SplitKernelSpec(
        main="nc_main",
        combine="nc_combine",
        main_ptr_arg=0,
        combine_ptr_arg=0,
        combine_splits_arg=1,
        split_axis=1,
        rule="self_limiting",
        block_n=block_n,
    )
    registry = SplitKernelRegistry([spec])
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(2)
    x = torch.randn(layers, max_t, device=dev, dtype=torch.float32, generator=g)
    t_dev = torch.full((1,), max_t, device=dev, dtype=torch.int32)
    partials = [torch.zeros(bucket, device=dev) for _ in range(layers)]
    outs = [torch.zeros(1, device=dev) for _ in range(layers)]
    geoms = [torch.zeros(2, device=dev, dtype=torch.int32) for _ in range(layers)]
    other = torch.zeros(256, device=dev)

    def step():
        for i in range(layers):
            nc_main[(1, bucket)](partials[i], x[i], t_dev, geoms[i], BLOCK_N=block_n)
            other.mul_(0.5)
            nc_combine[(1,)](partials[i], bucket, outs[i], geoms[i], SPLITS_PAD=bucket)

    def replay(t: int) -> list[list[int]]:
        t_dev.fill_(t)
        for p, o, gm in zip(partials, outs, geoms):
            p.fill_(float("nan"))  # a combine reading past what main wrote gets NaN
            o.fill_(float("nan"))
            gm.fill_(-1)
        graph.replay()
        torch.cuda.synchronize()
        return [gm.tolist() for gm in geoms]

    graph = _capture(step)
    plan = fa_plan(
        kernel_nodes(graph.raw_cuda_graph()), max_t_kv=max_t, num_sms=_num_sms(), registry=registry
    )
    assert len(plan.mains) == layers
    # The control: without a push the exec runs the captured geometry, which this test sees.
    assert replay(1) == [[bucket, bucket]] * layers
    rng = random.Random(3)
    edges = [k * block_n + d for k in range(1, bucket + 1) for d in (-1, 0, 1)]
    ts = sorted({1, max_t, *rng.sample(range(1, max_t + 1), 12), *edges} & set(range(1, max_t + 1)))
    for t in ts + ts[::-1]:
        fa_apply(plan, graph.raw_cuda_graph_exec(), t)
        ns = min(bucket, math.ceil(t / block_n))
        assert replay(t) == [[ns, ns]] * layers, f"t={t}: expected {ns} splits in both kernels"
        for i in range(layers):
            ref = x[i, :t].double().sum().item()
            assert abs(outs[i].item() - ref) < 1e-3 * math.sqrt(t) + 1e-4, (i, t, ns)
    # A fresh exec forgets every push; after invalidate, apply pushes all of them again.
    graph.instantiate()
    assert replay(200) == [[bucket, bucket]] * layers
    plan.invalidate()
    assert fa_apply(plan, graph.raw_cuda_graph_exec(), 200) == 2 * layers
    assert replay(200) == [[2, 2]] * layers
