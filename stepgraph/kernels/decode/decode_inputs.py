"""What ``flash_decode`` takes besides tensors: the workspace of fp32 partials, the kernel
variant (``KernelVariant``), and the attribute-only checks of its inputs (no device sync)."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ...errors import ConfigError
from .splits import BLOCK_N

HEAD_DIMS = (16, 32, 64, 128, 256)  # powers of two (tl.arange); 64 and 128 are the tuned ones
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class KernelVariant:
    """One variant of the split-KV main kernel; every field is a constexpr or a launch option.

    ``page_tile`` takes the one-lookup-per-tile path when ``page_size % block_n == 0`` (a tile
    then lies in one page: one block-table load, contiguous slots); otherwise it is ignored.
    ``k_rows`` loads K as ``[block_n, head_dim]`` and computes ``q @ tl.trans(k)`` (the
    layout of the Triton attention tutorial); False loads the ``[head_dim, block_n]`` K^T tile.
    ``use_dot`` computes both products with ``tl.dot`` (the GQA group padded to 16 rows);
    False uses broadcast multiply-and-sum on the CUDA cores, with the group padded to a power
    of two only.
    """

    block_n: int = BLOCK_N  # keys per tile
    num_warps: int = 4
    num_stages: int = 2  # software-pipelining depth of the K/V loads
    page_tile: bool = True
    k_rows: bool = True
    use_dot: bool = True

    def __post_init__(self) -> None:
        ok_n = self.block_n >= 16 and self.block_n & (self.block_n - 1) == 0
        if not ok_n or self.num_warps not in (1, 2, 4, 8, 16) or self.num_stages < 1:
            raise ConfigError(
                f"KernelVariant: block_n must be a power of two >= 16, num_warps one of "
                f"1, 2, 4, 8, 16 and num_stages >= 1; got {self}"
            )

    @classmethod
    def from_name(cls, name: str) -> KernelVariant:
        """The variant ``name`` spells (``n64w4s3``, flags ``-kt``, ``-pk``, ``-fma``)."""
        m = re.fullmatch(r"n(\d+)w(\d+)s(\d+)((?:-kt|-pk|-fma)*)", name)
        if m is None:
            raise ConfigError(
                f"KernelVariant name {name!r}: expected n<block_n>w<warps>s<stages> and flags "
                "-kt, -pk, -fma, e.g. n64w4s3 or n128w4s2-kt"
            )
        flags = m.group(4)
        return cls(
            int(m.group(1)),
            int(m.group(2)),
            int(m.group(3)),
            page_tile="-pk" not in flags,
            k_rows="-kt" not in flags,
            use_dot="-fma" not in flags,
        )

    @property
    def name(self) -> str:
        """Short id, e.g. ``n64w4s3`` (+ ``-kt`` K^T tile, ``-pk`` per-key lookup, ``-fma``)."""
        flags = "" if self.k_rows else "-kt"
        flags += "" if self.page_tile else "-pk"
        flags += "" if self.use_dot else "-fma"
        return f"n{self.block_n}w{self.num_warps}s{self.num_stages}{flags}"


@dataclass
class DecodeWorkspace:
    """The fp32 partials of the split-KV kernel. A captured graph owns one; rows ``[:bs]`` of a
    workspace allocated for ``max_bs`` serve every smaller batch."""

    partial_o: torch.Tensor  # [max_bs, n_heads, max_splits, head_dim] fp32
    partial_lse: torch.Tensor  # [max_bs, n_heads, max_splits] fp32
    # [max_bs * n_heads] int32, zero between launches: the folded kernel's per-(request, KV
    # head) tickets (``split_kv_fold``); None: that kernel cannot use this workspace
    tickets: torch.Tensor | None = None

    @property
    def max_splits(self) -> int:
        return self.partial_lse.shape[2]

    @classmethod
    def allocate(
        cls, bs: int, n_heads: int, head_dim: int, max_splits: int, device: torch.device | str
    ) -> DecodeWorkspace:
        o = torch.empty(bs, n_heads, max_splits, head_dim, dtype=torch.float32, device=device)
        lse = torch.empty(bs, n_heads, max_splits, dtype=torch.float32, device=device)
        tickets = torch.zeros(max(bs, 1) * n_heads, dtype=torch.int32, device=device)
        return cls(o, lse, tickets)


def _fail(name: str, expected: str, given: object, fix: str = "") -> ConfigError:
    return ConfigError(f"flash_decode: {name} must be {expected}, got {given}. {fix}".rstrip())


def _check_inputs(q, k_cache, v_cache, block_table, seq_lens, workspace, out, max_splits) -> None:
    """Attribute-only checks (no device sync): shapes, dtypes, devices, strides."""
    if q.dim() != 3:
        raise _fail("q", "[bs, n_heads, head_dim]", f"shape {tuple(q.shape)}")
    bs, n_heads, hd = q.shape
    if k_cache.dim() != 4 or k_cache.shape[3] != hd:
        raise _fail("k_cache", f"[num_pages, page_size, n_kv_heads, {hd}]", tuple(k_cache.shape))
    n_pages, page_size, n_kv = k_cache.shape[:3]
    if tuple(v_cache.shape) != tuple(k_cache.shape):
        raise _fail("v_cache", f"shaped like k_cache {tuple(k_cache.shape)}", tuple(v_cache.shape))
    if hd not in HEAD_DIMS:
        raise _fail("head_dim (q.shape[2])", f"one of {HEAD_DIMS}", hd)
    if n_kv == 0 or n_heads % n_kv:
        raise _fail("n_heads (q.shape[1])", f"a multiple of n_kv_heads={n_kv}", n_heads)
    if block_table.dim() != 2 or block_table.shape[0] != bs:
        raise _fail("block_table", f"[{bs}, max_pages]", tuple(block_table.shape))
    if tuple(seq_lens.shape) != (bs,):
        raise _fail("seq_lens", f"[{bs}]", tuple(seq_lens.shape))
    if out is not None and tuple(out.shape) != (bs, n_heads, hd):
        raise _fail("out", f"[{bs}, {n_heads}, {hd}]", tuple(out.shape))
    if q.dtype not in DTYPES:
        raise _fail("q.dtype", f"one of {DTYPES}", q.dtype)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("out", out)):
        if t is not None and t.dtype != q.dtype:
            raise _fail(f"{name}.dtype", f"q.dtype={q.dtype}", t.dtype)
    for name, t in (("block_table", block_table), ("seq_lens", seq_lens)):
        if t.dtype != torch.int32:
            raise _fail(f"{name}.dtype", "torch.int32", t.dtype)
    if workspace is not None:
        po, lse = workspace.partial_o, workspace.partial_lse
        ms = workspace.max_splits
        if lse.dim() != 3 or lse.shape[0] < bs or lse.shape[1] != n_heads:
            raise _fail(
                "workspace.partial_lse", f"[>={bs}, {n_heads}, max_splits]", tuple(lse.shape)
            )
        if tuple(po.shape[1:]) != (n_heads, ms, hd) or po.shape[0] < bs:
            raise _fail("workspace.partial_o", f"[>={bs}, {n_heads}, {ms}, {hd}]", tuple(po.shape))
        if po.dtype != torch.float32 or lse.dtype != torch.float32:
            raise _fail("workspace partials", "float32", f"{po.dtype} / {lse.dtype}")
        if max_splits > ms:
            raise _fail("max_splits", f"<= workspace.max_splits={ms}", max_splits)
    tensors = [("k_cache", k_cache), ("v_cache", v_cache), ("block_table", block_table)]
    tensors += [("seq_lens", seq_lens), ("out", out)]
    if workspace is not None:
        tensors += [("workspace.partial_o", po), ("workspace.partial_lse", lse)]
    for name, t in tensors:
        if t is not None and t.device != q.device:
            raise _fail(f"{name}.device", f"q.device={q.device}", t.device, "Move it first.")
    for name, t in [("q", q), *tensors]:
        if t is not None and t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
            raise _fail(f"{name}.stride(-1)", "1", t.stride(-1), "Call .contiguous() first.")


__all__ = ["DTYPES", "HEAD_DIMS", "DecodeWorkspace", "KernelVariant"]
