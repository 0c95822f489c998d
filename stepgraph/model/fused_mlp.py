"""The fused step's second half of a layer: o_proj, gate-up, down, as three launches or as one
persistent launch (``kernels/mlp_block``).

    r = r + o_proj(o)        residual add in the GEMV epilogue (the norm handoff beside it)
    a = gate_up_silu(r)      norm (or the handoff's), gate-up, SiLU * up
    r = r + down(a)          residual add (the handoff to the next norm)

``MLP_BLOCK`` (``STEPGRAPH_MLP_BLOCK=1``; off by default: it measured slower on the H200, bs 8
1.169 against 1.095 ms, docs/results.md H2) runs the
three as ``mlp_block`` wherever the step takes the norm handoff into a fused gate-up (bucket 8
on, unsharded) and the block can run the three kernels' tiles (``block_tiles``).
``ONE_ROW`` (``STEPGRAPH_MLP_BLOCK_ONE_ROW=1``) adds bs 1, with the handoff taken there too.
``BLOCK_QKV`` (``STEPGRAPH_MLP_BLOCK=qkv``) also runs the next layer's ``qkv_rope`` in the same
launch where that layer would take it fused on the handoff, and hands its q to the step. Both
ways compute the same sums in the same order (bit for bit at the 1B's tiles: tests/
test_mlp_block.py and its GPU tests), and the choice is a function of the bucket, so eager,
graph and exact agree.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ..errors import ConfigError
from ..kernels.fused_act import silu_mul
from ..kernels.gate_up_silu import gate_up_silu
from ..kernels.mlp_block import NextQkv, block_tiles, mlp_block
from ..kernels.norm_gemv import gemv_residual
from ..kernels.proj_tiles import prefer_cublas, separate_norm
from .parallel import RowParallelLinear

# STEPGRAPH_MLP_BLOCK=1: the block; =qkv: the block with the next layer's qkv in it too
MLP_BLOCK = os.environ.get("STEPGRAPH_MLP_BLOCK", "0") in ("1", "qkv")
BLOCK_QKV = os.environ.get("STEPGRAPH_MLP_BLOCK", "0") == "qkv"
# STEPGRAPH_MLP_BLOCK_ONE_ROW=1: the block at bs 1 too (its one-row tiles; the step then takes
# the norm handoff at bs 1, fused_decode.handoff)
ONE_ROW = os.environ.get("STEPGRAPH_MLP_BLOCK_ONE_ROW", "0") == "1"
# STEPGRAPH_CUBLAS_HANDOFF=0: where qkv or the LM head runs on cuBLAS (tile_table.CUBLAS), the
# norm as its own kernel before it, not the handoff's x into the GEMM and the 1 / RMS applied
# after it (by the RoPE kernel; by head_scale, with the greedy tokens)
CUBLAS_HANDOFF = os.environ.get("STEPGRAPH_CUBLAS_HANDOFF", "1") != "0"


def cublas(lin, kernel: str, bs: int) -> bool:
    """Whether the step runs ``lin`` (a consumer of a norm) as norm + cuBLAS at ``bs`` rows."""
    return prefer_cublas(kernel, bs, *lin.weight.shape, lin.weight.element_size())


def row(x: torch.Tensor, proj, r: torch.Tensor, use_pdl, next_norm=None):
    """``(r + x @ W.T, handoff)`` in one launch; ``handoff`` is ``(r * next_norm, its sums of
    squares)`` given the next norm's weight (``kernels/norm_handoff``, unsharded), else None.
    A row-parallel shard: rank 0 adds the residual in the epilogue, the others project alone,
    and the in-place all-reduce sums them, so every rank holds the same ``r + sum of the
    partials`` (rounded once more than the reference path's ``r + all_reduce(partials)``: the
    two agree within bf16 rounding, not bit for bit)."""
    if type(proj) is not RowParallelLinear or proj.world_size == 1:
        if next_norm is not None:
            y, xw, ssq = gemv_residual(x, proj.weight, r, use_pdl=use_pdl, next_norm=next_norm)
            return y, (xw, ssq)
        return gemv_residual(x, proj.weight, r, use_pdl=use_pdl), None
    y = gemv_residual(x, proj.weight, r if dist.get_rank(proj.group) == 0 else None,
                      use_pdl=use_pdl)  # fmt: skip
    dist.all_reduce(y, group=proj.group)  # in place, on the stream: graph-capturable
    return y, None


def block_serves(bs: int, h: int, ka: int, inter: int, elem_bytes: int, ho: bool) -> bool:
    """From the shapes alone (``o_proj`` ``[h, ka]``, down ``[h, inter]``): whether the second
    half at ``bs`` rows runs as one ``mlp_block`` launch: ``MLP_BLOCK``, the norm handoff on
    (``ho``), gate-up fused (not norm + cuBLAS), and the block's tiles valid."""
    if not (MLP_BLOCK and ho) or prefer_cublas("gate_up_silu", bs, 2 * inter, h, elem_bytes):
        return False
    if bs == 1 and not ONE_ROW:
        return False
    try:
        block_tiles(bs, h, ka, inter, elem_bytes)
    except ConfigError:
        return False
    return True


def one_row_block(model) -> bool:
    """Whether the block serves bs 1 (``ONE_ROW``): the step then takes the norm handoff there
    too, into the block's gate-up and from its down (``fused_decode.handoff``)."""
    o_w, d_w = model.layers[0].self_attn.o_proj.weight, model.layers[0].mlp.down_proj.weight
    return block_serves(1, *o_w.shape, d_w.shape[1], o_w.element_size(), True)


def use_block(layer, bs: int, ho: bool) -> bool:
    """``block_serves`` for ``layer``'s weights."""
    o_w, d_w = layer.self_attn.o_proj.weight, layer.mlp.down_proj.weight
    return block_serves(bs, *o_w.shape, d_w.shape[1], o_w.element_size(), ho)


def _next_qkv(model, i: int, bs: int, step) -> NextQkv | None:
    """Layer ``i + 1``'s qkv inputs for the block (``BLOCK_QKV``) where that layer would run
    ``qkv_rope`` on the handoff and the block can take its tile; else None. ``step``:
    ``(positions, k_caches, v_caches, slots, n_heads)`` of this step."""
    if not BLOCK_QKV or step is None or i + 1 >= len(model.layers):
        return None
    attn, norm1 = model.layers[i + 1].self_attn, model.layers[i + 1].input_layernorm
    w = attn.qkv_proj.weight
    if cublas(attn.qkv_proj, "qkv_rope", bs):
        return None
    positions, k_caches, v_caches, slots, n_heads = step
    half = k_caches[i + 1].shape[3] // 2
    o_w, d_w = model.layers[i].self_attn.o_proj.weight, model.layers[i].mlp.down_proj.weight
    try:
        block_tiles(bs, *o_w.shape, d_w.shape[1], w.element_size(), (w.shape[0], half))
    except ConfigError:
        return None
    return NextQkv(w, attn.qkv_proj.bias, norm1.eps, positions, model.rope_cos, model.rope_sin,
                   k_caches[i + 1], v_caches[i + 1], slots, n_heads)  # fmt: skip


def mlp_half(model, i: int, o: torch.Tensor, r: torch.Tensor, ho: bool, use_pdl, step=None):
    """Layer ``i``'s o_proj, gate-up and down on the attention's rows ``o`` ``[bs, heads *
    head_dim]`` and the residual ``r``: ``(r, hand, q)``, ``hand`` the handoff to the next norm
    (layer ``i + 1``'s, or the final one) where ``ho`` and its consumer is fused, else None;
    ``q`` layer ``i + 1``'s rotated queries where the block ran its qkv too (``BLOCK_QKV``,
    ``step`` given: see ``_next_qkv``), its K/V then in the pages, else None."""
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
    takes = not cublas(*nxt[1:], bs) or (CUBLAS_HANDOFF and plain)
    nw_next = nxt[0].weight if ho and takes else None
    w_gu = mlp.gate_up_proj.weight
    if use_block(layer, bs, ho):
        qkv = _next_qkv(model, i, bs, step) if nw_next is not None else None
        out = mlp_block(o, r, attn.o_proj.weight, norm2.weight, w_gu, norm2.eps,
                        mlp.down_proj.weight, nw_next, qkv=qkv, use_pdl=use_pdl)  # fmt: skip
        if qkv is not None:
            return out[0], out[1:3], out[3]
        return (out, None, None) if nw_next is None else (out[0], out[1:], None)
    nw = norm2.weight if ho and not cublas(mlp.gate_up_proj, "gate_up_silu", bs) else None
    r, hand = row(o, attn.o_proj, r, use_pdl, nw)
    if cublas(mlp.gate_up_proj, "gate_up_silu", bs):
        a = silu_mul(mlp.gate_up_proj(norm2(r)[0]))  # norm, GEMM, SiLU·mul
    elif hand is not None:  # x = r * norm2.weight, the rows scaled by o_proj's 1 / RMS
        a = gate_up_silu(hand[0], None, w_gu, norm2.eps, use_pdl=use_pdl, ssq=hand[1])
    elif separate_norm("gate_up_silu", bs, *w_gu.shape, w_gu.element_size()):
        a = gate_up_silu(norm2(r)[0], None, w_gu, norm2.eps, use_pdl=use_pdl)
    else:
        a = gate_up_silu(r, norm2.weight, w_gu, norm2.eps, use_pdl=use_pdl)
    return (*row(a, mlp.down_proj, r, use_pdl, nw_next), None)


__all__ = [
    "BLOCK_QKV",
    "CUBLAS_HANDOFF",
    "MLP_BLOCK",
    "ONE_ROW",
    "block_serves",
    "cublas",
    "mlp_half",
    "one_row_block",
    "row",
    "use_block",
]
