"""``plan_step``: every per-bucket choice of the fused decode step, made in one place.

``plan_step(shapes, rows, bucket, tuning)`` says what the step runs for ``rows`` rows that
replay in graph bucket ``bucket``: the reference kernels or the fused ones, the projections'
PDL mode, the norm handoff, each projection's form (norm in the prologue, the norm as its own
kernel first, the norm from the sums of squares, norm + cuBLAS) with the tile its launcher
takes, layer 0's norm beside the embedding, and the attention's launches. ``fused_decode``,
``fused_mlp``, ``step_attention`` and ``step_heads`` execute a ``StepPlan``; ``stepgraph info``
prints it (``model/decode/kernel_plan.py``). Plans are cached on the tuning by (shapes, rows,
bucket): a step looks its plan up, it does not recompute it.

The choices follow ``DecodeTuning`` (docs/tuning.md), each field with its evidence there.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, replace

from torch import nn

from ...kernels.decode.flash_decode import DEFAULT_MAX_SPLITS
from ...kernels.decode.splits import H200_NUM_SMS, SplitLadder, ladder_cap, num_splits_for
from ...kernels.pdl import TRIGGER_MODES
from ...kernels.proj.block_scales import block_tile, rows_fit, set_rows
from ...kernels.proj.proj_tiles import (
    Tile,
    fp8_table_tile,
    measured,
    no_pdl_bucket,
    prefer_cublas,
    reference_bucket,
    separate_norm,
    tile_for,
)
from ...kernels.proj.qkv_rope import qkv_tile
from ...tuning import DecodeTuning, default_tuning
from ..fp8_linear import fp8_modules, weight_format
from ..parallel import ParallelLMHead, RowParallelLinear
from .step_attention import AttentionPlan, attention_plan

# The step's projections in its order, with the kernel whose table entry each takes.
PIECE_KERNELS = {
    "qkv": "qkv_rope",
    "o_proj": "gemv_residual",
    "gate_up": "gate_up_silu",
    "down": "gemv_residual",
    "lm_head": "lm_head",
}
# A projection's form (``ProjPlan.how``).
FUSED, SEPARATE, HANDOFF, CUBLAS, CUBLAS_HANDOFF, PARALLEL = (
    "fused",  # the fused kernel, the norm (if any) in its prologue
    "separate",  # the norm as its own kernel, then the fused kernel's _normed variant
    "handoff",  # the fused kernel on r * norm_w with r's sums of squares (proj/norm_handoff)
    "cublas",  # norm, cuBLAS GEMM, then the piece's epilogue kernel
    "cublas_handoff",  # cuBLAS on r * norm_w, the 1 / RMS applied after it
    "parallel",  # a tensor-parallel LM head: norm_gemv on its slice, then the gather
)


@dataclass(frozen=True)
class StepShapes:
    """What the plan reads of a model and its attention backend: each projection's weight
    ``[n, k]`` as the step holds it (a shard under tensor parallelism), the element size, the
    attention shape ``(n_heads, n_kv_heads, head_dim)``, the multiprocessors and context the
    split ladder sizes a bucket for (``split_context`` None: any context, the ladder's cap),
    whether the attention runs its kernels and with which ladder (None: the tuning's), and the
    model's form (row-parallel shards, a parallel LM head, the head's bias, a plain embedding
    table)."""

    qkv: tuple[int, int]
    o_proj: tuple[int, int]
    gate_up: tuple[int, int]
    down: tuple[int, int]
    lm_head: tuple[int, int]
    attention: tuple[int, int, int]
    elem_bytes: int = 2
    num_sms: int = H200_NUM_SMS
    split_context: int | None = None
    max_splits: int = DEFAULT_MAX_SPLITS
    attention_kernel: bool = True
    split_ladder: SplitLadder | None = None
    sharded: bool = False
    parallel_head: bool = False
    head_bias: bool = False
    plain_embed: bool = True
    # "plain", or fp8_linear.weight_format's ("fp8-channel", "fp8-block", "mixed"): FP8
    # weights are looked up in the tables at the activations' element size (elem_bytes)
    weight_format: str = "plain"
    scale_block: tuple[int, int] | None = None  # "fp8-block": every projection's (bn, bk)

    def shape(self, piece: str) -> tuple[int, int]:
        return getattr(self, piece)


@dataclass(frozen=True)
class ProjPlan:
    """One projection: its form (``how``), its launcher's tile (None on cuBLAS), and whether it
    leaves the norm handoff for the next norm's consumer (``hands``: o_proj and down)."""

    how: str
    tile: Tile | None = None
    hands: bool = False


@dataclass(frozen=True)
class StepPlan:
    """What the fused step runs for ``rows`` rows in bucket ``bucket``. ``reference``: why the
    reference kernels run instead (None: the fused ones). ``use_pdl``: the projections' mode
    (None at one row: the device's default; False: no PDL; else a trigger mode), ``no_pdl``:
    the bucket measured faster without it. ``qkv0``: layer 0's qkv (its input the embedding,
    no handoff), ``qkv``: the other layers'; ``down_last``: the last layer's down (its handoff
    to the final norm). ``embed_norm``: layer 0's norm runs with the embedding."""

    rows: int
    bucket: int
    reference: str | None = None
    use_pdl: int | bool | None = None
    no_pdl: bool = False
    handoff: bool = False
    embed_norm: bool = False
    qkv0: ProjPlan | None = None
    qkv: ProjPlan | None = None
    attention: AttentionPlan | None = None
    o_proj: ProjPlan | None = None
    gate_up: ProjPlan | None = None
    down: ProjPlan | None = None
    down_last: ProjPlan | None = None
    lm_head: ProjPlan | None = None

    @property
    def fused(self) -> bool:
        return self.reference is None


UNMEASURED = "no measured tiles for these shapes; docs/tuning.md"
FP8_REFERENCE = (
    "FP8 weights of mixed formats or scale blocks: the projections run the FP8-weight GEMV "
    "(kernels/proj/fp8_gemv)"
)
FP8_FUSED = "fp8-channel"  # ``--quantization fp8``'s weight format
# the weight formats the fused kernels stream (W_FP8; FP8_TILES): scales per channel, or per
# block where every program's rows lie inside one row block (kernels/proj/block_scales)
FP8_FORMATS = ("fp8-channel", "fp8-block")


def _fp8(shapes: StepShapes, piece: str) -> bool:
    """Whether ``piece`` streams e4m3 weights through the fused kernels (not the LM head)."""
    return shapes.weight_format in FP8_FORMATS and piece != "lm_head"


def measured_all(shapes: StepShapes, bucket: int, tables=None) -> bool:
    """Every projection has a measured choice at ``bucket`` (``proj_tiles.measured``; FP8
    weights: a tile in ``tables.fp8_tiles`` counts too)."""
    return all(
        measured(PIECE_KERNELS[p], bucket, *shapes.shape(p), shapes.elem_bytes, tables)
        or (
            _fp8(shapes, p)
            and fp8_table_tile(
                PIECE_KERNELS[p], bucket, *shapes.shape(p), shapes.elem_bytes, tables
            )
            is not None
        )
        for p in PIECE_KERNELS
    )


def reference_reason(shapes: StepShapes, bucket: int, tuning: DecodeTuning) -> str | None:
    """Why bucket ``bucket`` runs the reference kernels inside the step, or None: the tuning's
    ``reference_rows``; above one row, a projection with no measured tile (other models'
    shapes, float32, shards); a bucket the model measured faster on the reference kernels."""
    if bucket in tuning.reference_rows:
        return "reference_rows"
    if shapes.weight_format not in ("plain", *FP8_FORMATS) or (
        shapes.weight_format == "fp8-block" and shapes.scale_block is None
    ):
        return FP8_REFERENCE
    if bucket > 1 and not measured_all(shapes, bucket, tuning.tables):
        return UNMEASURED
    if reference_bucket(*shapes.qkv, bucket, shapes.elem_bytes, tuning.tables):
        return "measured faster here: REFERENCE_BUCKETS"
    return None


def no_pdl(
    qkv_n: int, k: int, bucket: int, elem_bytes: int, tuning: DecodeTuning | None = None
) -> bool:
    """Whether the projections at ``bucket`` launch without PDL, for a model whose fused qkv
    weight is ``[qkv_n, k]``: ``tuning.pdl.no_pdl_buckets`` if set, else the tables'."""
    t = default_tuning(tuning)
    if t.pdl.no_pdl_buckets is not None:
        return bucket in t.pdl.no_pdl_buckets
    return no_pdl_bucket(qkv_n, k, bucket, elem_bytes, t.tables)


def step_pdl(
    qkv_n: int, k: int, bs: int, bucket: int, elem_bytes: int, tuning: DecodeTuning | None = None
) -> int | bool | None:
    """The projections' ``use_pdl`` for ``bs`` rows in class ``bucket``: None at one row (the
    GEMVs, whatever the bucket), else False where ``no_pdl`` says, else
    ``tuning.pdl.rows_trigger``'s mode."""
    if bs == 1:
        return None
    t = default_tuning(tuning)
    return False if no_pdl(qkv_n, k, bucket, elem_bytes, t) else TRIGGER_MODES[t.pdl.rows_trigger]


def bucket_splits(shapes: StepShapes, bucket: int, tuning: DecodeTuning) -> int:
    """The attention's split count for class ``bucket``: the backend's at its context
    (``PagedAttentionBackend.bucket_splits``), or the ladder's cap at any context."""
    if not shapes.attention_kernel:
        return 1
    n_kv, hd = shapes.attention[1], shapes.attention[2]
    ladder = shapes.split_ladder or tuning.split
    if shapes.split_context is None:
        return ladder_cap(n_kv, bucket, shapes.num_sms, ladder=ladder)
    return num_splits_for(
        shapes.split_context,
        n_kv,
        bucket,
        shapes.num_sms,
        shapes.max_splits,
        head_dim=hd,
        ladder=ladder,
    )


def _cublas(shapes: StepShapes, piece: str, rows: int, tuning: DecodeTuning) -> bool:
    if _fp8(shapes, piece):
        return False  # cuBLAS takes no scaled e4m3 weight here: the fused kernel runs
    e = shapes.elem_bytes
    return prefer_cublas(PIECE_KERNELS[piece], rows, *shapes.shape(piece), e, tuning.tables)


def _separate(shapes: StepShapes, piece: str, rows: int, tuning: DecodeTuning) -> bool:
    e = shapes.elem_bytes
    return separate_norm(PIECE_KERNELS[piece], rows, *shapes.shape(piece), e, tuning.tables)


def _qkv(shapes: StepShapes, rows: int, hand: bool, t: DecodeTuning) -> ProjPlan:
    """qkv on the handoff (``hand``), else with the norm as its own kernel or in the prologue."""
    if _cublas(shapes, "qkv", rows, t):
        return ProjPlan(CUBLAS_HANDOFF if hand else CUBLAS)
    how = HANDOFF if hand else SEPARATE if _separate(shapes, "qkv", rows, t) else FUSED
    half = shapes.attention[2] // 2
    e, fp8 = shapes.elem_bytes, _fp8(shapes, "qkv")
    tile = qkv_tile(how == FUSED, rows, *shapes.qkv, half, e, t.tables, fp8)
    return ProjPlan(how, tile)


def _tile(shapes: StepShapes, kernel: str, piece: str, rows: int, t: DecodeTuning) -> Tile:
    e, fp8 = shapes.elem_bytes, _fp8(shapes, piece)
    return tile_for(kernel, rows, *shapes.shape(piece), e, t.tables, fp8)


def _takes_handoff(shapes: StepShapes, piece: str, rows: int, t: DecodeTuning) -> bool:
    """Whether the norm before ``piece`` (qkv or the LM head) comes from the handoff: where the
    piece is fused, and into a cuBLAS GEMM too (``tuning.handoff.cublas``; not a biased head)."""
    plain = piece == "qkv" or not shapes.head_bias
    return not _cublas(shapes, piece, rows, t) or (t.handoff.cublas and plain)


def _plan(shapes: StepShapes, rows: int, bucket: int, t: DecodeTuning) -> StepPlan:
    reason = reference_reason(shapes, bucket, t)
    if reason is not None:
        return StepPlan(rows, bucket, reference=reason)
    use_pdl = step_pdl(*shapes.qkv, rows, bucket, shapes.elem_bytes, t)
    off = rows > 1 and no_pdl(*shapes.qkv, bucket, shapes.elem_bytes, t)
    ho = not shapes.sharded and t.handoff.enabled and bucket >= t.handoff.min_bucket
    gu_cublas = _cublas(shapes, "gate_up", rows, t)
    o_hands = ho and not gu_cublas
    if gu_cublas:
        gate_up = ProjPlan(CUBLAS)
    else:
        how = HANDOFF if o_hands else SEPARATE if _separate(shapes, "gate_up", rows, t) else FUSED
        gate_up = ProjPlan(
            how,
            _tile(shapes, "gate_up_silu" + ("" if how == FUSED else "_normed"), "gate_up", rows, t),
        )
    to_qkv = ho and _takes_handoff(shapes, "qkv", rows, t)
    to_head = ho and _takes_handoff(shapes, "lm_head", rows, t)
    if shapes.parallel_head:
        head = ProjPlan(PARALLEL, _tile(shapes, "norm_gemv", "lm_head", rows, t))
    elif _cublas(shapes, "lm_head", rows, t):
        head = ProjPlan(CUBLAS_HANDOFF if to_head else CUBLAS)
    else:
        head = ProjPlan(HANDOFF if to_head else FUSED, _tile(shapes, "lm_head", "lm_head", rows, t))
    first = _qkv(shapes, rows, False, t)
    down = _tile(shapes, "gemv_residual", "down", rows, t)
    return StepPlan(
        rows,
        bucket,
        use_pdl=use_pdl,
        no_pdl=off,
        handoff=ho,
        embed_norm=shapes.plain_embed and first.how in (CUBLAS, SEPARATE),
        qkv0=first,
        qkv=_qkv(shapes, rows, to_qkv, t),
        attention=attention_plan(
            shapes.attention,
            bucket_splits(shapes, bucket, t),
            bucket,
            use_pdl,
            t,
            shapes.attention_kernel,
        ),
        o_proj=ProjPlan(FUSED, _tile(shapes, "gemv_residual", "o_proj", rows, t), o_hands),
        gate_up=gate_up,
        down=ProjPlan(FUSED, down, to_qkv),
        down_last=ProjPlan(FUSED, down, to_head),
        lm_head=head,
    )


def plan_step(
    shapes: StepShapes, rows: int, bucket: int, tuning: DecodeTuning | None = None
) -> StepPlan:
    """The fused step's plan for ``rows`` rows replaying in ``bucket`` (``rows == bucket`` for
    a captured graph; eager steps of a live batch choose the tile classes on ``rows``, the
    rest on ``bucket``), computed once per (shapes, rows, bucket) and cached on ``tuning``."""
    t = default_tuning(tuning)
    cache = t.__dict__.get("_step_plans")
    if cache is None:  # the tuning is frozen: its plans ride beside its fields
        cache = {}
        object.__setattr__(t, "_step_plans", cache)
    key = (shapes, rows, bucket)
    plan = cache.get(key)
    if plan is None:
        plan = _plan(shapes, rows, bucket, t)
        if plan.fused and shapes.weight_format == "fp8-block":
            plan = block_plan(shapes, plan)
        cache[key] = plan
    return plan


def block_plan(shapes: StepShapes, plan: StepPlan) -> StepPlan:
    """``plan`` for FP8 weights with block scales: each projection's tile as block scales run
    it (``block_scales.block_tile``: W8A8 from two rows of 2-byte activations), or the
    reference kernels where a tile's rows would straddle two row blocks."""
    bn = shapes.scale_block[0]
    half = shapes.attention[2] // 2
    changes = {}
    for name in ("qkv0", "qkv", "o_proj", "gate_up", "down", "down_last"):
        p = getattr(plan, name)
        if p is None or p.tile is None:
            continue
        piece = name.removesuffix("0").removesuffix("_last")
        kernel = PIECE_KERNELS[piece]
        offset = shapes.gate_up[0] // 2 if piece == "gate_up" else 0
        if not rows_fit(kernel, p.tile, bn, half, offset):
            return StepPlan(
                plan.rows,
                plan.bucket,
                reference=f"FP8 block scales of {bn} rows: {piece}'s tile takes "
                f"{set_rows(kernel, p.tile, half)} rows a program; the FP8-weight GEMV runs",
            )
        changes[name] = replace(p, tile=block_tile(p.tile, plan.rows, shapes.elem_bytes))
    return replace(plan, **changes)


def step_weight_format(model) -> str:
    """ "plain" (the projections in the model's dtype) or ``fp8_linear.weight_format``'s."""
    return weight_format(model) if fp8_modules(model) else "plain"


# model -> (a weak reference to the backend, their StepShapes)
_SHAPES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def step_shapes(model, backend=None) -> StepShapes:
    """``StepShapes`` of ``model`` (a ``LlamaModel``) with ``backend``'s attention (None: the
    model's shapes at any context), cached per model for its last backend."""
    cached = _SHAPES.get(model)
    if cached is not None and cached[0]() is backend:
        return cached[1]
    layer, cfg = model.layers[0], model.config
    attn, mlp = layer.self_attn, layer.mlp
    down, w = mlp.down_proj, attn.qkv_proj.weight
    shape = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    extra = {}
    if backend is not None:
        shape = (backend.num_heads, backend.num_kv_heads, backend.head_dim)
        extra = dict(
            num_sms=backend.num_sms,
            split_context=backend.max_context_len,
            max_splits=backend.max_splits,
            attention_kernel=backend.use_kernel,
            split_ladder=backend.tuning.split,
        )
    fmt = step_weight_format(model)
    fp8 = fmt != "plain"  # the tables' element size: the activations' (the model dtype's)
    blocks = {m.block for m in fp8_modules(model).values()}
    scale_block = blocks.pop() if fmt == "fp8-block" and len(blocks) == 1 else None
    shapes = StepShapes(
        qkv=tuple(w.shape),
        o_proj=tuple(attn.o_proj.weight.shape),
        gate_up=tuple(mlp.gate_up_proj.weight.shape),
        down=tuple(down.weight.shape),
        lm_head=tuple(model.lm_head.weight.shape),
        attention=shape,
        elem_bytes=model.embed_tokens.weight.element_size() if fp8 else w.element_size(),
        sharded=type(down) is RowParallelLinear and down.world_size > 1,
        parallel_head=isinstance(model.lm_head, ParallelLMHead),
        head_bias=getattr(model.lm_head, "bias", None) is not None,
        plain_embed=type(model.embed_tokens) is nn.Embedding,
        weight_format=fmt,
        scale_block=scale_block,
        **extra,
    )
    ref = weakref.ref(backend) if backend is not None else (lambda: None)
    _SHAPES[model] = (ref, shapes)
    return shapes


__all__ = [
    "PIECE_KERNELS",
    "block_plan",
    "FP8_FORMATS",
    "FP8_REFERENCE",
    "UNMEASURED",
    "ProjPlan",
    "StepPlan",
    "StepShapes",
    "bucket_splits",
    "measured_all",
    "no_pdl",
    "plan_step",
    "reference_reason",
    "step_pdl",
    "step_shapes",
    "step_weight_format",
]
