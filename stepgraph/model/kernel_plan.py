"""Which kernels the fused decode step runs at each batch bucket, from a model's shapes alone:
the choices ``fused_decode_step`` makes, in its order, with the table entry behind each
(``stepgraph info --model NAME``). A user sees what runs at their batch size under a
``DecodeTuning`` (``stepgraph.tuning``: the step's own choices, read through the step's own
functions where they are one), without a GPU or the weights."""

from __future__ import annotations

from ..buckets import default_capture_sizes
from ..kernels.proj_tiles import (
    Tile,
    block_m,
    measured,
    prefer_cublas,
    reference_bucket,
    separate_norm,
    tile_for,
)
from ..kernels.qkv_rope import qkv_tile
from ..tuning import DecodeTuning, default_tuning
from . import fused_decode as _fd
from .config import ModelConfig
from .fused_decode import FUSED_MAX_BS
from .step_attention import attention_text

# the step's projections: table kernel and what the unfused pieces add beside cuBLAS
PIECES = {
    "qkv": ("qkv_rope", "RoPE/KV write"),
    "o_proj": ("gemv_residual", None),
    "gate_up": ("gate_up_silu", "SiLU·mul"),
    "down": ("gemv_residual", None),
    "lm_head": ("lm_head", "argmax_rows"),
}


UNMEASURED = "no measured tiles for these shapes; docs/tuning.md"


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


def tile_text(t: Tile) -> str:
    """``Tile(64, 128, 4, 5, 4, 1)`` -> ``64x128 w4 s5 split4 TMA1`` (defaults left out)."""
    parts = [f"{t.block_n}x{t.block_k}", f"w{t.num_warps}"]
    parts += [f"s{t.num_stages}"] if t.num_stages else []
    parts += [f"split{t.split_k}"] if t.split_k > 1 else []
    parts += [f"TMA{t.tma}"] if t.tma else []
    return " ".join(parts)


def piece_choice(piece: str, rows: int, n: int, k: int, elem_bytes: int = 2, half: int = 32,
                 handoff: bool = False, tuning: DecodeTuning | None = None) -> str:  # fmt: skip
    """What the fused step runs for ``piece`` at ``rows`` (its bucket): the unfused pieces where
    ``tile_table.CUBLAS`` says; with ``handoff`` (``fused_decode.handoff``) the fused kernel
    with the norm from the sums of squares (qkv: from layer 1 on); the norm as its own kernel
    first where ``SEPARATE_NORM`` says; and the tile the fused kernel's launcher takes
    (``half``: head_dim / 2, for qkv)."""
    kernel, beside = PIECES[piece]
    t = default_tuning(tuning)
    tables = t.tables
    if beside and prefer_cublas(kernel, rows, n, k, elem_bytes, tables):
        if handoff and piece == "qkv" and t.handoff.cublas:  # x = r * norm_w
            return (f"cuBLAS + {beside}, the norm from the sums of squares in the RoPE kernel "
                    f"(layer 0: norm + cuBLAS + {beside})")  # fmt: skip
        if handoff and piece == "lm_head" and t.handoff.cublas:
            return ("cuBLAS + head_scale, the norm from the sums of squares (its 1 / RMS and the "
                    "greedy tokens in one launch)")  # fmt: skip
        return f"norm + cuBLAS + {beside}"
    if handoff and piece in ("qkv", "gate_up", "lm_head"):  # the norms' consumers
        if piece == "qkv":
            tile = qkv_tile(False, rows, n, k, half, elem_bytes, tables)
        else:
            tile = tile_for(kernel + ("_normed" if piece == "gate_up" else ""), rows, n, k,
                            elem_bytes, tables)  # fmt: skip
        text = f"{kernel} {tile_text(tile)}, the norm from the sums of squares"
        if piece == "qkv":  # layer 0's input is the embedding: no sums beside it
            text += f" (layer 0: {piece_choice(piece, rows, n, k, elem_bytes, half, tuning=t)})"
        return text
    sep = piece in ("qkv", "gate_up") and separate_norm(kernel, rows, n, k, elem_bytes, tables)
    if piece == "qkv":
        tile = qkv_tile(not sep, rows, n, k, half, elem_bytes, tables)
    else:
        tile = tile_for(kernel + "_normed" if sep else kernel, rows, n, k, elem_bytes, tables)
    return f"{'norm, then ' if sep else ''}{kernel} {tile_text(tile)}"


def kernel_plan(config: ModelConfig, elem_bytes: int = 2, buckets=None,
                tuning: DecodeTuning | None = None):  # fmt: skip
    """``[(bucket, path, {piece: choice})]`` for the default buckets up to ``FUSED_MAX_BS``, the
    pieces in the step's order, the attention's after qkv (choices empty where the reference
    kernels run)."""
    shapes, t = piece_shapes(config), default_tuning(tuning)
    out = []
    for b in buckets or default_capture_sizes(FUSED_MAX_BS):
        if b in t.reference_rows:
            out.append((b, "reference kernels (reference_rows)", {}))
            continue
        if b > 1 and not all(measured(PIECES[p][0], b, *shapes[p], elem_bytes, t.tables)
                             for p in PIECES):  # fmt: skip
            out.append((b, f"reference kernels ({UNMEASURED})", {}))
            continue
        if reference_bucket(*shapes["qkv"], b, elem_bytes, t.tables):
            out.append((b, "reference kernels (measured faster here: REFERENCE_BUCKETS)", {}))
            continue
        path = "fused, one row (GEMV)"
        if b > 1:
            path = f"fused, tensor cores (M padded to {block_m(b)})"
            if _fd.no_pdl(*shapes["qkv"], b, elem_bytes, t):
                path += ", no PDL (NO_PDL_BUCKETS)"
        half, ho = config.head_dim // 2, t.handoff.enabled and b >= t.handoff.min_bucket
        choices = {p: piece_choice(p, b, *shapes[p], elem_bytes, half, ho, t) for p in PIECES}
        attn = (config.num_heads, config.num_kv_heads, config.head_dim)
        use_pdl = _fd.step_pdl(*shapes["qkv"], b, b, elem_bytes, t)
        choices = {"qkv": choices.pop("qkv"),
                   "attention": attention_text(attn, b, use_pdl=use_pdl, tuning=t),
                   **choices}  # fmt: skip
        out.append((b, path, choices))
    return out


def format_plan(name: str, dtype: str, config: ModelConfig, elem_bytes: int,
                tuning: DecodeTuning | None = None) -> str:  # fmt: skip
    """The plan as ``stepgraph info --model`` prints it."""
    lines = [f"decode kernels of {name} ({dtype}, the fused step on CUDA; `--kernels reference`"
             " runs the reference kernels everywhere):"]  # fmt: skip
    for b, path, choices in kernel_plan(config, elem_bytes, tuning=tuning):
        lines.append(f"  bs bucket {b}: {path}")
        lines += [f"    {p:<9} {c}" for p, c in choices.items()]
    lines.append(f"  above {FUSED_MAX_BS} rows: reference kernels (the fused kernels take 64 rows)")
    return "\n".join(lines)


__all__ = ["PIECES", "format_plan", "kernel_plan", "piece_choice", "piece_shapes", "tile_text"]
