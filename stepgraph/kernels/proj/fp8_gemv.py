"""FP8-weight projections for 1-64 rows: ``y = x @ (data * scale).T (+ bias)`` with ``data
[N, K]`` in e4m3 (``torch.float8_e4m3fn``) and float32 scales per output channel (``[N]``) or per
``(bn, bk)`` block (``[ceil(N / bn), ceil(K / bk)]``), ``x [M, K]`` in bf16, float16 or float32.

No dequantized copy exists: each chunk of e4m3 weights is converted in registers (exactly: every
e4m3 value is a bf16, float16 and float32 value) and accumulated in float32. Per-channel scales
multiply the accumulator once per output, after the K loop (and after the split-K sum); block
scales multiply each chunk's products, a chunk lying inside one block (``BLOCK_K`` divides
``bk``). Two paths, as the bf16 kernels (``gemv_tiles``):
- one row (``BLOCK_M == 1``): a weight stream, each thread's runs of 8 products summed into a
  ``[BLOCK_N, BLOCK_K / 8]`` float32 tile (``gemv_tiles.row_products``), reduced once after the
  loop; split-K where column tiles alone leave SMs idle;
- 2-64 rows (``BLOCK_M`` 16, 32 or 64): ``tl.dot`` on tensor cores, the weight converted to x's
  dtype (float32 x: "ieee" precision, no TF32).
Split-K shares ``gemv_tiles.splitk_reduce``: the last program of a column tile sums the float32
partials in split order (deterministic) and runs the epilogue.

The pieces a fused kernel takes to stream FP8 weights instead of bf16 ones (a ``W_FORMAT``
constexpr beside its weight pointers): ``load_w_chunk`` (before the PDL wait for the first
chunk: weights and scales are never written during a step), ``chunk_scales``, ``fp8_mul_acc``
(in place of ``gemv_tiles.mul_acc``) and ``channel_scaled`` (on the accumulator, before the
epilogue).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...errors import ConfigError
from ..launch_math import cdiv, next_pow2
from ..pdl import launch_options, pdl_trigger_late, pdl_wait_then_trigger, resolve_pdl
from .block_scales import fit_tile
from .gemv_tiles import k_range, row_acc, row_products, splitk_reduce, w_cols
from .proj_tiles import FP8_ROW_ELEMS, FP8_ROW_K, block_m, splitk_workspace
from .tile_table import Tile

W_CHANNEL, W_BLOCK = 1, 2  # W_FORMAT: scales per output channel, or per (bn, bk) block
MAX_M = 64  # rows one launch takes
X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
TARGET_PROGRAMS = 256  # split K until about two programs per SM of an H200 (132 SMs)


@triton.jit
def load_w_chunk(w_ptrs, k0, k_hi, mask_n, BLOCK_K: tl.constexpr):
    # w_ptrs: [BLOCK_N, BLOCK_K] pointers at k = 0 -> the e4m3 chunk at columns k0.. (columns
    # from k_hi on, and masked rows, read as 0); evict_first: never re-read this step
    offs_k = k0 + tl.arange(0, BLOCK_K)
    return tl.load(
        w_ptrs + k0,
        mask=mask_n[:, None] & (offs_k < k_hi)[None, :],
        other=0.0,
        eviction_policy="evict_first",
    )


@triton.jit
def chunk_scales(
    s_ptr,
    stride_sn,
    offs_n,
    mask_n,
    k0,
    W_FORMAT: tl.constexpr,
    SCALE_BN: tl.constexpr,
    SCALE_BK: tl.constexpr,
):
    # -> [BLOCK_N] float32: W_BLOCK, each row's block scale at column k0 (the whole chunk's:
    # BLOCK_K divides SCALE_BK); W_CHANNEL, each row's scale (masked rows: 0)
    if W_FORMAT == 2:
        s = tl.load(
            s_ptr + (offs_n // SCALE_BN) * stride_sn + k0 // SCALE_BK, mask=mask_n, other=0.0
        )
    else:
        s = tl.load(s_ptr + offs_n, mask=mask_n, other=0.0)
    return s


@triton.jit
def fp8_mul_acc(acc, w, x, s, W_FORMAT: tl.constexpr, BLOCK_M: tl.constexpr):
    # w: a [BLOCK_N, BLOCK_K] e4m3 chunk; s: its rows' chunk_scales (used by W_BLOCK only).
    # BLOCK_M == 1: x [BLOCK_K] float32, acc += (w * s) * x[None, :] in runs (row_products);
    # else x [BLOCK_M, BLOCK_K] in its dtype, acc [BLOCK_M, BLOCK_N] += (x @ w^T) * s[None, :]
    # on tensor cores (w converted to x's dtype, exactly)
    if BLOCK_M == 1:
        wf = w.to(tl.float32)
        if W_FORMAT == 2:
            wf = wf * s[:, None]
        acc = row_products(acc, wf, x)
    elif x.dtype == tl.float32:
        if W_FORMAT == 2:
            acc += tl.dot(x, tl.trans(w.to(tl.float32)), input_precision="ieee") * s[None, :]
        else:
            acc = tl.dot(x, tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
    else:
        if W_FORMAT == 2:
            acc += tl.dot(x, tl.trans(w.to(x.dtype))) * s[None, :]
        else:
            acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)
    return acc


@triton.jit
def channel_scaled(acc, s, W_FORMAT: tl.constexpr):
    # acc [BLOCK_M, BLOCK_N] float32 summed over K -> times the per-channel scales s [BLOCK_N]
    # (W_CHANNEL; block scales were applied per chunk)
    if W_FORMAT == 1:
        acc = acc * s[None, :]
    return acc


@triton.jit
def x_chunk(x_ptr, stride_xm, M, k0, k_hi, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    # -> x[:, k0:k0 + BLOCK_K] (columns from k_hi on: 0): [BLOCK_K] float32 when BLOCK_M == 1,
    # else [BLOCK_M, BLOCK_K] in x's dtype (the tl.dot operand; rows from M on: 0)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    if BLOCK_M == 1:
        x = tl.load(x_ptr + offs_k, mask=offs_k < k_hi, other=0.0).to(tl.float32)
    else:
        offs_m = tl.arange(0, BLOCK_M)
        mask = (offs_m < M)[:, None] & (offs_k < k_hi)[None, :]
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mask, other=0.0)
    return x


@triton.jit
def _fp8_gemv_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    bias_ptr,
    y_ptr,
    ws_ptr,
    ticket_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_ym,
    W_FORMAT: tl.constexpr,
    SCALE_BN: tl.constexpr,
    SCALE_BK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    USE_PDL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    k_lo, k_hi, pid_k = k_range(K, SPLIT_K, BLOCK_K)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    offs_k = w_cols(BLOCK_K, True, BLOCK_M)
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    # -- weights and scales only before the wait: they are never written during a step --
    w = load_w_chunk(w_ptrs, k_lo, k_hi, mask_n, BLOCK_K)
    s = chunk_scales(s_ptr, stride_sn, offs_n, mask_n, k_lo, W_FORMAT, SCALE_BN, SCALE_BK)
    pdl_wait_then_trigger(USE_PDL)
    if BLOCK_M == 1:
        acc = row_acc(BLOCK_N, BLOCK_K, True)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    x = x_chunk(x_ptr, stride_xm, M, k_lo, k_hi, BLOCK_M, BLOCK_K)
    acc = fp8_mul_acc(acc, w, x, s, W_FORMAT, BLOCK_M)
    for k0 in range(k_lo + BLOCK_K, k_hi, BLOCK_K):
        w = load_w_chunk(w_ptrs, k0, k_hi, mask_n, BLOCK_K)
        if W_FORMAT == 2:
            s = chunk_scales(s_ptr, stride_sn, offs_n, mask_n, k0, W_FORMAT, SCALE_BN, SCALE_BK)
        x = x_chunk(x_ptr, stride_xm, M, k0, k_hi, BLOCK_M, BLOCK_K)
        acc = fp8_mul_acc(acc, w, x, s, W_FORMAT, BLOCK_M)
    pdl_trigger_late(USE_PDL)
    if BLOCK_M == 1:
        acc = tl.sum(acc, axis=1)[None, :]  # [1, BLOCK_N]
    if SPLIT_K > 1:  # the last program of this column tile holds the sum; the others store none
        acc, _, rows = splitk_reduce(
            acc, acc, ws_ptr, ticket_ptr, pid_n, pid_k, False, SPLIT_K, BLOCK_M, BLOCK_N
        )
        mask_m = mask_m & (offs_m < rows)
    acc = channel_scaled(acc, s, W_FORMAT)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def fp8_tile(m: int, n: int, k: int, block: tuple[int, int] | None = None) -> Tile:
    """The default launch shape for ``m`` rows of an ``[n, k]`` FP8 weight (``block``: its
    scale blocks; ``BLOCK_K`` never exceeds their K). One row: the fused kernels' rule
    (``proj_tiles.FP8_ROW_K`` of K, ``FP8_ROW_ELEMS`` weights a chunk; on the H200 a plain
    one-row GEMV at 4 x 2048 ran within 5% of the best tile at the 8B's gate-up and down and
    the 1B's gate-up); several: 32 columns and 128 of K on tensor cores. Then split K
    (powers of two, each split two chunks or more) until about ``TARGET_PROGRAMS`` programs."""
    kcap = next_pow2(max(k, 16))
    if m <= 1:
        bk = min(kcap, FP8_ROW_K, block[1] if block else 1 << 30)
        bn, warps, stages = max(1, min(FP8_ROW_ELEMS // bk, next_pow2(n))), 4, None
    else:
        bk = min(kcap, 128, block[1] if block else 1 << 30)
        bn, warps, stages = 32, 4, 3
    programs, split = cdiv(n, bn), 1
    while programs * split < TARGET_PROGRAMS and k >= 4 * split * bk:
        split *= 2
    return Tile(bn, max(16, bk), warps, stages, split)


def _check(x, weight, scale, block, bias, out) -> tuple[int, int, int]:
    if x.dim() != 2 or x.dtype not in X_DTYPES or x.stride(-1) != 1:
        raise ConfigError(
            f"fp8_gemv: x must be [M, K] bfloat16, float16 or float32 with contiguous rows; got "
            f"{x.dtype} of shape {tuple(x.shape)}, strides {x.stride()}"
        )
    m, k = x.shape
    if m > MAX_M:
        raise ConfigError(f"fp8_gemv takes at most {MAX_M} rows; got {m}: split the batch")
    if weight.dim() != 2 or weight.dtype != torch.float8_e4m3fn or not weight.is_contiguous():
        raise ConfigError(
            f"fp8_gemv: weight must be a contiguous [N, K] torch.float8_e4m3fn tensor; got "
            f"{weight.dtype} of shape {tuple(weight.shape)}, contiguous={weight.is_contiguous()}"
        )
    n = weight.shape[0]
    if weight.shape[1] != k or k < 1:
        raise ConfigError(f"fp8_gemv: x has K = {k}, the weight {tuple(weight.shape)}")
    want = (n,) if block is None else (cdiv(n, block[0]), cdiv(k, block[1]))
    if scale.dtype != torch.float32 or tuple(scale.shape) != want or not scale.is_contiguous():
        raise ConfigError(
            f"fp8_gemv: scale must be contiguous float32 of shape {want}; got {scale.dtype} of "
            f"shape {tuple(scale.shape)}"
        )
    if block is not None and (block[0] < 1 or block[1] < 16 or block[1] & (block[1] - 1)):
        raise ConfigError(f"fp8_gemv: block {block}: K blocks must be a power of two >= 16")
    if bias is not None and (tuple(bias.shape) != (n,) or not bias.is_contiguous()):
        raise ConfigError(f"fp8_gemv: bias must be contiguous [{n}]; got {tuple(bias.shape)}")
    if out is not None and (tuple(out.shape) != (m, n) or out.stride(-1) != 1):
        raise ConfigError(f"fp8_gemv: out must be [{m}, {n}] with contiguous rows")
    devices = {t.device for t in (x, weight, scale, bias, out) if t is not None}
    if len(devices) != 1:
        raise ConfigError(f"fp8_gemv: tensors on several devices {sorted(map(str, devices))}")
    return m, n, k


def _check_tile(tile: Tile, m: int, block: tuple[int, int] | None) -> Tile:
    if tile.block_n < 1 or tile.block_k < 16 or tile.block_k & (tile.block_k - 1):
        raise ConfigError(f"fp8_gemv: {tile}: block_k must be a power of two >= 16")
    if m > 1 and tile.block_n < 16:
        raise ConfigError(f"fp8_gemv: {m} rows run on tensor cores, which need block_n >= 16")
    if block is not None and block[1] % tile.block_k:
        raise ConfigError(f"fp8_gemv: {tile}'s block_k must divide the scale blocks' {block[1]}")
    if tile.split_k < 1:
        raise ConfigError(f"fp8_gemv: {tile}: split_k must be >= 1")
    return tile


def fp8_gemv(
    x: torch.Tensor,  # [M, K], M <= 64, bf16 / float16 / float32, rows contiguous
    weight: torch.Tensor,  # [N, K] float8_e4m3fn, contiguous
    scale: torch.Tensor,  # float32 [N], or [ceil(N / bn), ceil(K / bk)] with block
    block: tuple[int, int] | None = None,  # (bn, bk): block scales; None: per channel
    bias: torch.Tensor | None = None,  # [N]
    *,
    out: torch.Tensor | None = None,  # [M, N], rows contiguous: written in place
    out_dtype: torch.dtype | None = None,  # default x.dtype (ignored with out)
    use_pdl: bool | int | None = None,  # None: where the device has it (kernels/pdl.py)
    tile: Tile | None = None,  # None: fp8_tile's
) -> torch.Tensor:  # [M, N]
    """``x @ (weight * scale).T + bias`` in one launch, float32 accumulation; inputs checked on
    the host (shapes, dtypes, contiguity, devices) with a ConfigError naming the fix."""
    if block is not None:
        if not (
            isinstance(block, (tuple, list))
            and len(block) == 2
            and all(isinstance(b, int) for b in block)
        ):
            got = block if isinstance(block, (tuple, list)) else type(block).__name__
            raise ConfigError(f"fp8_gemv: block must be None or (bn, bk) sizes; got {got}")
        block = (int(block[0]), int(block[1]))
    m, n, k = _check(x, weight, scale, block, bias, out)
    t = _check_tile(tile or fp8_tile(m, n, k, block), m, block)
    y = out if out is not None else x.new_empty(m, n, dtype=out_dtype or x.dtype)
    if m == 0 or n == 0:
        return y
    bm, tiles = block_m(m), cdiv(n, t.block_n)
    ws, tickets = y, y
    if t.split_k > 1:
        ws, tickets = splitk_workspace(x.device, tiles * t.split_k * t.block_n * bm, tiles)
    pdl = resolve_pdl(use_pdl, x.device)
    _fp8_gemv_kernel[(tiles, t.split_k)](
        x,
        weight,
        scale,
        bias if bias is not None else scale,
        y,
        ws,
        tickets,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        scale.stride(0),
        y.stride(0),
        W_FORMAT=W_CHANNEL if block is None else W_BLOCK,
        SCALE_BN=block[0] if block else 1,
        SCALE_BK=block[1] if block else 1,
        HAS_BIAS=bias is not None,
        USE_PDL=pdl,
        BLOCK_M=bm,
        BLOCK_N=t.block_n,
        BLOCK_K=t.block_k,
        SPLIT_K=t.split_k,
        **t.launch(),
        **launch_options(pdl),
    )
    return y


def fp8_scales(
    weight: torch.Tensor,
    w_scale: torch.Tensor | None,
    what: str,
    block: tuple[int, int] | None = None,
) -> int:
    """How a fused projection streams ``weight`` (its ``W_FP8``): 0 in its own dtype, else an
    e4m3 weight with float32 scales ``w_scale``, ``W_CHANNEL`` per output channel (``[N]``) or
    ``W_BLOCK`` per ``block = (bn, bk)`` (``[ceil(N / bn), ceil(K / bk)]``), contiguous and on
    its device; a ConfigError naming ``what`` otherwise."""
    fp8 = weight.dtype == torch.float8_e4m3fn
    if fp8 != (w_scale is not None):
        raise ConfigError(
            f"{what}: an e4m3 weight needs its scales (w_scale) and only an e4m3 weight takes "
            f"them; got a {weight.dtype} weight and w_scale "
            f"{'None' if w_scale is None else tuple(w_scale.shape)}"
        )
    if not fp8:
        if block is not None:
            raise ConfigError(f"{what}: w_block {block} without an e4m3 weight and its scales")
        return 0
    n, k = weight.shape
    if block is not None and (
        len(block) != 2 or min(block) < 1 or block[1] < 16 or block[1] & (block[1] - 1)
    ):
        raise ConfigError(f"{what}: w_block {block}: (bn, bk) with bk a power of two >= 16")
    want = (n,) if block is None else (cdiv(n, block[0]), cdiv(k, block[1]))
    if (
        w_scale.dtype != torch.float32
        or tuple(w_scale.shape) != want
        or not w_scale.is_contiguous()
        or w_scale.device != weight.device
    ):
        kind = "per output channel" if block is None else f"per {block[0]}x{block[1]} block"
        raise ConfigError(
            f"{what}: w_scale must be contiguous float32 {list(want)} on {weight.device} "
            f"({kind}); got {w_scale.dtype} {tuple(w_scale.shape)} on {w_scale.device}"
        )
    return W_CHANNEL if block is None else W_BLOCK


def scale_launch(
    fmt: int,
    kernel: str,
    tile: Tile,
    m: int,
    x: torch.Tensor,
    w_scale: torch.Tensor | None,
    block: tuple[int, int] | None,
    dummy: torch.Tensor,
    half: int | None = None,
    offset: int = 0,
) -> tuple[Tile, tuple[torch.Tensor, int], dict]:
    """A fused kernel's launch under ``fmt`` (``fp8_scales``): the tile (under block scales as
    ``block_scales.fit_tile`` runs it, or its ConfigError), the scale arguments ``(s_ptr,
    stride_sn)`` (``dummy`` for a weight without scales) and the constexprs ``SCALE_BN``,
    ``SCALE_BK``."""
    if fmt == W_BLOCK:
        tile = fit_tile(kernel, tile, m, x.element_size(), block, half, offset)
        return tile, (w_scale, w_scale.stride(0)), dict(SCALE_BN=block[0], SCALE_BK=block[1])
    return tile, ((w_scale if fmt else dummy), 0), dict(SCALE_BN=1, SCALE_BK=1)


def dequantize_reference(weight, scale, block=None, dtype=torch.float64) -> torch.Tensor:
    """``weight * scale`` element by element in ``dtype`` (block scales expanded, the last
    partial blocks taking their block's scale)."""
    w, s = weight.to(dtype), scale.to(dtype)
    if block is None:
        return w * s[:, None]
    n, k = weight.shape
    return w * s.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]


def fp8_gemv_reference(x, weight, scale, block=None, bias=None) -> torch.Tensor:
    """``fp8_gemv``'s float64 reference over the dequantized weights."""
    y = x.double() @ dequantize_reference(weight, scale, block).T
    return y + bias.double() if bias is not None else y


__all__ = [
    "MAX_M",
    "W_BLOCK",
    "W_CHANNEL",
    "channel_scaled",
    "chunk_scales",
    "dequantize_reference",
    "fp8_gemv",
    "fp8_gemv_reference",
    "fp8_mul_acc",
    "fp8_scales",
    "scale_launch",
    "fp8_tile",
    "load_w_chunk",
    "x_chunk",
]
