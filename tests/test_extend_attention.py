"""Prefill ("extend") attention under the Triton interpreter, against a float64 torch reference.

Every case draws fresh random data from its own seed. The output is poisoned with NaN before
each run; page 0 (scratch), a spare page no request owns, every block-table entry past a
request's pages (pointing at a NaN page) and the cache slots past each request's KV length hold
NaN, so a stray read or a missed write shows. q is a strided view (as a slice of a fused qkv
projection is), and out a view whose neighbour columns must stay NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from stepgraph.errors import ConfigError
from stepgraph.kernels.decode.reference import paged_decode_reference
from stepgraph.kernels.prefill.extend_attention import extend_attention
from stepgraph.kernels.prefill.extend_inputs import ExtendTile, check_extend_inputs
from stepgraph.kernels.prefill.extend_reference import (
    extend_attention_reference,
    extend_attention_torch,
)
from tests.conftest import rel_err

NAN = float("nan")


@dataclass
class Case:
    q: torch.Tensor  # [T, n_heads, hd], a strided view
    k: torch.Tensor  # [num_pages, page_size, n_kv, hd]
    v: torch.Tensor
    qo_indptr: torch.Tensor  # [bs + 1] int32
    kv_lens: torch.Tensor  # [bs] int32
    bt: torch.Tensor  # [bs, max_pages] int32
    q_lens: list[int]
    kv_list: list[int]
    pages: list[list[int]]  # each request's pages, as the block table holds them

    @property
    def scale(self) -> float:
        return self.q.shape[-1] ** -0.5

    def args(self):
        return self.q, self.k, self.v, self.qo_indptr, self.kv_lens, self.bt


def make_case(
    seed, prefix, q_lens, n_heads, n_kv, hd, ps, dtype, device="cpu", spare_cols=2
) -> Case:
    """Random paged caches for requests with ``prefix[b]`` cached and ``q_lens[b]`` new tokens;
    everything no request owns is NaN, and the pages are shuffled. The block table has
    ``spare_cols`` columns past the longest request's pages."""
    g = torch.Generator(device=device).manual_seed(seed)
    kv_list = [p + n for p, n in zip(prefix, q_lens)]
    used = [-(-n // ps) for n in kv_list]
    n_pages = sum(used) + 3  # + scratch page 0, a NaN page for the tails, a spare
    nan_page = n_pages - 2

    def cache():
        c = torch.randn(n_pages, ps, n_kv, hd, generator=g, device=device).to(dtype)
        c[0] = c[nan_page] = c[n_pages - 1] = NAN
        return c

    k, v = cache(), cache()
    perm = (torch.randperm(nan_page - 1, generator=g, device=device) + 1).tolist()
    bt = torch.full((len(q_lens), max(used) + spare_cols), nan_page, dtype=torch.int32)
    pages = []
    for b, n in enumerate(kv_list):
        row, perm = perm[: used[b]], perm[used[b] :]
        pages.append(row)
        bt[b, : used[b]] = torch.tensor(row, dtype=torch.int32)
        if n % ps:  # slots past the end of the last page: never read
            k[row[-1], n % ps :] = v[row[-1], n % ps :] = NAN
    total = sum(q_lens)
    wide = torch.randn(total, n_heads + 3, hd, generator=g, device=device).to(dtype)
    indptr = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return Case(
        wide[:, 1 : n_heads + 1],  # row stride (n_heads + 3) * hd, not n_heads * hd
        k,
        v,
        indptr.to(device),
        torch.tensor(kv_list, dtype=torch.int32, device=device),
        bt.to(device),
        list(q_lens),
        kv_list,
        pages,
    )


def run(c: Case, max_q_len=None, **kw):
    """The kernel into a NaN-filled view of a wider buffer; checks the neighbours stay NaN."""
    total, n_heads, hd = c.q.shape
    wide = torch.full((total, n_heads + 2, hd), NAN, dtype=c.q.dtype, device=c.q.device)
    out = wide[:, 1 : n_heads + 1]
    max_q_len = max(c.q_lens) if max_q_len is None else max_q_len
    got = extend_attention(*c.args(), max_q_len=max_q_len, sm_scale=c.scale, out=out, **kw)
    assert got is out
    assert wide[:, 0].isnan().all() and wide[:, -1].isnan().all(), "wrote outside out"
    return got


TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}
T16, T16_32, T32 = ExtendTile(16, 16, 4, 1), ExtendTile(16, 32, 4, 1), ExtendTile(32, 32, 4, 1)

# id: (prefix, q_lens, n_heads, n_kv, head_dim, page_size, dtype, tile)
# With a tile of 16 x 16 every loop runs several times: q blocks, unmasked key tiles, band tiles.
CASES = {
    "prefix0-group1": ([0], [53], 2, 2, 64, 16, torch.float32, T16),
    "mix-gqa2": ([0, 45, 100], [37, 1, 70], 4, 2, 64, 16, torch.float32, T16),
    "decode-rows-gqa4": ([5, 31, 64, 0], [1, 1, 1, 1], 4, 1, 64, 16, torch.float32, T16),
    "tile-spans-2-pages": ([23, 0, 61], [41, 19, 1], 4, 2, 64, 16, torch.float32, T16_32),
    "page8-4-pages-a-tile": ([13, 40], [29, 7], 4, 2, 64, 8, torch.float32, T16_32),
    "page32-tile-in-page": ([50, 3], [30, 44], 4, 2, 64, 32, torch.float32, T16),
    "hd128-fp16": ([23, 0], [41, 19], 4, 2, 128, 16, torch.float16, T16_32),
    "fp16-gqa4": ([17, 60], [40, 33], 8, 2, 64, 16, torch.float16, T32),
    "bf16": ([30, 0], [45, 20], 4, 2, 64, 16, torch.bfloat16, T16),
    "hd16-tiny-model": ([0, 12], [20, 5], 4, 2, 16, 16, torch.float32, T16),
    "default-tile": ([70, 0], [150, 9], 2, 1, 64, 16, torch.float16, None),
}


@pytest.mark.parametrize("name", CASES)
def test_kernel_matches_float64_reference(name):
    prefix, q_lens, n_heads, n_kv, hd, ps, dtype, tile = CASES[name]
    c = make_case(list(CASES).index(name), prefix, q_lens, n_heads, n_kv, hd, ps, dtype)
    ref = extend_attention_reference(*c.args(), c.scale)
    got = run(c, tile=tile)
    assert got.dtype == dtype
    assert rel_err(got, ref) < TOL[dtype], name


def test_block_table_without_spare_columns():
    """The longest request fills its row exactly, the last row ends the table, and band tiles
    run past the last key. (That the kernel then reads no table entry past the row is memory
    safety, which the interpreter cannot see: K/V loads of those keys are masked anyway.)"""
    c = make_case(11, [20, 32], [12, 32], 4, 2, 64, 16, torch.float32, spare_cols=0)
    got = run(c, tile=ExtendTile(16, 64, 4, 1))
    assert rel_err(got, extend_attention_reference(*c.args(), c.scale)) < 1e-5


@pytest.mark.parametrize("name", ["mix-gqa2", "hd128-fp16", "bf16", "page8-4-pages-a-tile"])
def test_torch_path_matches_float64_reference(name):
    prefix, q_lens, n_heads, n_kv, hd, ps, dtype, _ = CASES[name]
    c = make_case(100 + list(CASES).index(name), prefix, q_lens, n_heads, n_kv, hd, ps, dtype)
    ref = extend_attention_reference(*c.args(), c.scale)
    by_table = extend_attention_torch(c.q, c.k, c.v, c.q_lens, c.kv_list, c.bt, c.scale)
    by_lists = extend_attention_torch(c.q, c.k, c.v, c.q_lens, c.kv_list, c.pages, c.scale)
    assert by_table.dtype == dtype
    assert rel_err(by_table, ref) < TOL[dtype]
    assert torch.equal(by_table, by_lists)


def test_torch_path_writes_out(nan_empty):
    c = make_case(3, [9, 0], [20, 4], 4, 2, 64, 16, torch.float32)
    out = torch.full_like(c.q, NAN)
    got = extend_attention_torch(c.q, c.k, c.v, c.q_lens, c.kv_list, c.bt, c.scale, out=out)
    assert got is out
    assert rel_err(got, extend_attention_reference(*c.args(), c.scale)) < 1e-5
    fresh = extend_attention_torch(c.q, c.k, c.v, c.q_lens, c.kv_list, c.bt, c.scale)
    assert rel_err(fresh, got) < 1e-6  # the nan_empty fixture poisoned its own allocation


def test_kernel_allocates_out_and_allows_a_larger_grid(nan_empty):
    c = make_case(4, [33, 2], [18, 40], 4, 2, 64, 16, torch.float32)
    total = c.q.shape[0]
    got = extend_attention(*c.args(), max_q_len=total, sm_scale=c.scale, tile=T16)
    assert got.shape == c.q.shape and got.dtype == c.q.dtype
    assert rel_err(got, extend_attention_reference(*c.args(), c.scale)) < 1e-5


def test_empty_batch_returns_empty():
    c = make_case(5, [3], [4], 2, 1, 64, 16, torch.float32)
    q = c.q[:0]
    indptr = torch.zeros(1, dtype=torch.int32)
    kv = torch.zeros(0, dtype=torch.int32)
    got = extend_attention(q, c.k, c.v, indptr, kv, c.bt[:0], max_q_len=0, sm_scale=0.125)
    assert got.shape == (0, 2, 64)


# -- the reference against independent computations --


def test_reference_of_one_token_chunks_is_decode_attention():
    c = make_case(6, [5, 40, 0], [1, 1, 1], 8, 2, 64, 16, torch.float32)
    ref = extend_attention_reference(*c.args(), c.scale)
    dec = paged_decode_reference(
        c.q, c.k, c.v, c.bt, c.kv_lens, c.scale, compute_dtype=torch.float64
    )
    assert rel_err(ref, dec) < 1e-12


def test_reference_with_no_prefix_is_causal_prefill():
    c = make_case(7, [0, 0], [25, 14], 4, 2, 64, 16, torch.float64)
    ref = extend_attention_reference(*c.args(), c.scale)
    start = 0
    for pages, n in zip(c.pages, c.q_lens):
        k = c.k[pages].flatten(0, 1)[:n].repeat_interleave(2, dim=1)  # [n, n_heads, hd]
        v = c.v[pages].flatten(0, 1)[:n].repeat_interleave(2, dim=1)
        q = c.q[start : start + n]
        o = F.scaled_dot_product_attention(
            *(t.transpose(0, 1) for t in (q, k, v)), is_causal=True, scale=c.scale
        )
        assert rel_err(ref[start : start + n], o.transpose(0, 1)) < 1e-12
        start += n


def test_reference_prefix_changes_the_answer():
    """Guards the tests themselves: the same new tokens with and without a visible prefix differ."""
    c = make_case(8, [30], [10], 2, 1, 64, 16, torch.float64)
    with_prefix = extend_attention_reference(*c.args(), c.scale)
    no_prefix = extend_attention_reference(*c.args()[:4], c.kv_lens - 30, c.bt, c.scale)
    assert rel_err(no_prefix, with_prefix) > 1e-2


# -- input checks: each names the argument --

_C = make_case(9, [4, 0], [3, 5], 4, 2, 64, 16, torch.float32)
_TOTAL = 8


def _bad(**change):
    a = dict(
        q=_C.q,
        k_cache=_C.k,
        v_cache=_C.v,
        qo_indptr=_C.qo_indptr,
        kv_lens=_C.kv_lens,
        block_table=_C.bt,
        max_q_len=5,
        sm_scale=0.125,
        out=None,
        tile=None,
    )
    a.update(change)
    return a


BAD = {
    "q-2d": (_bad(q=_C.q[:, 0]), "q must be"),
    "q-dtype": (_bad(q=_C.q.double()), "q has dtype"),
    "q-last-dim": (_bad(q=torch.randn(_TOTAL, 4, 128)[:, :, ::2]), "q's last dim"),
    "head-dim": (_bad(q=torch.randn(_TOTAL, 4, 48)), "head_dim 48"),
    "k-dtype": (_bad(k_cache=_C.k.half()), "k_cache has dtype"),
    "v-3d": (_bad(v_cache=_C.v[0]), "v_cache must be"),
    "k-contiguous": (_bad(k_cache=_C.k.transpose(0, 1)), "k_cache must be contiguous"),
    "v-shape": (_bad(v_cache=_C.v[:-1]), "v_cache"),
    "k-head-dim": (
        _bad(k_cache=_C.k[..., :32].clone(), v_cache=_C.v[..., :32].clone()),
        "head_dim 32",
    ),
    "gqa": (_bad(q=torch.randn(_TOTAL, 3, 64)), "multiple of n_kv_heads"),
    "kv-lens-dtype": (_bad(kv_lens=_C.kv_lens.long()), "kv_lens must be int32"),
    "kv-lens-device": (_bad(kv_lens=_C.kv_lens.to("meta")), "kv_lens is on meta"),
    "indptr-len": (_bad(qo_indptr=_C.qo_indptr[:-1]), "qo_indptr has 2 entries"),
    "indptr-list": (_bad(qo_indptr=[0, 3, 8]), "qo_indptr must be"),
    "table-rows": (_bad(block_table=_C.bt[:1]), "block_table"),
    "table-1d": (_bad(block_table=_C.bt[0]), "block_table must be"),
    "max-q-bool": (_bad(max_q_len=True), "max_q_len must be a host int"),
    "max-q-float": (_bad(max_q_len=5.0), "max_q_len must be a host int"),
    "max-q-tensor": (_bad(max_q_len=torch.tensor(5)), "max_q_len must be a host int"),
    "max-q-zero": (_bad(max_q_len=0), "max_q_len=0"),
    "max-q-above-T": (_bad(max_q_len=_TOTAL + 1), "max_q_len=9"),
    "max-q-below-T/bs": (_bad(max_q_len=3), "max_q_len=3"),
    "sm-scale-none": (_bad(sm_scale=None), "sm_scale"),
    "sm-scale-nan": (_bad(sm_scale=NAN), "sm_scale"),
    "sm-scale-bool": (_bad(sm_scale=True), "sm_scale"),
    "sm-scale-zero": (_bad(sm_scale=0.0), "sm_scale must be a positive"),
    "sm-scale-negative": (_bad(sm_scale=-0.125), "sm_scale must be a positive"),
    "out-shape": (_bad(out=torch.empty(_TOTAL, 4, 32)), "out must have"),
    "out-dtype": (
        _bad(out=torch.empty(_TOTAL, 4, 64, dtype=torch.float16)),
        "out is torch.float16",
    ),
    "out-last-dim": (_bad(out=torch.empty(_TOTAL, 4, 128)[:, :, ::2]), "out's last dim"),
    "tile-type": (_bad(tile=(128, 64, 4, 2)), "tile must be"),
}


@pytest.mark.parametrize("name", BAD)
def test_bad_input_raises_config_error(name):
    kwargs, message = BAD[name]
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        check_extend_inputs(**kwargs, interpreted=True)
    if name in ("max-q-bool", "q-dtype", "out-dtype", "gqa"):  # the launcher runs the checks
        tensors = [kwargs.pop(n) for n in ("q", "k_cache", "v_cache", "qo_indptr", "kv_lens")]
        with pytest.raises(ConfigError, match="extend_attention"):
            extend_attention(*tensors, **kwargs)


def test_cpu_tensors_without_the_interpreter_are_refused():
    with pytest.raises(ConfigError, match="needs a CUDA device.*extend_attention_torch"):
        check_extend_inputs(**_bad(), interpreted=False)


@pytest.mark.parametrize(
    "fields", [(24, 64, 4, 2), (128, 8, 4, 2), (128, 64, 3, 2), (64, 64, 4, 0)]
)
def test_bad_tile_raises(fields):
    with pytest.raises(ConfigError, match="ExtendTile"):
        ExtendTile(*fields)


def test_torch_path_checks_lengths():
    c = _C
    with pytest.raises(ConfigError, match="must sum to T=8"):
        extend_attention_torch(c.q, c.k, c.v, [3, 4], c.kv_list, c.bt, c.scale)
    with pytest.raises(ConfigError, match="q_len=5 > kv_len=4"):
        extend_attention_torch(c.q, c.k, c.v, [3, 5], [4, 4], c.bt, c.scale)
