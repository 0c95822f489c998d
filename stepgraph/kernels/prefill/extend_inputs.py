"""What ``extend_attention`` takes besides tensors (``ExtendTile``: the tile and launch options)
and its host-side input checks: attributes only (shape, dtype, device, stride), no device sync,
since the launcher runs once per layer per prefill step."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...errors import ConfigError

HEAD_DIMS = (16, 32, 64, 128, 256)  # powers of two (tl.arange); 64 and 128 are the tuned ones
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class ExtendTile:
    """Tile shape and launch options of ``_extend_kernel``: queries and keys per tile, warps,
    and the software-pipelining depth of the K/V loads."""

    block_m: int = 128
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        pow2 = all(
            isinstance(x, int) and x >= 16 and x & (x - 1) == 0
            for x in (self.block_m, self.block_n)
        )
        if not pow2 or self.num_warps not in (1, 2, 4, 8, 16) or self.num_stages < 1:
            raise ConfigError(
                f"ExtendTile: block_m and block_n must be powers of two >= 16, num_warps one of "
                f"1, 2, 4, 8, 16 and num_stages >= 1; got {self}"
            )

    @property
    def name(self) -> str:
        """Short id, e.g. ``m128n64w4s3``."""
        return f"m{self.block_m}n{self.block_n}w{self.num_warps}s{self.num_stages}"


def _fail(msg: str) -> None:
    raise ConfigError(f"extend_attention: {msg}")


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)  # True is an int in Python


def _check_index(name: str, t: object, dim: int, device: torch.device, what: str) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != dim:
        _fail(f"{name} must be a {dim}-d tensor ({what}), got {_shape_of(t)}.")
    if t.dtype != torch.int32:
        _fail(f"{name} must be int32, got {t.dtype}; pass {name}.to(torch.int32).")
    if t.device != device:
        _fail(f"{name} is on {t.device} but q is on {device}; move it to q's device.")


def _shape_of(t: object) -> str:
    return f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__


def check_extend_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_lens: torch.Tensor,
    block_table: torch.Tensor,
    max_q_len: int,
    sm_scale: float,
    out: torch.Tensor | None,
    tile: ExtendTile | None,
    *,
    interpreted: bool,
) -> None:
    """Raise ``ConfigError`` naming the argument and the fix; reads no tensor's values."""
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        _fail(f"q must be [T, n_heads, head_dim], got {_shape_of(q)}.")
    total, n_heads, head_dim = q.shape
    if q.dtype not in DTYPES:
        _fail(f"q has dtype {q.dtype}; use one of float16, bfloat16, float32.")
    if q.stride(-1) != 1:
        _fail("q's last dim must be contiguous (stride 1); pass q.contiguous().")
    if q.device.type != "cuda" and not interpreted:
        _fail(
            f"q is on {q.device}; the Triton kernel needs a CUDA device (TRITON_INTERPRET=1 runs "
            "it on the CPU). On the CPU use extend_reference.extend_attention_torch."
        )
    if head_dim not in HEAD_DIMS:
        _fail(f"head_dim {head_dim} is not supported; supported: {', '.join(map(str, HEAD_DIMS))}.")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(c, torch.Tensor) or c.dim() != 4:
            _fail(
                f"{name} must be [num_pages, page_size, n_kv_heads, head_dim], got {_shape_of(c)}."
            )
        if c.dtype != q.dtype:
            _fail(f"{name} has dtype {c.dtype} but q has {q.dtype}; use one dtype for both.")
        if c.device != q.device:
            _fail(f"{name} is on {c.device} but q is on {q.device}; move it to q's device.")
        if not c.is_contiguous():
            _fail(f"{name} must be contiguous; pass {name}.contiguous().")
    if v_cache.shape != k_cache.shape:
        _fail(f"v_cache {tuple(v_cache.shape)} must match k_cache {tuple(k_cache.shape)}.")
    n_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        _fail(f"k_cache head_dim {k_cache.shape[3]} differs from q's {head_dim}.")
    if n_kv_heads == 0 or n_heads % n_kv_heads:
        _fail(
            f"n_heads={n_heads} must be a multiple of n_kv_heads={n_kv_heads} (GQA: query head "
            "h reads KV head h // (n_heads // n_kv_heads)); check the cache's head count."
        )
    _check_index("kv_lens", kv_lens, 1, q.device, "[bs]: prefix_len + q_len per request")
    bs = kv_lens.shape[0]
    _check_index("qo_indptr", qo_indptr, 1, q.device, "[bs + 1]: cumulative new tokens")
    if qo_indptr.shape[0] != bs + 1:
        _fail(f"qo_indptr has {qo_indptr.shape[0]} entries; kv_lens has bs={bs}, so bs + 1.")
    _check_index("block_table", block_table, 2, q.device, "[bs, max_pages]: each request's pages")
    if block_table.shape[0] != bs or block_table.stride(-1) != 1:
        _fail(
            f"block_table {tuple(block_table.shape)} must have bs={bs} rows and a contiguous "
            "last dim; pass one row per request."
        )
    if not _is_int(max_q_len):
        _fail(f"max_q_len must be a host int (the longest q_len), got {max_q_len!r}.")
    if total > 0 and not (1 <= max_q_len <= total and max_q_len * bs >= total):
        _fail(
            f"max_q_len={max_q_len} cannot be the longest q_len of {bs} requests with T={total} "
            f"new tokens: it must lie in [ceil(T / bs), T]; pass max(q_lens)."
        )
    if (
        not isinstance(sm_scale, (int, float))
        or isinstance(sm_scale, bool)
        or not (math.isfinite(sm_scale) and sm_scale > 0)
    ):
        _fail(
            f"sm_scale must be a positive finite float (usually head_dim ** -0.5), "
            f"got {sm_scale!r}."
        )
    if out is not None:
        if not isinstance(out, torch.Tensor) or out.shape != q.shape:
            _fail(f"out must have q's shape {tuple(q.shape)}, got {_shape_of(out)}.")
        if out.dtype != q.dtype or out.device != q.device:
            _fail(f"out is {out.dtype} on {out.device}; it must be q's {q.dtype} on {q.device}.")
        if out.stride(-1) != 1:
            _fail("out's last dim must be contiguous (stride 1).")
    if tile is not None and not isinstance(tile, ExtendTile):
        _fail(f"tile must be an ExtendTile or None, got {type(tile).__name__}.")


__all__ = ["DTYPES", "HEAD_DIMS", "ExtendTile", "check_extend_inputs"]
