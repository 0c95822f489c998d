"""Weights into L2 in the shadow of a latency-bound kernel (the decode step's attention).

At short context the split-KV attention moves little memory but takes long: at bs 8, ctx 512
it reads 8 MB of K/V a layer (2 µs of the H200's bandwidth) in 7-9 µs of dependent latency,
and the HBM idles. ``shadow_prefetch`` has each attention program ask L2 for an equal share of
the lines of up to two weight regions the next kernels read (o_proj's weight, the first
columns of gate-up's), fire and forget (``prefetch.global.L2::evict_last``): nothing is held,
nothing is written, so no result depends on it and eager, graph and exact stay bit-identical
whatever is prefetched. The share follows the launch's grid, so mode exact's retuned split
counts spread it too.

A region is ``(weight [N, K], cols)``: the first ``cols`` of every row's ``K`` (whole 128-byte
lines). ``STEPGRAPH_SHADOW_PREFETCH`` chooses for the fused step (``shadow_spec``):
``0`` off, ``o`` o_proj's weight, ``o,gu=F`` and the first fraction ``F`` of gate-up's
columns; a trailing ``@end`` issues them after the attention's own work instead of before.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..errors import ConfigError
from .gemv_tiles import FENCE

SHADOW_ENV = "STEPGRAPH_SHADOW_PREFETCH"
SHADOW_DEFAULT = "0"
LINES = tl.constexpr(64)  # 128-byte lines a program asks for per loop step (read in kernels)
MAX_REGIONS = 2


@triton.jit
def shadow_prefetch(ptr, rows, stride, cols, LINES: tl.constexpr):
    # This program's share (by its linear id over a 3-D grid) of the 128-byte lines of
    # ptr[:rows, :cols] (row stride `stride` elements) into L2. Compiled only.
    if FENCE:
        pid = (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(
            2
        ) + tl.program_id(2)
        nprog = tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2)
        ELEM: tl.constexpr = ptr.dtype.element_ty.primitive_bitwidth // 8
        per_row = tl.cdiv(cols * ELEM, 128)
        total = rows * per_row
        share = tl.cdiv(total, nprog)
        lo = pid * share
        hi = tl.minimum(lo + share, total)
        for l0 in range(lo, hi, LINES):
            idx = tl.minimum(l0 + tl.arange(0, LINES), hi - 1)
            r = idx // per_row
            c = idx % per_row
            ptrs = ptr + r.to(tl.int64) * stride + c * (128 // ELEM)
            tl.inline_asm_elementwise(
                "prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs],
                dtype=tl.int32, is_pure=False, pack=1,
            )  # fmt: skip


@triton.jit
def shadow_regions(
    p1, rows1, stride1, cols1, p2, rows2, stride2, cols2, SHADOW: tl.constexpr,
):  # fmt: skip
    # The first SHADOW (0, 1 or 2) regions
    if SHADOW >= 1:
        shadow_prefetch(p1, rows1, stride1, cols1, LINES)
    if SHADOW >= 2:
        shadow_prefetch(p2, rows2, stride2, cols2, LINES)


def shadow_args(regions, dummy: torch.Tensor) -> tuple[list, int]:
    """The kernel arguments of ``regions`` (``[(weight, cols), ...]``, at most two): eight
    values, unused slots filled from ``dummy``, and the region count (``SHADOW``)."""
    regions = list(regions or ())
    if len(regions) > MAX_REGIONS:
        raise ConfigError(f"shadow prefetch: at most {MAX_REGIONS} regions, got {len(regions)}")
    args: list = []
    for w, cols in regions:
        if w.dim() != 2 or w.stride(1) != 1 or not 0 < cols <= w.shape[1]:
            raise ConfigError(
                f"shadow prefetch: a region is a 2-D weight with contiguous rows and 0 < cols "
                f"<= {w.shape[-1]} (got shape {tuple(w.shape)}, cols {cols})"
            )
        args += [w, w.shape[0], w.stride(0), cols]
    while len(args) < 4 * MAX_REGIONS:
        args += [dummy, 0, 0, 0]
    return args, len(regions)


def shadow_spec(value: str | None = None) -> tuple[bool, float, bool]:
    """``(o_proj, gate-up fraction, at end)`` from ``STEPGRAPH_SHADOW_PREFETCH`` (or ``value``):
    ``0``, ``o``, ``o,gu=0.25``, each optionally with ``@end``."""
    raw = (os.environ.get(SHADOW_ENV, SHADOW_DEFAULT) if value is None else value).strip()
    body, _, where = raw.partition("@")
    if where not in ("", "end"):
        raise ConfigError(f"{SHADOW_ENV}={raw!r}: the suffix is @end or nothing")
    o, gu = False, 0.0
    for part in filter(None, (p.strip() for p in body.split(","))):
        if part == "0":
            continue
        if part == "o":
            o = True
        elif part.startswith("gu="):
            try:
                gu = float(part[3:])
            except ValueError:
                gu = -1.0
            if not 0.0 < gu <= 1.0:
                raise ConfigError(f"{SHADOW_ENV}={raw!r}: gu=F needs 0 < F <= 1")
        else:
            raise ConfigError(f"{SHADOW_ENV}={raw!r}: give 0, o, or o,gu=F (optionally @end)")
    return o, gu, where == "end"


def shadow_kwargs(o_weight: torch.Tensor, gate_up_weight: torch.Tensor, spec) -> dict:
    """``flash_decode``'s ``shadow`` / ``shadow_end`` for one layer under ``spec``
    (``shadow_spec``'s triple): o_proj's weight, the first columns of gate-up's; ``{}`` off."""
    o, gu, end = spec
    regions = [(o_weight, o_weight.shape[1])] if o else []
    if gu > 0:
        regions.append((gate_up_weight, max(1, int(gate_up_weight.shape[1] * gu))))
    return {"shadow": regions, "shadow_end": end} if regions else {}


__all__ = [
    "SHADOW_ENV",
    "shadow_kwargs",
    "shadow_args",
    "shadow_prefetch",
    "shadow_regions",
    "shadow_spec",
]
