"""The fused decode step: six launches a layer and greedy sampling inside the step.

    r = embed(ids)           with layer 0's norm where it is its own kernel        1 launch
    per layer:
      q = qkv_rope(r)          norm, qkv (+ bias), RoPE, K/V into the pages        1 launch
      o = attention(q)         split-KV decode (split + combine; one launch where   2 (1)
                               every row has one split, ``split_kv_fold``)
      r = r + o_proj(o)        residual add in the GEMV epilogue                   1 launch
      a = gate_up_silu(r)      norm, gate-up, SiLU * up                            1 launch
      r = r + down(a)          residual add in the GEMV epilogue                   1 launch
                               (these three: ``fused_mlp``)
    logits, tokens = lm_head_argmax(r)   final norm, float32 logits, greedy argmax  1 (2 at bs 1)

One row: the broadcast-multiply GEMV tiles (``gemv_tiles``), 100 kernels a step for
Llama-3.2-1B (0.800 ms exact, 75% of the bandwidth floor, H200, run J5). Two rows and more
(issue 21): the same kernels on tensor cores, M padded to 16/32/64, split-K where the output is
narrow, tiles per (shape, bs bucket) in ``kernels/tile_table.TILES`` (``benchmarks/
proj_sweep.py``; some through TMA, ``kernels/tma_tiles.py``). Where cuBLAS measured faster
(``tile_table.CUBLAS``: qkv and the LM head at 33-64 rows) the step runs cuBLAS with RoPE/KV-
write after it (``head_scale`` for the head). From bucket 2 on, the norms before the other
consumers (qkv from layer 1, gate-up, the LM head) come from what o_proj and down leave beside
the residual (``handoff``, ``kernels/norm_handoff.py``): no norm kernel, before a cuBLAS GEMM
too (its rows' 1 / RMS applied after it). For layer 0 (and with the handoff off) the norm runs
as its own kernel where ``tile_table.SEPARATE_NORM`` says (or cuBLAS follows), else in the
prologue. ``DecodeTuning.reference_rows`` (none by default) and a model's reference buckets
run the reference kernels inside the step. docs/results.md has the figures. The projections
are launched with programmatic dependent launch where the GPU has it (``kernels/pdl.py``; from
two rows each lets the next launch after its main loop, ``pdl.rows_trigger``), except where
``tile_table.NO_PDL_BUCKETS`` says; of the attention, the combine, and at one row the split
kernel's trigger too (``step_attention.default_pdl``).

``ModelRunner.kernels`` chooses: "fused" (the default on CUDA) or "reference" (the unfused
kernels, the numerical reference and the CPU path). The fused step serves batches of up to
``FUSED_MAX_BS`` rows of an unsharded model, greedy tokens included at every size; anything
else runs the reference kernels, in eager, graph and exact mode alike, so the three always run
the same kernels for a batch size (every choice here is a function of bs and the shapes).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from ..buckets import replay_bucket
from ..errors import ConfigError
from ..kernels import proj_tiles
from ..kernels.fused_norm import embed_rmsnorm
from ..kernels.head_scale import head_scale
from ..kernels.lm_head_argmax import lm_head_argmax
from ..kernels.norm_gemv import norm_gemv
from ..kernels.pdl import TRIGGER_MODES
from ..kernels.proj_tiles import measured, reference_bucket, separate_norm
from ..kernels.qkv_rope import qkv_rope
from ..kernels.rope_kv import rope_kv
from ..tuning import DecodeTuning, default_tuning
from . import fused_mlp, step_attention
from .fused_mlp import cublas
from .kernel_choice import KERNEL_CHOICES, check_kernels, default_kernels, unfusable_reason
from .llama import LlamaModel
from .parallel import ParallelLMHead, RowParallelLinear
from .step_heads import cublas_head as _cublas_head
from .step_heads import greedy_tokens as _greedy

# Rows the fused step serves (``gemv_tiles.MAX_M``: one launch takes up to 64 rows).
FUSED_MAX_BS = 64
# The choices that are not the same for every row count are made on the batch size's bucket
# (``kernel_class``) and come from ``DecodeTuning`` (``stepgraph.tuning``): the reference rows
# (none by default), the norm handoff (from bucket 2), the projections' PDL trigger from two
# rows ("late", ``kernels/pdl.py``) and the buckets without PDL.


def kernel_class(bs: int, backend=None) -> int:
    """The graph bucket ``bs`` replays in: ``backend.geometry_bs(bs)`` (the buckets of the graph
    runner over it), else the default buckets (``buckets.replay_bucket``). Every kernel
    choice that is not the same for all row counts is made on it, so a live batch eager and the
    graph of its bucket (exact mode) run the same kernels. The tile classes (``block_m``: 16, 32,
    64) and the cuBLAS choices agree across each default bucket; custom buckets that straddle
    them may not (exact then still equals eager at the bucket sizes themselves)."""
    geometry = getattr(backend, "geometry_bs", None)
    if geometry is not None:
        return geometry(bs)
    return replay_bucket(bs)


def reference_rows(bs: int, backend=None, model: LlamaModel | None = None,
                   tuning: DecodeTuning | None = None) -> bool:  # fmt: skip
    """Whether the fused step runs ``bs`` rows on the reference kernels: ``tuning``'s
    ``reference_rows``, or, given ``model``, rows above one where one of its projections has no
    measured tile (``proj_tiles.measured``: other models' shapes, float32, tensor-parallel
    shards)."""
    t = default_tuning(tuning)
    rows = kernel_class(bs, backend)
    return rows in t.reference_rows or (
        model is not None and rows > 1 and not _measured(model, rows, t.tables)
    )


def _measured(model: LlamaModel, rows: int, tables=None) -> bool:
    """Every projection has a measured choice at ``rows`` (a bucket), and the bucket is not one
    where the model measured faster on the reference kernels (``tile_table.REFERENCE_BUCKETS``)."""
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    w = attn.qkv_proj.weight
    if reference_bucket(*w.shape, rows, w.element_size(), tables):
        return False
    pieces = (("qkv_rope", attn.qkv_proj), ("gemv_residual", attn.o_proj),
              ("gate_up_silu", mlp.gate_up_proj), ("gemv_residual", mlp.down_proj),
              ("lm_head", model.lm_head))  # fmt: skip
    return all(
        measured(kernel, rows, *lin.weight.shape, lin.weight.element_size(), tables)
        for kernel, lin in pieces
    )


def no_pdl(qkv_n: int, k: int, bucket: int, elem_bytes: int,
           tuning: DecodeTuning | None = None) -> bool:  # fmt: skip
    """Whether the projections at ``bucket`` launch without PDL, for a model whose fused qkv
    weight is ``[qkv_n, k]``: ``tuning.pdl.no_pdl_buckets`` if set, else the tables'
    (``proj_tiles.no_pdl_bucket``)."""
    t = default_tuning(tuning)
    if t.pdl.no_pdl_buckets is not None:
        return bucket in t.pdl.no_pdl_buckets
    return proj_tiles.no_pdl_bucket(qkv_n, k, bucket, elem_bytes, t.tables)


def step_pdl(qkv_n: int, k: int, bs: int, bucket: int, elem_bytes: int,
             tuning: DecodeTuning | None = None) -> int | bool | None:  # fmt: skip
    """The projections' ``use_pdl`` for ``bs`` rows in class ``bucket``: None at one row (the
    GEMVs, whatever the bucket: the device's default, the trigger at the wait), else False
    where ``no_pdl`` says, else ``tuning.pdl.rows_trigger``'s mode ("late")."""
    if bs == 1:
        return None
    t = default_tuning(tuning)
    return False if no_pdl(qkv_n, k, bucket, elem_bytes, t) else TRIGGER_MODES[t.pdl.rows_trigger]


def handoff(bs: int, model: LlamaModel, backend=None, tuning: DecodeTuning | None = None) -> bool:
    """Whether the step at ``bs`` rows takes the norms before qkv (from layer 1), gate-up and
    the LM head from what o_proj and down leave (``kernels/norm_handoff``): from bucket
    ``tuning.handoff.min_bucket`` on; unsharded, where the consumer is fused, and into a cuBLAS
    qkv or LM head (the 1 / RMS applied after the GEMM: ``tuning.handoff.cublas``)."""
    down = model.layers[0].mlp.down_proj
    if type(down) is RowParallelLinear and down.world_size > 1:
        return False
    t = default_tuning(tuning)
    bucket = kernel_class(bs, backend)
    return t.handoff.enabled and bucket >= t.handoff.min_bucket


def _own_norm(layer, bs: int, tuning: DecodeTuning) -> bool:
    """Whether ``layer``'s input norm runs as its own kernel at ``bs`` rows when no handoff
    serves it: before cuBLAS (``tables.cublas``) or by ``tables.separate_norm``."""
    w = layer.self_attn.qkv_proj.weight
    return cublas(layer.self_attn.qkv_proj, "qkv_rope", bs, tuning) or separate_norm(
        "qkv_rope", bs, *w.shape, w.element_size(), tuning.tables
    )


def _embed(model, input_ids: torch.Tensor, tuning: DecodeTuning):
    """``(r, layer 0's normed x or None)``: the embedded rows, and where layer 0's norm is its
    own kernel (``_own_norm``) the norm too, in the same launch (``embed_rmsnorm``)."""
    norm1, bs = model.layers[0].input_layernorm, input_ids.shape[0]
    if type(model.embed_tokens) is not nn.Embedding or not _own_norm(model.layers[0], bs, tuning):
        return model.embed_tokens(input_ids), None
    x0, r = embed_rmsnorm(input_ids, model.embed_tokens.weight, norm1.weight, norm1.eps)
    return r, x0


def _qkv(model, layer, i, r, hand, positions, meta, kv, n_heads, use_pdl, x0,
         t: DecodeTuning) -> torch.Tensor:  # fmt: skip
    """Layer ``i``'s q ``[bs, n_heads, head_dim]``, rotated; this token's K/V into the pages:
    cuBLAS + RoPE/KV write where ``tile_table.CUBLAS`` says (on what ``hand`` holds, the 1 /
    RMS and the bias applied by the RoPE kernel; else after the norm's kernel), else
    ``qkv_rope`` on what ``hand`` holds (the norm handoff), the norm as its own kernel first
    (``SEPARATE_NORM``), or the norm in the prologue. ``x0``: the norm already run with the
    embedding (layer 0)."""
    attn, norm1 = layer.self_attn, layer.input_layernorm
    w_qkv, bs = attn.qkv_proj.weight, r.shape[0]
    if cublas(attn.qkv_proj, "qkv_rope", bs, t):
        if hand is not None:  # GEMM, then RoPE with the rows' 1 / RMS and the bias
            return rope_kv(
                F.linear(hand[0], w_qkv), positions, model.rope_cos, model.rope_sin,
                kv.k_caches[i], kv.v_caches[i], meta.out_cache_loc, n_heads, ssq=hand[1],
                hidden=r.shape[1], eps=norm1.eps, bias=attn.qkv_proj.bias,
            )  # fmt: skip
        return rope_kv(  # norm, GEMM, RoPE
            attn.qkv_proj(norm1(r)[0] if x0 is None else x0), positions, model.rope_cos,
            model.rope_sin, kv.k_caches[i], kv.v_caches[i], meta.out_cache_loc, n_heads,
        )  # fmt: skip
    if hand is not None:  # x = r * norm1.weight, the rows scaled by down's 1 / RMS
        x, nw, ssq = hand[0], None, hand[1]
    elif separate_norm("qkv_rope", bs, *w_qkv.shape, w_qkv.element_size(), t.tables):
        x, nw, ssq = norm1(r)[0] if x0 is None else x0, None, None
    else:
        x, nw, ssq = r, norm1.weight, None
    return qkv_rope(
        x, nw, w_qkv, attn.qkv_proj.bias, norm1.eps, positions, model.rope_cos, model.rope_sin,
        kv.k_caches[i], kv.v_caches[i], meta.out_cache_loc, n_heads, use_pdl=use_pdl, ssq=ssq,
        tuning=t,
    )  # fmt: skip


def check_rows(bs: int, max_bs: int) -> None:
    """``ConfigError`` on the host unless ``bs`` rows fit a model runner built for ``max_bs``
    (its greedy-token buffer and the graph runners' buffers hold that many rows)."""
    if bs > max_bs:
        raise ConfigError(
            f"a decode batch of {bs} rows is more than the model runner's max_bs={max_bs} (its "
            f"static buffers hold {max_bs} rows); run at most {max_bs} rows a step (the Engine's "
            f"max_running does so), or build the model runner with max_bs={bs}."
        )


def fused_decode_step(
    model: LlamaModel,
    backend,  # PagedAttentionBackend, prepared for this step (decode metadata)
    input_ids: torch.Tensor,  # [bs] int64
    positions: torch.Tensor,  # [bs] int64
    *,
    logits_out: torch.Tensor | None = None,  # [bs, vocab] float32
    tokens_out: torch.Tensor | None = None,  # [bs] int64, the greedy tokens
    use_pdl: bool | None = None,
    tuning: DecodeTuning | None = None,
) -> torch.Tensor:  # [bs, vocab] float32 logits
    """One decode step with the fused kernels; the K/V of this token land in the pages at the
    backend's ``out_cache_loc``. ``bs <= FUSED_MAX_BS`` (the kernels' row limit). Every choice
    comes from ``tuning`` (``ModelRunner.tuning``; None: ``DecodeTuning.default()``)."""
    t = default_tuning(tuning)
    meta = backend.meta
    kv = backend.kv_cache
    n_heads = model.config.num_heads
    bs = input_ids.shape[0]
    if reference_rows(bs, backend, model, t):  # the reference kernels, greedy tokens taken here
        return _cublas_head(model, model(input_ids, positions, backend), logits_out, tokens_out,
                            t)  # fmt: skip
    bucket = kernel_class(bs, backend)
    if use_pdl is None:
        w = model.layers[0].self_attn.qkv_proj.weight
        use_pdl = step_pdl(*w.shape, bs, bucket, w.element_size(), t)
    r, x0 = _embed(model, input_ids, t)  # [bs, hidden], the residual stream; layer 0's norm
    ho = handoff(bs, model, backend, t)  # the norms from what o_proj and down leave beside r
    hand = None  # (r * the next norm's weight, r's sums of squares) where its writer left them
    for i, layer in enumerate(model.layers):
        q = _qkv(model, layer, i, r, hand, positions, meta, kv, n_heads, use_pdl,
                 x0 if i == 0 else None, t)  # fmt: skip
        o = step_attention.attention(backend, i, q, bucket, use_pdl, t)  # [bs, heads, dim]
        r, hand = fused_mlp.mlp_half(model, i, o.reshape(bs, -1), r, ho, use_pdl, t)
    if isinstance(model.lm_head, ParallelLMHead):  # its slice, then every rank's
        local = norm_gemv(r, model.norm.weight, model.lm_head.weight, None, model.norm.eps,
                          torch.float32, use_pdl=use_pdl, tuning=t)  # fmt: skip
        logits = model.lm_head.gather(local)  # [bs, vocab]: every rank's slice
        logits = logits if logits_out is None else logits_out.copy_(logits)
        if tokens_out is not None:
            _greedy(logits, tokens_out, t)
        return logits
    if cublas(model.lm_head, "lm_head", bs, t):
        if hand is not None:  # GEMM, then the rows' 1 / RMS and the argmax in one launch
            return head_scale(F.linear(hand[0], model.lm_head.weight), hand[1], r.shape[1],
                              model.norm.eps, logits_out=logits_out, tokens_out=tokens_out,
                              use_pdl=use_pdl, tuning=t)  # fmt: skip
        return _cublas_head(model, model.norm(r)[0], logits_out, tokens_out, t)  # norm, GEMM
    x, nw, ssq = (r, model.norm.weight, None) if hand is None else (hand[0], None, hand[1])
    logits, _ = lm_head_argmax(
        x, nw, model.lm_head.weight, model.norm.eps,
        logits_out=logits_out, tokens_out=tokens_out, use_pdl=use_pdl, ssq=ssq, tuning=t,
    )  # fmt: skip
    return logits


__all__ = [
    "FUSED_MAX_BS",
    "KERNEL_CHOICES",
    "check_kernels",
    "check_rows",
    "default_kernels",
    "fused_decode_step",
    "handoff",
    "kernel_class",
    "no_pdl",
    "reference_rows",
    "step_pdl",
    "unfusable_reason",
]
