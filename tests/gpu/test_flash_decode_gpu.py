"""Split-KV flash decode on a real GPU: bf16 at realistic sizes against a float64 reference,
inside a captured CUDA graph with seq_lens edited in place, the ladder against explicit splits,
and the driver-level argument positions the graph-update code relies on.

Nothing touches CUDA at import time: without a GPU the module imports and every test skips.
"""

from __future__ import annotations

import importlib
import itertools

import pytest
import torch

from stepgraph.kernels.decode.reference import paged_decode_reference
from stepgraph.kernels.decode.splits import num_splits_for

fd = importlib.import_module("stepgraph.kernels.decode.flash_decode")
sweep = importlib.import_module("benchmarks.flash_decode_sweep")  # its VARIANTS; no CUDA at import

DEV = "cuda"


def num_sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count


REL_TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}


def make_case(seed, lens, n_heads, n_kv, hd, ps, dtype=torch.bfloat16, spare_pages=2):
    """Random paged caches; unused block-table entries and slots past each length are NaN."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    bs = len(lens)
    used = [-(-n // ps) for n in lens]
    max_pages = max(max(used), 1) + spare_pages
    n_pages = sum(used) + 1
    k = torch.randn(n_pages, ps, n_kv, hd, generator=g, device=DEV).to(dtype)
    v = torch.randn(n_pages, ps, n_kv, hd, generator=g, device=DEV).to(dtype)
    nan_page = n_pages - 1
    k[nan_page] = float("nan")
    v[nan_page] = float("nan")
    perm = torch.randperm(n_pages - 1, generator=g, device=DEV).to(torch.int32)
    bt = torch.full((bs, max_pages), nan_page, dtype=torch.int32, device=DEV)
    first = 0
    for b, n in enumerate(lens):
        pages = perm[first : first + used[b]]
        first += used[b]
        bt[b, : used[b]] = pages
        if n % ps:
            k[pages[-1], n % ps :] = float("nan")
            v[pages[-1], n % ps :] = float("nan")
    q = torch.randn(bs, n_heads, hd, generator=g, device=DEV).to(dtype)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=DEV)
    return q, k, v, bt, lens_t


def poisoned(bs, n_heads, hd, max_splits, dtype):
    ws = fd.DecodeWorkspace.allocate(bs, n_heads, hd, max_splits, DEV)
    ws.partial_o.fill_(float("nan"))
    ws.partial_lse.fill_(float("nan"))
    return ws, torch.full((bs, n_heads, hd), float("nan"), dtype=dtype, device=DEV)


def rel_err(got, ref):
    return ((got.double() - ref).abs().max() / ref.abs().max()).item()


def check(
    seed, lens, n_heads, n_kv, hd, ps, num_splits, dtype=torch.bfloat16, max_splits=64, variant=None
):
    q, k, v, bt, sl = make_case(seed, lens, n_heads, n_kv, hd, ps, dtype)
    ws, out = poisoned(len(lens), n_heads, hd, max_splits, dtype)
    kw = {"num_splits": num_splits} if num_splits else {"max_seq_len": max(lens)}
    got = fd.flash_decode(q, k, v, bt, sl, workspace=ws, out=out, variant=variant, **kw)
    ref = paged_decode_reference(q, k, v, bt, sl, compute_dtype=torch.float64)
    assert not got.isnan().any()
    err = rel_err(got, ref)
    assert err < REL_TOL[dtype], f"rel err {err:.3g} for lens={lens[:8]} ns={num_splits}"


MIXED = [1, 15, 16, 17, 63, 64, 65, 100, 1000, 4097]
GEOMS = list(itertools.product([1, 4, 8], [64, 128], [16, 64]))  # (gqa, head_dim, page_size)


@pytest.mark.parametrize("gqa, hd, ps", GEOMS)
@pytest.mark.parametrize("num_splits", [1, 7, 64, None])  # None: the ladder
def test_mixed_lengths_every_geometry(gqa, hd, ps, num_splits):
    n_kv = 8 if gqa < 8 else 4
    check(gqa * 1000 + hd + ps, MIXED, n_kv * gqa, n_kv, hd, ps, num_splits)


@pytest.mark.parametrize(
    "lens",
    [[1], [63, 64, 65, 127, 128, 129], [32768], [32767, 1, 16385, 4096] * 8, [5] * 32],
    ids=["len1", "block_n_edges", "32k", "bs32_mixed_to_32k", "bs32_short_empty_splits"],
)
@pytest.mark.parametrize("num_splits", [1, 64, None])
def test_realistic_sizes(lens, num_splits):
    check(len(lens) + sum(lens) % 997, lens, 32, 8, 64, 64, num_splits)


@pytest.mark.parametrize("cfg", sweep.VARIANTS, ids=[c.name for c in sweep.VARIANTS])
@pytest.mark.parametrize("ps", [16, 64, 128])  # per-key lookup; one and two tiles a page
def test_every_sweep_variant_matches_the_reference(cfg, ps):
    """Each config the sweep times, at Llama-3.2-1B shapes in bf16: several split counts, the
    ladder, and tile and page edges. (One compile per variant and page size.)"""
    lens = [1, 63, 64, 65, 127, 128, 129, 1000, 4097, 32768]
    for ns in (1, 7, 64, None):
        check(sum(map(ord, cfg.name)) + ps, lens, 32, 8, 64, ps, ns, variant=cfg)


@pytest.mark.parametrize("hd", [64, 128])
@pytest.mark.parametrize("num_splits, merge", [(2, 2), (2, 4), (4, 4), (3, 8), (8, 8)])
def test_folded_merge_bf16(hd, num_splits, merge):
    """The one-launch attention with its merge (the fused step's at Llama-3.2-1B's classes
    16-32), bf16: against float64 and the two-kernel path, rows of one split and of many in one
    batch (short ones final after split 0), the tickets back at zero, the same bits on a
    repeat, and ``merge_splits`` above the live count (exact mode below the captured one)."""
    lens = [1, 127, 128, 129, 300, 640, 1000, 4097] * 3
    q, k, v, bt, sl = make_case(hd + 10 * num_splits + merge, lens, 32, 8, hd, 64)
    ws, out = poisoned(len(lens), 32, hd, 64, torch.bfloat16)
    kw = dict(num_splits=num_splits, workspace=ws, fold_combine=True, merge_splits=merge)
    got = fd.flash_decode(q, k, v, bt, sl, out=out, **kw).clone()
    ref = paged_decode_reference(q, k, v, bt, sl, compute_dtype=torch.float64)
    assert not got.isnan().any() and rel_err(got, ref) < REL_TOL[torch.bfloat16]
    assert int(ws.tickets.abs().sum()) == 0
    ws2, out2 = poisoned(len(lens), 32, hd, 64, torch.bfloat16)
    two = fd.flash_decode(q, k, v, bt, sl, num_splits=num_splits, workspace=ws2, out=out2)
    assert (got.float() - two.float()).abs().max().item() <= 2**-6 * two.abs().max().item()
    out.fill_(float("nan"))
    assert torch.equal(fd.flash_decode(q, k, v, bt, sl, out=out, **kw), got)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_other_dtypes(dtype):
    check(3, [1, 65, 3000], 32, 8, 128, 16, None, dtype=dtype)


def test_ladder_matches_explicit_splits():
    lens = [5000, 20, 777, 12000]
    q, k, v, bt, sl = make_case(41, lens, 32, 8, 64, 64)
    ns = num_splits_for(max(lens), 8, len(lens), num_sms(), 64)
    ladder = fd.flash_decode(q, k, v, bt, sl, max_seq_len=max(lens))
    ladder_sync = fd.flash_decode(q, k, v, bt, sl)  # reads seq_lens.max() (eager only)
    explicit = fd.flash_decode(q, k, v, bt, sl, num_splits=ns)
    torch.testing.assert_close(ladder, explicit, rtol=0, atol=0)
    torch.testing.assert_close(ladder_sync, explicit, rtol=0, atol=0)
    one = fd.flash_decode(q, k, v, bt, sl, num_splits=1)
    assert rel_err(one, explicit.double()) < 1e-2


def test_graph_replay_follows_seq_lens_edited_in_place():
    bs, n_heads, n_kv, hd, ps, max_len = 8, 32, 8, 64, 64, 8192
    lens0 = [max_len, 1, 300, 4096, 64, 65, 2000, 8000]
    q, k, v, bt, sl = make_case(7, [max_len] * bs, n_heads, n_kv, hd, ps)  # every page real
    sl.copy_(torch.tensor(lens0, dtype=torch.int32))
    ws = fd.DecodeWorkspace.allocate(16, n_heads, hd, 64, DEV)  # rows [:bs] of a max_bs=16 one
    out = torch.empty_like(q)
    ns = num_splits_for(max_len, n_kv, bs, num_sms(), 64)
    run = lambda: fd.flash_decode(q, k, v, bt, sl, num_splits=ns, workspace=ws, out=out)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm up: compiles every variant before capture
            run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        run()

    g = torch.Generator(device=DEV).manual_seed(99)
    for step, lens in enumerate([lens0, [1] * 8, [8192, 8191, 4097, 129, 128, 127, 3, 2]]):
        sl.copy_(torch.tensor(lens, dtype=torch.int32))
        q.copy_(torch.randn(q.shape, generator=g, device=DEV).to(q.dtype))
        out.fill_(float("nan"))
        ws.partial_o.fill_(float("nan"))
        ws.partial_lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        replayed = out.clone()
        eager = fd.flash_decode(q, k, v, bt, sl, num_splits=ns)
        ref = paged_decode_reference(q, k, v, bt, sl, compute_dtype=torch.float64)
        assert not replayed.isnan().any(), f"step {step}"
        torch.testing.assert_close(replayed, eager, rtol=0, atol=0)
        assert rel_err(replayed, ref) < 1e-2


def _driver_index(kernel, name):
    """Driver-level index of ``name``: non-constexpr signature entries before it."""
    sig = kernel.src.signature  # {arg name: type}, constexpr (and specialised) args "constexpr"
    names = [n for n, t in sig.items() if t != "constexpr"]
    return names.index(name), sig[name]


def test_driver_level_positions_of_editable_args():
    bs, n_heads, hd, ms = 1, 8, 64, 64
    ws = fd.DecodeWorkspace.allocate(bs, n_heads, hd, ms, DEV)
    out = torch.empty(bs, n_heads, hd, dtype=torch.bfloat16, device=DEV)
    combine = fd._combine_kernel[
        (bs, n_heads)
    ](
        ws.partial_o,
        1,  # n_splits == 1: must NOT be specialised away
        ws.partial_lse,
        out,
        *ws.partial_o.stride()[:3],
        *ws.partial_lse.stride()[:2],
        *out.stride()[:2],
        HEAD_DIM=hd,
        SPLITS_PAD=ms,
    )
    assert _driver_index(combine, "partial_o_ptr")[0] == fd.COMBINE_PARTIAL_O_ARG
    assert _driver_index(combine, "n_splits") == (fd.COMBINE_N_SPLITS_ARG, "i32")
    assert combine.name == fd.COMBINE_KERNEL_NAME

    # one page per request: block_table.stride(0) == 1 is specialised away; 0..7 must not move
    q, k, v, bt, sl = make_case(1, [1], n_heads, 1, hd, 16, spare_pages=0)
    assert bt.stride(0) == 1
    main = fd._split_kv_kernel[(bs, 1, 1)](
        ws.partial_o,
        ws.partial_lse,
        q,
        k,
        v,
        bt,
        sl,
        0.125,
        *q.stride()[:2],
        *k.stride()[:3],
        *v.stride()[:3],
        bt.stride(0),
        *ws.partial_o.stride()[:3],
        *ws.partial_lse.stride()[:2],
        GROUP=8,
        GROUP_PAD=16,
        HEAD_DIM=hd,
        PAGE_SIZE=16,
        BLOCK_N=64,
        PAGE_TILE=False,
        K_ROWS=True,
        USE_DOT=True,
        DOT_PRECISION=None,
        UPCAST=False,
        NUM_STAGES=2,
    )
    assert _driver_index(main, "partial_o_ptr")[0] == fd.MAIN_PARTIAL_O_ARG
    assert main.name == fd.MAIN_KERNEL_NAME
    for i, name in enumerate(fd._split_kv_kernel.arg_names[:8]):
        assert _driver_index(main, name)[0] == i
    assert _driver_index(main, "sm_scale")[1] == "fp32"
    assert "stride_bt" not in [n for n, t in main.src.signature.items() if t != "constexpr"]
