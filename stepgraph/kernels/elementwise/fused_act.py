"""SwiGLU activation ``silu(gate) * up`` from the fused gate-up projection, in one Triton kernel,
and its torch reference. Rounds ``silu(gate)`` to the dtype before the product, as torch does."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ..launch_math import cdiv


@triton.jit
def _silu_mul_kernel(
    gate_up_ptr,
    out_ptr,
    stride_g,
    stride_o,
    INTER,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTER
    gate = tl.load(gate_up_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_g + INTER + cols, mask=mask, other=0.0)
    act = (gate * tl.sigmoid(gate)).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(
        out_ptr + row * stride_o + cols,
        (act * up.to(tl.float32)).to(out_ptr.dtype.element_ty),
        mask=mask,
    )


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
    return F.silu(gate) * up


def silu_mul(gate_up: torch.Tensor, block: int = 1024) -> torch.Tensor:  # [T, 2I] -> [T, I]
    """``silu(gate_up[:, :I]) * gate_up[:, I:]`` in one launch (rows contiguous)."""
    t, two_i = gate_up.shape
    inter = two_i // 2
    out = torch.empty(t, inter, dtype=gate_up.dtype, device=gate_up.device)
    if t:
        _silu_mul_kernel[(t, cdiv(inter, block))](
            gate_up, out, gate_up.stride(0), out.stride(0), inter, BLOCK=block, num_warps=4
        )
    return out


__all__ = ["silu_mul", "silu_mul_reference"]
