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
Llama-3.2-1B (docs/results.md has the figures). Two rows and more: the same kernels on tensor
cores, M padded to 16/32/64, split-K where the output is
narrow, tiles per (shape, bs bucket) in ``kernels/proj/tile_table.TILES`` (``benchmarks/
proj_sweep.py``; some through TMA, ``kernels/proj/tma_tiles.py``). Where cuBLAS measured faster
(``tile_table.CUBLAS``: qkv and the LM head at 33-64 rows) the step runs cuBLAS with RoPE/KV-
write after it (``head_scale`` for the head). From bucket 2 on, the norms before the other
consumers (qkv from layer 1, gate-up, the LM head) come from what o_proj and down leave beside
the residual (``handoff``, ``kernels/proj/norm_handoff.py``): no norm kernel, before a cuBLAS GEMM
too (its rows' 1 / RMS applied after it). For layer 0 (and with the handoff off) the norm runs
as its own kernel where ``tile_table.SEPARATE_NORM`` says (or cuBLAS follows), else in the
prologue. ``DecodeTuning.reference_rows`` (none by default) and a model's reference buckets
run the reference kernels inside the step. Every choice is the plan's (``model/decode/step_plan``:
``plan_step``, cached per bucket); this module executes it. The projections
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
from torch.nn import functional as F

from ...buckets import replay_bucket
from ...errors import ConfigError
from ...kernels.elementwise.fused_norm import embed_rmsnorm
from ...kernels.elementwise.rope_kv import rope_kv
from ...kernels.proj.head_scale import head_scale
from ...kernels.proj.norm_gemv import norm_gemv
from ...kernels.proj.qkv_rope import qkv_rope
from ...kernels.sampling.lm_head_argmax import lm_head_argmax
from ...tuning import DecodeTuning, default_tuning
from ..fp8_linear import scale_kwargs
from ..llama import LlamaModel, at_rows
from . import fused_mlp, step_attention
from .kernel_choice import KERNEL_CHOICES, check_kernels, default_kernels, unfusable_reason
from .step_heads import cublas_head as _cublas_head
from .step_heads import greedy_tokens as _greedy
from .step_plan import (
    CUBLAS,
    CUBLAS_HANDOFF,
    HANDOFF,
    PARALLEL,
    SEPARATE,
    StepPlan,
    measured_all,
    no_pdl,
    plan_step,
    reference_reason,
    step_pdl,
    step_shapes,
)

# Rows the fused step serves (``gemv_tiles.MAX_M``: one launch takes up to 64 rows).
FUSED_MAX_BS = 64


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


def step_plan(
    bs: int, model: LlamaModel, backend=None, tuning: DecodeTuning | None = None
) -> StepPlan:
    """The plan (``model/decode/step_plan.plan_step``) the fused step executes for ``bs`` rows of
    ``model`` over ``backend``: cached, so a step looks it up."""
    t = default_tuning(tuning)
    return plan_step(step_shapes(model, backend), bs, kernel_class(bs, backend), t)


def reference_rows(
    bs: int, backend=None, model: LlamaModel | None = None, tuning: DecodeTuning | None = None
) -> bool:
    """Whether the fused step runs ``bs`` rows on the reference kernels: ``tuning``'s
    ``reference_rows``, or, given ``model``, rows above one where one of its projections has no
    measured tile or the model measured faster on the reference kernels
    (``step_plan.reference_reason``)."""
    t = default_tuning(tuning)
    rows = kernel_class(bs, backend)
    if model is None:
        return rows in t.reference_rows
    return reference_reason(step_shapes(model, backend), rows, t) is not None


def _embed(model, input_ids: torch.Tensor, plan: StepPlan):
    """``(r, layer 0's normed x or None)``: the embedded rows, and where the plan runs layer 0's
    norm as its own kernel, the norm too, in the same launch (``embed_rmsnorm``)."""
    if not plan.embed_norm:
        return model.embed_tokens(input_ids), None
    norm1 = model.layers[0].input_layernorm
    x0, r = embed_rmsnorm(input_ids, model.embed_tokens.weight, norm1.weight, norm1.eps)
    return r, x0


def _qkv(
    model, layer, i, r, hand, positions, backend, use_pdl, x0, plan, t: DecodeTuning, rows: int
) -> torch.Tensor:
    """Layer ``i``'s q ``[bs, n_heads, head_dim]``, rotated; this token's K/V into the pages,
    as ``plan`` (a ``ProjPlan``) says: cuBLAS + RoPE/KV write (on what ``hand`` holds, the 1 /
    RMS and the bias applied by the RoPE kernel; else after the norm's kernel), else
    ``qkv_rope`` on what ``hand`` holds, after the norm's own kernel, or with the norm in its
    prologue. ``x0``: the norm already run with the embedding (layer 0). ``rows``: the graph
    bucket's, at which cuBLAS's GEMM runs (``at_rows``)."""
    attn, norm1 = layer.self_attn, layer.input_layernorm
    w_qkv = attn.qkv_proj.weight
    meta, kv, n_heads = backend.meta, backend.kv_cache, model.config.num_heads
    if plan.how == CUBLAS_HANDOFF:  # GEMM, then RoPE with the rows' 1 / RMS and the bias
        return rope_kv(
            at_rows(lambda x: F.linear(x, w_qkv), hand[0], rows),
            positions,
            model.rope_cos,
            model.rope_sin,
            kv.k_caches[i],
            kv.v_caches[i],
            meta.out_cache_loc,
            n_heads,
            ssq=hand[1],
            hidden=r.shape[1],
            eps=norm1.eps,
            bias=attn.qkv_proj.bias,
        )
    if plan.how == CUBLAS:  # norm, GEMM, RoPE
        return rope_kv(
            at_rows(attn.qkv_proj, norm1(r)[0] if x0 is None else x0, rows),
            positions,
            model.rope_cos,
            model.rope_sin,
            kv.k_caches[i],
            kv.v_caches[i],
            meta.out_cache_loc,
            n_heads,
        )
    if plan.how == HANDOFF:  # x = r * norm1.weight, the rows scaled by down's 1 / RMS
        x, nw, ssq = hand[0], None, hand[1]
    elif plan.how == SEPARATE:
        x, nw, ssq = norm1(r)[0] if x0 is None else x0, None, None
    else:
        x, nw, ssq = r, norm1.weight, None
    return qkv_rope(
        x,
        nw,
        w_qkv,
        attn.qkv_proj.bias,
        norm1.eps,
        positions,
        model.rope_cos,
        model.rope_sin,
        kv.k_caches[i],
        kv.v_caches[i],
        meta.out_cache_loc,
        n_heads,
        use_pdl=use_pdl,
        blocks=plan.tile,
        ssq=ssq,
        tuning=t,
        **scale_kwargs(attn.qkv_proj),
    )


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
    bs = input_ids.shape[0]
    plan = step_plan(bs, model, backend, t)
    if not plan.fused:  # the reference kernels, greedy tokens taken here, GEMMs at the bucket
        h = model(input_ids, positions, backend, plan.bucket, keep_rows=True)
        return _cublas_head(model, h, logits_out, tokens_out, t, plan.bucket, live=bs)
    attn = plan.attention
    if use_pdl is None:
        use_pdl = plan.use_pdl
    else:  # the caller's mode: the attention's PDL follows it
        attn = step_attention.attention_plan(
            (backend.num_heads, backend.num_kv_heads, backend.head_dim),
            attn.splits,
            plan.bucket,
            use_pdl,
            t,
            backend.use_kernel,
        )
    r, x0 = _embed(model, input_ids, plan)  # [bs, hidden], the residual stream; layer 0's norm
    hand = None  # (r * the next norm's weight, r's sums of squares) where its writer left them
    last = len(model.layers) - 1
    for i, layer in enumerate(model.layers):
        x0_i, qkv_i = (x0, plan.qkv0) if i == 0 else (None, plan.qkv)
        q = _qkv(model, layer, i, r, hand, positions, backend, use_pdl, x0_i, qkv_i, t, plan.bucket)
        o = step_attention.attention(backend, i, q, plan.bucket, use_pdl, t, plan=attn)
        r, hand = fused_mlp.mlp_half(
            model, i, o.reshape(bs, -1), r, plan, use_pdl, t, last=i == last
        )
    head, rows = plan.lm_head, plan.bucket  # rows: cuBLAS's, the graph bucket's (``at_rows``)
    if head.how == PARALLEL:  # its slice, then every rank's
        local = norm_gemv(
            r,
            model.norm.weight,
            model.lm_head.weight,
            None,
            model.norm.eps,
            torch.float32,
            use_pdl=use_pdl,
            blocks=head.tile,
            tuning=t,
        )
        logits = model.lm_head.gather(local)  # [bs, vocab]: every rank's slice
        logits = logits if logits_out is None else logits_out.copy_(logits)
        if tokens_out is not None:
            _greedy(logits, tokens_out, t)
        return logits
    if head.how == CUBLAS_HANDOFF:  # GEMM, then the rows' 1 / RMS and the argmax in one launch
        return head_scale(
            at_rows(lambda x: F.linear(x, model.lm_head.weight), hand[0], rows),
            hand[1],
            r.shape[1],
            model.norm.eps,
            logits_out=logits_out,
            tokens_out=tokens_out,
            use_pdl=use_pdl,
            tuning=t,
        )
    if head.how == CUBLAS:  # norm, GEMM
        return _cublas_head(model, model.norm(r)[0], logits_out, tokens_out, t, rows)
    x, nw, ssq = (r, model.norm.weight, None) if head.how != HANDOFF else (hand[0], None, hand[1])
    logits, _ = lm_head_argmax(
        x,
        nw,
        model.lm_head.weight,
        model.norm.eps,
        logits_out=logits_out,
        tokens_out=tokens_out,
        use_pdl=use_pdl,
        blocks=head.tile,
        ssq=ssq,
        tuning=t,
    )
    return logits


__all__ = [
    "FUSED_MAX_BS",
    "KERNEL_CHOICES",
    "check_kernels",
    "check_rows",
    "default_kernels",
    "fused_decode_step",
    "kernel_class",
    "measured_all",
    "no_pdl",
    "reference_rows",
    "step_pdl",
    "step_plan",
    "unfusable_reason",
]
