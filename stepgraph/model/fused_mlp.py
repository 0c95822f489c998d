"""The fused step's second half of a layer: o_proj, gate-up, down, as three launches.

    r = r + o_proj(o)        residual add in the GEMV epilogue (the norm handoff beside it)
    a = gate_up_silu(r)      norm (or the handoff's), gate-up, SiLU * up
    r = r + down(a)          residual add (the handoff to the next norm)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..kernels.fused_act import silu_mul
from ..kernels.gate_up_silu import gate_up_silu
from ..kernels.norm_gemv import gemv_residual
from ..kernels.proj_tiles import prefer_cublas, separate_norm
from ..tuning import DecodeTuning, default_tuning
from .parallel import RowParallelLinear


def cublas(lin, kernel: str, bs: int, tuning: DecodeTuning | None = None) -> bool:
    """Whether the step runs ``lin`` (a consumer of a norm) as norm + cuBLAS at ``bs`` rows."""
    tables = default_tuning(tuning).tables
    return prefer_cublas(kernel, bs, *lin.weight.shape, lin.weight.element_size(), tables)


def row(x: torch.Tensor, proj, r: torch.Tensor, use_pdl, next_norm=None,
        tuning: DecodeTuning | None = None):  # fmt: skip
    """``(r + x @ W.T, handoff)`` in one launch; ``handoff`` is ``(r * next_norm, its sums of
    squares)`` given the next norm's weight (``kernels/norm_handoff``, unsharded), else None.
    A row-parallel shard: rank 0 adds the residual in the epilogue, the others project alone,
    and the in-place all-reduce sums them, so every rank holds the same ``r + sum of the
    partials`` (rounded once more than the reference path's ``r + all_reduce(partials)``: the
    two agree within bf16 rounding, not bit for bit)."""
    if type(proj) is not RowParallelLinear or proj.world_size == 1:
        if next_norm is not None:
            y, xw, ssq = gemv_residual(x, proj.weight, r, use_pdl=use_pdl, next_norm=next_norm,
                                       tuning=tuning)  # fmt: skip
            return y, (xw, ssq)
        return gemv_residual(x, proj.weight, r, use_pdl=use_pdl, tuning=tuning), None
    y = gemv_residual(x, proj.weight, r if dist.get_rank(proj.group) == 0 else None,
                      use_pdl=use_pdl, tuning=tuning)  # fmt: skip
    dist.all_reduce(y, group=proj.group)  # in place, on the stream: graph-capturable
    return y, None


def mlp_half(model, i: int, o: torch.Tensor, r: torch.Tensor, ho: bool, use_pdl,
             tuning: DecodeTuning | None = None):  # fmt: skip
    """Layer ``i``'s o_proj, gate-up and down on the attention's rows ``o`` ``[bs, heads *
    head_dim]`` and the residual ``r``: ``(r, hand)``, ``hand`` the handoff to the next norm
    (layer ``i + 1``'s, or the final one) where ``ho`` and its consumer is fused, else None.
    A cuBLAS qkv or LM head takes the handoff too unless ``tuning.handoff.cublas`` is off (the
    norm as its own kernel before it then)."""
    t = default_tuning(tuning)
    layer, bs = model.layers[i], r.shape[0]
    attn, mlp, norm2 = layer.self_attn, layer.mlp, layer.post_attention_layernorm
    if i < len(model.layers) - 1:
        nxt = (model.layers[i + 1].input_layernorm, model.layers[i + 1].self_attn.qkv_proj,
               "qkv_rope")  # fmt: skip
    else:
        nxt = (model.norm, model.lm_head, "lm_head")
    # the next norm's handoff where its consumer is fused, and into a cuBLAS qkv or LM head (the
    # GEMM of r * norm_w, its rows scaled by 1 / RMS after it: fused_decode)
    plain = nxt[2] == "qkv_rope" or getattr(nxt[1], "bias", None) is None  # the head's: none
    takes = not cublas(*nxt[1:], bs, t) or (t.handoff.cublas and plain)
    nw_next = nxt[0].weight if ho and takes else None
    w_gu = mlp.gate_up_proj.weight
    gu_cublas = cublas(mlp.gate_up_proj, "gate_up_silu", bs, t)
    nw = norm2.weight if ho and not gu_cublas else None
    r, hand = row(o, attn.o_proj, r, use_pdl, nw, t)
    if gu_cublas:
        a = silu_mul(mlp.gate_up_proj(norm2(r)[0]))  # norm, GEMM, SiLU·mul
    elif hand is not None:  # x = r * norm2.weight, the rows scaled by o_proj's 1 / RMS
        a = gate_up_silu(hand[0], None, w_gu, norm2.eps, use_pdl=use_pdl, ssq=hand[1], tuning=t)
    elif separate_norm("gate_up_silu", bs, *w_gu.shape, w_gu.element_size(), t.tables):
        a = gate_up_silu(norm2(r)[0], None, w_gu, norm2.eps, use_pdl=use_pdl, tuning=t)
    else:
        a = gate_up_silu(r, norm2.weight, w_gu, norm2.eps, use_pdl=use_pdl, tuning=t)
    return row(a, mlp.down_proj, r, use_pdl, nw_next, t)


__all__ = ["cublas", "mlp_half", "row"]
