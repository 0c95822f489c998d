"""``stepgraph info --model NAME``: the plan the fused decode step executes at each batch
bucket (``model/decode/step_plan.plan_step``), from a model's shapes alone, as text. A user sees
what runs at their batch size under a ``DecodeTuning`` without a GPU or the weights; every choice
printed here is the plan's, and the step runs the same plan."""

from __future__ import annotations

from ...buckets import default_capture_sizes
from ...kernels.proj.proj_tiles import Tile, block_m
from ...tuning import DecodeTuning, default_tuning
from ..config import ModelConfig
from ..fp8_linear import load_format
from .fused_decode import FUSED_MAX_BS
from .step_attention import describe
from .step_plan import (
    CUBLAS,
    CUBLAS_HANDOFF,
    FP8_FORMATS,
    HANDOFF,
    PIECE_KERNELS,
    SEPARATE,
    UNMEASURED,
    ProjPlan,
    StepPlan,
    StepShapes,
    plan_step,
)

# what the unfused pieces add beside cuBLAS
BESIDE = {"qkv": "RoPE/KV write", "gate_up": "SiLU·mul", "lm_head": "argmax_rows"}
SUMS = ", the norm from the sums of squares"


def piece_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """``[n, k]`` of each projection's (fused) weight, as the model holds it unsharded."""
    h, inter = config.hidden_size, config.intermediate_size
    return {
        "qkv": (config.q_size + 2 * config.kv_size, h),
        "o_proj": (h, config.q_size),
        "gate_up": (2 * inter, h),
        "down": (h, inter),
        "lm_head": (config.vocab_size, h),
    }


def config_shapes(
    config: ModelConfig,
    elem_bytes: int = 2,
    weight_format: str = "plain",
    scale_block: tuple[int, int] | None = None,
) -> StepShapes:
    """The plan's ``StepShapes`` of an unsharded model of ``config`` (the H200's
    multiprocessors, any context: the split ladder's cap); ``weight_format`` ``"fp8-channel"``:
    the projections' weights quantized to e4m3 per channel, as ``--quantization fp8`` loads
    them; ``"fp8-block"`` with ``scale_block``: per block, as ``--quantization fp8-block``."""
    attn = (config.num_heads, config.num_kv_heads, config.head_dim)
    return StepShapes(
        **piece_shapes(config),
        attention=attn,
        elem_bytes=elem_bytes,
        weight_format=weight_format,
        scale_block=scale_block,
    )


def tile_text(t: Tile, fp8: bool = False, one_row: bool = False) -> str:
    """``Tile(64, 128, 4, 5, 4, 1)`` -> ``64x128 w4 s5 split4 TMA1`` (defaults left out); with
    ``fp8`` (e4m3 weights) the tile's activations too: ``W8A8`` (x quantized per row on FP8
    tensor cores, an ``a8`` tile), ``W8A16`` (the weight converted for bf16 tensor cores), or
    at one row ``e4m3 GEMV`` (the weight converted to float32 in registers)."""
    parts = [f"{t.block_n}x{t.block_k}", f"w{t.num_warps}"]
    parts += [f"s{t.num_stages}"] if t.num_stages else []
    parts += [f"split{t.split_k}"] if t.split_k > 1 else []
    parts += [f"TMA{t.tma}"] if t.tma else []
    parts += [("W8A8" if t.a8 else "e4m3 GEMV" if one_row else "W8A16")] if fp8 else []
    return " ".join(parts)


def proj_text(
    piece: str,
    p: ProjPlan,
    layer0: ProjPlan | None = None,
    fp8: bool = False,
    one_row: bool = False,
) -> str:
    """One projection of the plan as text (``layer0``: qkv's form at layer 0, where it
    differs; ``fp8``: the projection streams e4m3 weights, ``one_row`` in the GEMV)."""
    kernel = PIECE_KERNELS[piece]
    if p.how == CUBLAS_HANDOFF and piece == "qkv":
        return (
            f"cuBLAS + {BESIDE[piece]}, the norm from the sums of squares in the RoPE kernel "
            f"(layer 0: {proj_text(piece, layer0)})"
        )
    if p.how == CUBLAS_HANDOFF:
        return (
            "cuBLAS + head_scale, the norm from the sums of squares (its 1 / RMS and the "
            "greedy tokens in one launch)"
        )
    if p.how == CUBLAS:
        return f"norm + cuBLAS + {BESIDE[piece]}"
    tile = tile_text(p.tile, fp8, one_row)
    text = f"{'norm, then ' if p.how == SEPARATE else ''}{kernel} {tile}"
    if p.how == HANDOFF:
        text += SUMS
        if layer0 is not None:  # layer 0's input is the embedding: no sums beside it
            text += f" (layer 0: {proj_text(piece, layer0, fp8=fp8, one_row=one_row)})"
    return text


def choices(plan: StepPlan, fp8: bool = False) -> dict[str, str]:
    """``{piece: text}`` in the step's order, the attention's after qkv (``fp8``: the
    projections stream e4m3 weights, the LM head its own dtype)."""
    one = plan.rows == 1
    return {
        "qkv": proj_text("qkv", plan.qkv, plan.qkv0, fp8, one),
        "attention": describe(plan.attention),
        "o_proj": proj_text("o_proj", plan.o_proj, fp8=fp8, one_row=one),
        "gate_up": proj_text("gate_up", plan.gate_up, fp8=fp8, one_row=one),
        "down": proj_text("down", plan.down, fp8=fp8, one_row=one),
        "lm_head": proj_text("lm_head", plan.lm_head),
    }


def path_text(plan: StepPlan) -> str:
    """The bucket's line: the reference kernels and why, or the fused step's row class."""
    if not plan.fused:
        return f"reference kernels ({plan.reference})"
    if plan.bucket == 1:
        return "fused, one row (GEMV)"
    text = f"fused, tensor cores (M padded to {block_m(plan.rows)})"
    return text + (", no PDL (NO_PDL_BUCKETS)" if plan.no_pdl else "")


def kernel_plan(
    config: ModelConfig,
    elem_bytes: int = 2,
    buckets=None,
    tuning: DecodeTuning | None = None,
    weight_format: str = "plain",
    scale_block: tuple[int, int] | None = None,
):
    """``[(bucket, path, {piece: choice})]`` for the default buckets up to ``FUSED_MAX_BS``: the
    step's plan at each (choices empty where the reference kernels run)."""
    shapes = config_shapes(config, elem_bytes, weight_format, scale_block)
    t = default_tuning(tuning)
    fp8 = weight_format in FP8_FORMATS
    out = []
    for b in buckets or default_capture_sizes(FUSED_MAX_BS):
        plan = plan_step(shapes, b, b, t)
        out.append((b, path_text(plan), choices(plan, fp8) if plan.fused else {}))
    return out


def format_plan(
    name: str,
    dtype: str,
    config: ModelConfig,
    elem_bytes: int,
    tuning: DecodeTuning | None = None,
    quantization: str | None = None,
) -> str:
    """The plan as ``stepgraph info --model [--quantization fp8|fp8-block]`` prints it."""
    fmt, block = ("plain", None) if quantization is None else load_format(quantization)
    weights = ""
    if quantization is not None:
        per = "channel" if block is None else f"{block[0]}x{block[1]} block"
        weights = f", FP8 (e4m3) projection weights per {per}"
    lines = [
        f"decode kernels of {name} ({dtype}{weights}, the fused step on CUDA; `--kernels "
        "reference` runs the reference kernels everywhere):"
    ]
    plan = kernel_plan(config, elem_bytes, tuning=tuning, weight_format=fmt, scale_block=block)
    for b, path, pieces in plan:
        lines.append(f"  bs bucket {b}: {path}")
        lines += [f"    {p:<9} {c}" for p, c in pieces.items()]
    lines.append(f"  above {FUSED_MAX_BS} rows: reference kernels (the fused kernels take 64 rows)")
    return "\n".join(lines)


__all__ = [
    "UNMEASURED",
    "config_shapes",
    "format_plan",
    "kernel_plan",
    "piece_shapes",
    "proj_text",
    "tile_text",
]
