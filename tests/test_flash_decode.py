"""Split-KV flash decode under the Triton interpreter, against a float64 torch reference.

Every case uses fresh random data from its own seed; the partials and the output are poisoned
with NaN before each run, block-table entries past a request's pages point at a NaN page, and
the cache slots past each request's length hold NaN, so a missed write or a stray read shows.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

from stepgraph.errors import ConfigError
from stepgraph.kernels.decode.reference import paged_decode_reference

fd = importlib.import_module("stepgraph.kernels.decode.flash_decode")


@dataclass
class Case:
    q: torch.Tensor  # [bs, n_heads, hd]
    k: torch.Tensor  # [num_pages, page_size, n_kv, hd]
    v: torch.Tensor
    bt: torch.Tensor  # [bs, max_pages] int32
    lens: torch.Tensor  # [bs] int32


def make_case(seed, lens, n_heads=4, n_kv=1, hd=64, ps=16, dtype=torch.float32, spare_pages=1):
    g = torch.Generator().manual_seed(seed)
    bs = len(lens)
    max_pages = max(-(-max(lens) // ps), 1) + spare_pages
    used = [-(-n // ps) for n in lens]
    n_pages = sum(used) + 2  # + one NaN page + one spare
    k = torch.randn(n_pages, ps, n_kv, hd, generator=g).to(dtype)
    v = torch.randn(n_pages, ps, n_kv, hd, generator=g).to(dtype)
    nan_page = n_pages - 1
    k[nan_page] = float("nan")
    v[nan_page] = float("nan")
    perm = torch.randperm(n_pages - 2, generator=g).tolist()  # scattered, not in order
    bt = torch.full((bs, max_pages), nan_page, dtype=torch.int32)
    for b, n in enumerate(lens):
        pages, perm = perm[: used[b]], perm[used[b] :]
        bt[b, : used[b]] = torch.tensor(pages, dtype=torch.int32)
        if n % ps:  # slots past the end of the last page: never read
            k[pages[-1], n % ps :] = float("nan")
            v[pages[-1], n % ps :] = float("nan")
    q = torch.randn(bs, n_heads, hd, generator=g).to(dtype)
    return Case(q, k, v, bt, torch.tensor(lens, dtype=torch.int32))


def poisoned_workspace(bs, n_heads, hd, max_splits):
    ws = fd.DecodeWorkspace.allocate(bs, n_heads, hd, max_splits, "cpu")
    ws.partial_o.fill_(float("nan"))
    ws.partial_lse.fill_(float("nan"))
    return ws


def run(c: Case, max_splits=8, ws_rows=None, **kw):
    bs, n_heads, hd = c.q.shape
    ws = poisoned_workspace(ws_rows or bs, n_heads, hd, max_splits)
    out = torch.full_like(c.q, float("nan"))
    got = fd.flash_decode(c.q, c.k, c.v, c.bt, c.lens, workspace=ws, out=out, **kw)
    assert got is out
    return got, ws


def rel_err(got, ref):
    return ((got.double() - ref).abs().max() / ref.abs().max()).item()


TOL = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}

CASES = {  # id: (lens, n_heads, n_kv, hd, ps, num_splits, dtype)
    "len1": ([1], 4, 1, 64, 16, 1, torch.float32),
    "page16_boundary": ([15, 16, 17], 4, 4, 64, 16, 2, torch.float32),
    "page64_boundary": ([63, 64, 65], 4, 1, 128, 64, 2, torch.float32),
    "not_multiple_of_block_n": ([100, 130], 8, 2, 64, 16, 3, torch.float32),
    "mixed_gqa8": ([1, 37, 200, 129], 8, 1, 64, 16, 4, torch.float32),
    "gqa1_hd128": ([70, 5], 2, 2, 128, 64, 2, torch.float32),
    "ns_is_max_splits": ([300], 4, 1, 64, 16, 8, torch.float32),
    "empty_splits": ([5, 70], 4, 1, 64, 64, 8, torch.float32),
    "ns1_long": ([257], 4, 1, 64, 64, 1, torch.float32),
    "fp16_gqa4": ([33, 190], 8, 2, 64, 16, 3, torch.float16),
    "bf16_gqa8_hd128": ([129, 64], 8, 1, 128, 64, 2, torch.bfloat16),
}


@pytest.mark.parametrize("case_id", list(CASES))
def test_matches_float64_reference(case_id):
    lens, n_heads, n_kv, hd, ps, ns, dtype = CASES[case_id]
    c = make_case(sum(map(ord, case_id)), lens, n_heads, n_kv, hd, ps, dtype)
    got, ws = run(c, num_splits=ns)
    ref = paged_decode_reference(c.q, c.k, c.v, c.bt, c.lens, compute_dtype=torch.float64)
    assert got.dtype == dtype
    assert not got.isnan().any()
    assert rel_err(got, ref) < TOL[dtype]
    # the first ns partials of every live row are written, never NaN
    assert not ws.partial_lse[:, :, :ns].isnan().any()
    assert not ws.partial_o[:, :, :ns].isnan().any()


VARIANTS = {  # id: KernelVariant; the kernel's constexpr paths, each against the reference
    "seed_kt_per_key": fd.KernelVariant(block_n=64, k_rows=False, page_tile=False),
    "n64_page_tile": fd.KernelVariant(block_n=64, num_stages=3),
    "n128": fd.KernelVariant(block_n=128, num_warps=8),
    "n16_page_tile": fd.KernelVariant(block_n=16),
    "fma_k_rows": fd.KernelVariant(use_dot=False),
    "fma_kt_per_key": fd.KernelVariant(use_dot=False, k_rows=False, page_tile=False),
}
VARIANT_CASES = {  # id: (lens, n_heads, n_kv, hd, ps, num_splits, dtype)
    "ps64_mixed": ([1, 64, 65, 200], 8, 2, 32, 64, 3, torch.float32),
    "ps128_two_tiles_a_page": ([129, 5, 256], 2, 2, 32, 128, 2, torch.float32),
    "ps16_gqa8": ([100, 17], 8, 1, 32, 16, 2, torch.float32),
    "bf16_ps64": ([130, 70], 8, 2, 32, 64, 2, torch.bfloat16),
}


@pytest.mark.parametrize("case_id", list(VARIANT_CASES))
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_variant_matches_the_reference(variant, case_id):
    lens, n_heads, n_kv, hd, ps, ns, dtype = VARIANT_CASES[case_id]
    c = make_case(sum(map(ord, case_id)), lens, n_heads, n_kv, hd, ps, dtype)
    got, ws = run(c, num_splits=ns, variant=VARIANTS[variant])
    ref = paged_decode_reference(c.q, c.k, c.v, c.bt, c.lens, compute_dtype=torch.float64)
    assert not got.isnan().any()
    assert rel_err(got, ref) < TOL[dtype]
    assert not ws.partial_lse[:, :, :ns].isnan().any()


def test_kernel_config_default_table_and_names():
    cfg = fd.default_variant(64, 64, torch.bfloat16)
    assert cfg is fd.DEFAULT_VARIANTS[(64, 64, torch.bfloat16)]
    assert fd.default_variant(48, 3, torch.float32) is fd.FALLBACK_VARIANT
    assert fd.KernelVariant(block_n=128, num_warps=8, num_stages=4).name == "n128w8s4"
    flags = fd.KernelVariant(k_rows=False, page_tile=False, use_dot=False)
    assert flags.name == "n64w4s2-kt-pk-fma"
    for bad in ({"block_n": 48}, {"block_n": 8}, {"num_warps": 3}, {"num_stages": 0}):
        with pytest.raises(ConfigError, match="KernelVariant"):
            fd.KernelVariant(**bad)


def test_variant_names_round_trip_and_the_env_override(monkeypatch):
    names = ["n64w4s3", "n128w8s2-kt", "n32w2s1-pk-fma", "n16w1s4-kt-pk-fma"]
    for name in names:
        assert fd.KernelVariant.from_name(name).name == name
    assert fd.KernelVariant.from_name("n64w4s2") == fd.KernelVariant()
    for bad in ("n64w4", "n48w4s3", "n64w4s3-xx", "N64w4s3", " n64w4s3"):
        with pytest.raises(ConfigError, match="KernelVariant"):
            fd.KernelVariant.from_name(bad)
    name = "n32w2s3-kt"  # DecodeTuning.attention_variant: every shape, the table's included
    assert fd.default_variant(64, 64, torch.bfloat16, name).name == "n32w2s3-kt"
    assert fd.default_variant(48, 3, torch.float32, name).name == "n32w2s3-kt"
    key = (64, 64, torch.bfloat16)
    assert fd.default_variant(*key, "") is fd.DEFAULT_VARIANTS[key]  # empty: the table
    assert fd.default_variant(*key) is fd.DEFAULT_VARIANTS[key]
    from stepgraph.tuning import DecodeTuning

    assert DecodeTuning(attention_variant=name).attention_variant == name
    with pytest.raises(ValueError, match="attention_variant='n48w4s3'"):
        DecodeTuning(attention_variant="n48w4s3")


def test_pdl_pair_picks_each_kernel(monkeypatch):
    """``use_pdl=(split, combine)`` resolves each kernel's own (here on the interpreter, where
    both are off: the pair must still be accepted and give the two-kernel result)."""
    c = make_case(11, [70, 33], n_heads=4, n_kv=2, ps=16)
    seen = []
    real = fd.resolve_pdl
    monkeypatch.setattr(fd, "resolve_pdl", lambda v, d, t=None: seen.append(v) or real(v, d, t))
    got, _ = run(c, num_splits=2, use_pdl=(2, False))
    ref = paged_decode_reference(c.q, c.k, c.v, c.bt, c.lens, compute_dtype=torch.float64)
    assert seen == [2, False] and rel_err(got, ref) < TOL[torch.float32]


def test_empty_splits_write_minus_inf_and_zero():
    c = make_case(7, [5, 70], n_heads=4, n_kv=2, ps=16)
    _, ws = run(c, num_splits=8)
    # chunk = 64: request 0 has one live split, request 1 has two; the rest are empty
    assert torch.isfinite(ws.partial_lse[0, :, 0]).all()
    assert torch.isneginf(ws.partial_lse[0, :, 1:8]).all()
    assert torch.isfinite(ws.partial_lse[1, :, :2]).all()
    assert torch.isneginf(ws.partial_lse[1, :, 2:8]).all()
    assert (ws.partial_o[0, :, 1:8] == 0).all() and (ws.partial_o[1, :, 2:8] == 0).all()


def test_splits_agree_with_each_other_and_partials_are_exact():
    c = make_case(11, [150, 9], n_heads=4, n_kv=1, ps=16)
    ref = paged_decode_reference(c.q, c.k, c.v, c.bt, c.lens, compute_dtype=torch.float64)
    outs = [run(c, num_splits=ns)[0] for ns in (1, 2, 3)]
    for o in outs:
        assert rel_err(o, ref) < TOL[torch.float32]
    # the lse of the single split is the log-sum-exp of the scaled scores
    _, ws = run(c, num_splits=1)
    k = c.k[c.bt[0, :10].long()].flatten(0, 1)[:150, 0].double()  # [150, hd]
    s = c.q[0].double() @ k.T / 8.0  # [4, 150]
    torch.testing.assert_close(ws.partial_lse[0, :, 0].double(), s.logsumexp(-1), rtol=0, atol=1e-5)


def test_single_split_workspace():
    c = make_case(29, [77, 3], n_heads=4, n_kv=4)
    ref = paged_decode_reference(c.q, c.k, c.v, c.bt, c.lens, compute_dtype=torch.float64)
    got, _ = run(c, max_splits=1, num_splits=1)
    assert rel_err(got, ref) < TOL[torch.float32]
    got, _ = run(c, max_splits=1)  # the ladder, clamped to the workspace
    assert rel_err(got, ref) < TOL[torch.float32]


def test_zero_length_request_gives_zeros():
    c = make_case(3, [0, 20], n_heads=4, n_kv=1)
    got, _ = run(c, num_splits=2)
    assert (got[0] == 0).all() and not got.isnan().any()


def test_rows_of_a_larger_workspace():
    c = make_case(5, [40, 90], n_heads=4, n_kv=1)
    got, ws = run(c, ws_rows=5, num_splits=2)
    ref = paged_decode_reference(c.q, c.k, c.v, c.bt, c.lens, compute_dtype=torch.float64)
    assert rel_err(got, ref) < TOL[torch.float32]
    assert ws.partial_lse[2:].isnan().all() and ws.partial_o[2:].isnan().all()


def test_ladder_path_with_and_without_host_max():
    c = make_case(13, [300, 12], n_heads=8, n_kv=1)
    ref = paged_decode_reference(c.q, c.k, c.v, c.bt, c.lens, compute_dtype=torch.float64)
    for kw in ({}, {"max_seq_len": 300}, {"max_seq_len": 300, "num_sms": 2}):
        got = fd.flash_decode(c.q, c.k, c.v, c.bt, c.lens, **kw)
        assert rel_err(got, ref) < TOL[torch.float32]


def test_sm_scale_is_used():
    c = make_case(17, [50], n_heads=4, n_kv=1)
    ref = paged_decode_reference(c.q, c.k, c.v, c.bt, c.lens, 0.3, compute_dtype=torch.float64)
    got, _ = run(c, num_splits=2, sm_scale=0.3)
    assert rel_err(got, ref) < TOL[torch.float32]


def test_combine_ignores_empty_splits():
    g = torch.Generator().manual_seed(19)
    bs, n_heads, hd, ms = 2, 3, 64, 8
    ws = poisoned_workspace(bs, n_heads, hd, ms)
    lse = torch.randn(bs, n_heads, 5, generator=g)
    lse[0, :, 1] = lse[1, :, 0] = lse[1, :, 4] = float("-inf")
    lse[0, 1, :] = float("-inf")  # one row with no live split at all
    po = torch.randn(bs, n_heads, 5, hd, generator=g)
    po[torch.isneginf(lse)] = 0.0  # what the main kernel writes for an empty split
    ws.partial_lse[:, :, :5] = lse
    ws.partial_o[:, :, :5] = po
    out = torch.full((bs, n_heads, hd), float("nan"))
    fd._combine_kernel[(bs, n_heads)](
        ws.partial_o,
        5,
        ws.partial_lse,
        out,
        *ws.partial_o.stride()[:3],
        *ws.partial_lse.stride()[:2],
        *out.stride()[:2],
        HEAD_DIM=hd,
        SPLITS_PAD=ms,
    )
    w = torch.softmax(lse.double(), -1).nan_to_num(0.0)  # [bs, h, 5]; all -inf row -> 0
    expect = (w[..., None] * po.double()).sum(2)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), expect, rtol=1e-5, atol=1e-6)
    assert (out[0, 1] == 0).all()
    # n_splits = 1 takes only the first split
    fd._combine_kernel[(bs, n_heads)](
        ws.partial_o,
        1,
        ws.partial_lse,
        out,
        *ws.partial_o.stride()[:3],
        *ws.partial_lse.stride()[:2],
        *out.stride()[:2],
        HEAD_DIM=hd,
        SPLITS_PAD=ms,
    )
    torch.testing.assert_close(out[0, 0], po[0, 0, 0])
    assert (out[1] == 0).all()  # request 1's first split is empty


def test_editable_argument_layout():
    """Argument names and do_not_specialize, checked on the compiled (non-interpreted) kernels."""
    assert (fd.MAIN_KERNEL_NAME, fd.COMBINE_KERNEL_NAME) == ("_split_kv_kernel", "_combine_kernel")
    assert (fd.MAIN_PARTIAL_O_ARG, fd.COMBINE_PARTIAL_O_ARG, fd.COMBINE_N_SPLITS_ARG) == (0, 0, 1)
    code = (
        "import stepgraph.kernels.decode.flash_decode as fd\n"
        "m, c = fd._split_kv_kernel, fd._combine_kernel\n"
        "assert m.__name__ == fd.MAIN_KERNEL_NAME and c.__name__ == fd.COMBINE_KERNEL_NAME\n"
        "assert m.arg_names[fd.MAIN_PARTIAL_O_ARG] == 'partial_o_ptr'\n"
        "assert c.arg_names[:2] == ['partial_o_ptr', 'n_splits']\n"
        "assert [p.name for p in c.params if p.do_not_specialize] == ['n_splits']\n"
        "assert not any(p.is_constexpr for p in m.params[:8] + c.params[:4])\n"
        "assert m.arg_names[7] == 'sm_scale'\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]


# -- bad input: each mismatch raises ConfigError naming the tensor and both shapes --


def _bad(c: Case, **change):
    args = {"q": c.q, "k_cache": c.k, "v_cache": c.v, "block_table": c.bt, "seq_lens": c.lens}
    kw = {k: change.pop(k) for k in list(change) if k not in args}
    args.update(change)
    return lambda: fd.flash_decode(*args.values(), **kw)


@pytest.fixture(scope="module")
def good():
    return make_case(23, [20, 40], n_heads=4, n_kv=2)


def _ws(bs=2, h=4, hd=64, ms=8, **kw):
    ws = fd.DecodeWorkspace.allocate(bs, h, hd, ms, "cpu")
    for k, v in kw.items():
        setattr(ws, k, v)
    return ws


BAD = {  # id: (change, message fragments)
    "q_rank": (lambda c: {"q": c.q[0]}, ["q", "[bs, n_heads, head_dim]", "(4, 64)"]),
    "k_head_dim": (lambda c: {"k_cache": c.k[..., :32]}, ["k_cache", "64]", "32)"]),
    "v_shape": (lambda c: {"v_cache": c.v[:, :8]}, ["v_cache", "(7, 8, 2, 64)"]),
    "head_dim": (
        lambda c: {
            "q": c.q[..., :48],
            "k_cache": c.k[..., :48].contiguous(),
            "v_cache": c.v[..., :48].contiguous(),
        },
        ["head_dim", "48"],
    ),
    "gqa": (lambda c: {"q": c.q[:, :3]}, ["n_heads", "n_kv_heads=2", "3"]),
    "bt_rows": (lambda c: {"block_table": c.bt[:1]}, ["block_table", "[2, max_pages]", "(1, 4)"]),
    "lens_rows": (lambda c: {"seq_lens": c.lens[:1]}, ["seq_lens", "[2]", "(1,)"]),
    "out_shape": (lambda c: {"out": c.q[:1].clone()}, ["out", "[2, 4, 64]", "(1, 4, 64)"]),
    "q_dtype": (lambda c: {"q": c.q.double()}, ["q.dtype", "float64"]),
    "k_dtype": (lambda c: {"k_cache": c.k.half()}, ["k_cache.dtype", "float16"]),
    "out_dtype": (lambda c: {"out": c.q.half()}, ["out.dtype", "float16"]),
    "bt_dtype": (lambda c: {"block_table": c.bt.long()}, ["block_table.dtype", "int32"]),
    "lens_dtype": (lambda c: {"seq_lens": c.lens.long()}, ["seq_lens.dtype", "int32"]),
    "device": (lambda c: {"seq_lens": c.lens.to("meta")}, ["seq_lens.device", "meta"]),
    "stride": (
        lambda c: {"q": c.q.transpose(1, 2).contiguous().transpose(1, 2)},
        ["q.stride(-1)", "contiguous"],
    ),
    "lens_stride": (
        lambda c: {"seq_lens": c.lens.repeat_interleave(2)[::2]},
        ["seq_lens.stride(-1)", "got 2"],
    ),
    "ws_rows": (lambda c: {"workspace": _ws(bs=1)}, ["workspace.partial_lse", "[>=2, 4"]),
    "ws_heads": (lambda c: {"workspace": _ws(hd=128)}, ["workspace.partial_o", "(2, 4, 8, 128)"]),
    "ws_dtype": (
        lambda c: {"workspace": _ws(partial_lse=torch.zeros(2, 4, 8).half())},
        ["float32", "float16"],
    ),
    "max_splits_above_ws": (
        lambda c: {"workspace": _ws(), "max_splits": 16},
        ["max_splits", "workspace.max_splits=8", "16"],
    ),
    "num_splits_above_max": (
        lambda c: {"num_splits": 9, "max_splits": 8},
        ["num_splits=9", "max_splits=8"],
    ),
    "num_splits_zero": (lambda c: {"num_splits": 0}, ["num_splits=0"]),
    "num_splits_float": (lambda c: {"num_splits": 2.0}, ["num_splits=2.0"]),
    "max_seq_len_over_table": (lambda c: {"max_seq_len": 65}, ["max_seq_len=65", "64", "(2, 4)"]),
    "max_seq_len_negative": (lambda c: {"max_seq_len": -1}, ["max_seq_len=-1"]),
    "seq_lens_over_table": (
        lambda c: {"seq_lens": torch.tensor([20, 65], dtype=torch.int32)},
        ["max_seq_len=65", "(2, 4)"],
    ),
}


@pytest.mark.parametrize("bad_id", list(BAD))
def test_bad_input_raises_config_error(good, bad_id):
    change, fragments = BAD[bad_id]
    with pytest.raises(ConfigError) as info:
        _bad(good, **change(good))()
    for frag in fragments:
        assert frag in str(info.value), (frag, str(info.value))


def test_no_sync_during_capture(good, monkeypatch):
    monkeypatch.setattr(fd, "_is_capturing", lambda device: True)
    with pytest.raises(ConfigError, match="capture.*num_splits.*max_seq_len"):
        fd.flash_decode(good.q, good.k, good.v, good.bt, good.lens)
    # with either host value given, capture needs no sync and runs
    fd.flash_decode(good.q, good.k, good.v, good.bt, good.lens, num_splits=2)
    fd.flash_decode(good.q, good.k, good.v, good.bt, good.lens, max_seq_len=40)
