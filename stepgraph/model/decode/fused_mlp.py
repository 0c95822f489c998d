"""The fused step's second half of a layer: o_proj, gate-up, down, as three launches.

    r = r + o_proj(o)        residual add in the GEMV epilogue (the norm handoff beside it)
    a = gate_up_silu(r)      norm (or the handoff's), gate-up, SiLU * up
    r = r + down(a)          residual add (the handoff to the next norm)

Each choice is the step's plan's (``model/decode/step_plan.py``): this module executes it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...kernels.elementwise.fused_act import silu_mul
from ...kernels.proj.gate_up_silu import gate_up_silu
from ...kernels.proj.norm_gemv import gemv_residual
from ...tuning import DecodeTuning, default_tuning
from ..fp8_linear import scale_kwargs
from ..parallel import RowParallelLinear
from .step_plan import CUBLAS, HANDOFF, SEPARATE, StepPlan


def row(
    x: torch.Tensor,
    proj,
    r: torch.Tensor,
    use_pdl,
    next_norm=None,
    tuning: DecodeTuning | None = None,
    blocks=None,
):
    """``(r + x @ W.T, handoff)`` in one launch; ``handoff`` is ``(r * next_norm, its sums of
    squares)`` given the next norm's weight (``kernels/proj/norm_handoff``, unsharded), else None.
    A row-parallel shard: rank 0 adds the residual in the epilogue, the others project alone,
    and the in-place all-reduce sums them, so every rank holds the same ``r + sum of the
    partials`` (rounded once more than the reference path's ``r + all_reduce(partials)``: the
    two agree within bf16 rounding, not bit for bit)."""
    if type(proj) is not RowParallelLinear or proj.world_size == 1:
        out = gemv_residual(
            x,
            proj.weight,
            r,
            use_pdl=use_pdl,
            blocks=blocks,
            next_norm=next_norm,
            tuning=tuning,
            **scale_kwargs(proj),
        )
        if next_norm is None:
            return out, None
        y, xw, ssq = out
        return y, (xw, ssq)
    y = gemv_residual(
        x,
        proj.weight,
        r if dist.get_rank(proj.group) == 0 else None,
        use_pdl=use_pdl,
        blocks=blocks,
        tuning=tuning,
    )
    dist.all_reduce(y, group=proj.group)  # in place, on the stream: graph-capturable
    return y, None


def mlp_half(
    model,
    i: int,
    o: torch.Tensor,
    r: torch.Tensor,
    plan: StepPlan,
    use_pdl,
    tuning: DecodeTuning | None = None,
    last: bool = False,
):
    """Layer ``i``'s o_proj, gate-up and down on the attention's rows ``o`` ``[bs, heads *
    head_dim]`` and the residual ``r``, as ``plan`` (``model/decode/step_plan``) says: ``(r,
    hand)``, ``hand`` the handoff to the next norm (layer ``i + 1``'s, or the final one where
    ``last``) where the plan's down leaves it, else None."""
    t = default_tuning(tuning)
    layer = model.layers[i]
    attn, mlp, norm2 = layer.self_attn, layer.mlp, layer.post_attention_layernorm
    down = plan.down_last if last else plan.down
    nw_next = (model.norm if last else model.layers[i + 1].input_layernorm).weight
    gate_up, w_gu = plan.gate_up, mlp.gate_up_proj.weight
    fp8_gu = scale_kwargs(mlp.gate_up_proj)
    r, hand = row(
        o, attn.o_proj, r, use_pdl, norm2.weight if plan.o_proj.hands else None, t, plan.o_proj.tile
    )
    if gate_up.how == CUBLAS:
        a = silu_mul(mlp.gate_up_proj(norm2(r)[0]))  # norm, GEMM, SiLU·mul
    elif gate_up.how == HANDOFF:  # x = r * norm2.weight, the rows scaled by o_proj's 1 / RMS
        a = gate_up_silu(
            hand[0],
            None,
            w_gu,
            norm2.eps,
            use_pdl=use_pdl,
            blocks=gate_up.tile,
            ssq=hand[1],
            tuning=t,
            **fp8_gu,
        )
    elif gate_up.how == SEPARATE:
        a = gate_up_silu(
            norm2(r)[0],
            None,
            w_gu,
            norm2.eps,
            use_pdl=use_pdl,
            blocks=gate_up.tile,
            tuning=t,
            **fp8_gu,
        )
    else:
        a = gate_up_silu(
            r,
            norm2.weight,
            w_gu,
            norm2.eps,
            use_pdl=use_pdl,
            blocks=gate_up.tile,
            tuning=t,
            **fp8_gu,
        )
    return row(a, mlp.down_proj, r, use_pdl, nw_next if down.hands else None, t, down.tile)


__all__ = ["mlp_half", "row"]
