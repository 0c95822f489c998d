"""``Fp8Linear``: a projection whose weight is held in FP8 (e4m3) with float32 scales per output
channel or per block, and the model-level pieces around it: which modules of a model are FP8
(``fp8_modules``), swapping them in (``swap_in_fp8``), and quantizing a model's projections in
place on load (``quantize_model``).

The module keeps the ``nn.Linear`` names the step reads: ``weight`` is the e4m3 data ``[N, K]``
(so ``weight.shape`` and ``weight.element_size()`` describe what a step reads),
``weight_scale`` the float32 scales (``[N]``, or ``[ceil(N / bn), ceil(K / bk)]`` with
``block``), ``bias`` in the model's dtype. Its forward:
- on CUDA, up to 64 rows: the FP8-weight GEMV (``kernels/proj/fp8_gemv``), the scales applied
  in registers, no dequantized weight;
- more rows on CUDA (a large decode bucket, a prefill): cuBLAS over the weight dequantized in
  one pass a chunk of output rows at a time (``fp8_dequant.dequant_linear``): a chunk of
  ``CHUNK_BYTES`` is the most dequantized weight alive, so a graph's pool holds a chunk, not a
  weight; from 128 rows the faster way (docs/experiments.md#fp8-weights-past-64-rows);
- on the CPU (the reference): one GEMM over the whole weight dequantized in torch ops.
The choice is a function of the rows alone, so eager, graph and exact run the same kernels.
The LM head and the embeddings are never FP8: they stay in the model's dtype.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError
from ..kernels.proj.fp8_dequant import dequant_linear, dequantize
from ..kernels.proj.fp8_gemv import MAX_M as FP8_MAX_M
from ..kernels.proj.fp8_gemv import fp8_gemv
from .fp8_weight import (
    FP8_DTYPE,
    Fp8Weight,
    quantize_per_block,
    quantize_per_channel,
    scale_shape,
)
from .llama import Linear

# what ``quantization=`` takes (None: the checkpoint's own format), and the scale blocks each
# quantizes to on load: "fp8" per output channel, "fp8-block" per 128 x 128 block (Hugging
# Face's fine-grained FP8 layout, as Qwen3-FP8 and DeepSeek-V3 ship)
LOAD_BLOCKS: dict[str, tuple[int, int] | None] = {"fp8": None, "fp8-block": (128, 128)}
QUANTIZATIONS = tuple(LOAD_BLOCKS)
FP8_PROJECTIONS = (
    "self_attn.qkv_proj",
    "self_attn.o_proj",
    "mlp.gate_up_proj",
    "mlp.down_proj",
)  # a layer's projections, by their names in ``llama.DecoderLayer``


def check_quantization(quantization: str | None) -> str | None:
    """``quantization`` if it is None or one of ``QUANTIZATIONS``, else a one-line ConfigError
    naming it and the choices."""
    if quantization is None or quantization in QUANTIZATIONS:
        return quantization
    raise ConfigError(
        f"quantization={quantization!r} is not supported; supported: None (the checkpoint's "
        "own weights), 'fp8' (e4m3 weights, per-channel scales computed on load) or "
        "'fp8-block' (e4m3 weights, a scale per 128 x 128 block)"
    )


def load_format(quantization: str) -> tuple[str, tuple[int, int] | None]:
    """``(weight_format, scale block)`` that ``quantization`` loads to: ``("fp8-channel",
    None)`` or ``("fp8-block", (128, 128))``."""
    block = LOAD_BLOCKS[check_quantization(quantization)]
    return ("fp8-channel" if block is None else "fp8-block"), block


class Fp8Linear(nn.Module):
    """``y = x @ (weight * scale).T + bias`` with ``weight`` in e4m3; see the module's note."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        block: tuple[int, int] | None = None,
        bias: bool = False,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.block = None if block is None else (int(block[0]), int(block[1]))
        shape = scale_shape(out_features, in_features, self.block)
        kw = dict(device=device)
        self.register_buffer(
            "weight", torch.zeros(out_features, in_features, dtype=FP8_DTYPE, **kw)
        )
        self.register_buffer("weight_scale", torch.ones(shape, dtype=torch.float32, **kw))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, **kw)) if bias else None
        if self.bias is not None:
            self.bias.requires_grad_(False)

    @classmethod
    def from_weight(cls, fw: Fp8Weight, bias: torch.Tensor | None = None) -> Fp8Linear:
        """A module holding ``fw`` (no copy) and ``bias``."""
        n, k = fw.shape
        dtype = bias.dtype if bias is not None else torch.bfloat16
        mod = cls(k, n, block=fw.block, bias=bias is not None, dtype=dtype, device=fw.data.device)
        mod.weight, mod.weight_scale = fw.data, fw.scale
        if bias is not None:
            mod.bias = nn.Parameter(bias.detach(), requires_grad=False)
        return mod

    @property
    def fp8(self) -> Fp8Weight:
        """The weight as an ``Fp8Weight`` (checked)."""
        return Fp8Weight(self.weight, self.weight_scale, self.block)

    @property
    def weight_format(self) -> str:
        """``"fp8-channel"`` or ``"fp8-block"``."""
        return "fp8-channel" if self.block is None else "fp8-block"

    @property
    def nbytes(self) -> int:
        """Bytes a step reads of this projection: e4m3 data, float32 scales, the bias."""
        bias = self.bias.numel() * self.bias.element_size() if self.bias is not None else 0
        return self.weight.numel() + 4 * self.weight_scale.numel() + bias

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """``weight * scale`` in ``dtype``: a temporary, the same bits on CUDA (one Triton pass)
        as on the CPU (torch ops through float32)."""
        return dequantize(self.weight, self.weight_scale, self.block, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        way = self.way(x.shape[0], x.is_cuda, x.stride(-1) == 1)
        if way == "reference":
            return F.linear(x, self.dequantized(x.dtype), self.bias)
        if way == "gemv":
            return fp8_gemv(x, self.weight, self.weight_scale, self.block, self.bias)
        return dequant_linear(x, self.weight, self.weight_scale, self.block, self.bias)

    @staticmethod
    def way(rows: int, cuda: bool, rows_contiguous: bool = True) -> str:
        """The forward's way for ``rows`` rows, a function of the rows alone on CUDA (so every
        mode runs the same kernels): ``"gemv"`` up to 64 rows, ``"dequant"`` (cuBLAS over
        chunks of dequantized weight) past them, ``"reference"`` on the CPU."""
        if not cuda:
            return "reference"
        return "gemv" if 0 < rows <= FP8_MAX_M and rows_contiguous else "dequant"

    def extra_repr(self) -> str:
        kind = "per channel" if self.block is None else f"per {self.block[0]}x{self.block[1]} block"
        return f"in_features={self.in_features}, out_features={self.out_features}, e4m3 {kind}"


def scale_kwargs(proj: nn.Module) -> dict:
    """A fused projection kernel's ``w_scale`` and ``w_block`` for ``proj``: an ``Fp8Linear``'s
    scales and their block (None per channel), None for a weight in the model's dtype."""
    return dict(w_scale=getattr(proj, "weight_scale", None), w_block=getattr(proj, "block", None))


def fp8_modules(model: nn.Module) -> dict[str, Fp8Linear]:
    """The model's FP8 projections by module name (empty: an unquantized model)."""
    return {n: m for n, m in model.named_modules() if isinstance(m, Fp8Linear)}


def weight_format(model: nn.Module) -> str:
    """``"fp8-channel"``, ``"fp8-block"``, ``"mixed"`` (some FP8 projections, some not, or both
    scale layouts) or the model's dtype name (``"bfloat16"``: no FP8 projection)."""
    projs = [layer.get_submodule(p) for layer in model.layers for p in FP8_PROJECTIONS]
    kinds = {p.weight_format if isinstance(p, Fp8Linear) else "plain" for p in projs}
    if kinds == {"plain"}:
        return str(model.layers[0].self_attn.o_proj.weight.dtype).removeprefix("torch.")
    return kinds.pop() if len(kinds) == 1 else "mixed"


def _set(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def swap_in_fp8(model: nn.Module, blocks: Mapping[str, tuple[int, int] | None]) -> None:
    """Replace each projection named in ``blocks`` (module name -> its scale block, None: per
    channel) by an uninitialised ``Fp8Linear`` of its shape on its device (meta included)."""
    for name, block in blocks.items():
        old = model.get_submodule(name)
        w = old.weight
        new = Fp8Linear(
            old.in_features,
            old.out_features,
            block=block,
            bias=old.bias is not None,
            dtype=w.dtype,
            device=w.device,
        )
        _set(model, name, new)


@torch.no_grad()
def quantize_model(model: nn.Module, block: tuple[int, int] | None = None) -> nn.Module:
    """Every decoder projection of ``model`` quantized in place, per output channel
    (``fp8_weight.quantize_per_channel``) or per ``block`` (``quantize_per_block``); the
    embeddings, norms and LM head untouched. A model already in FP8 is refused (it quantizes
    once, on load)."""
    if fp8_modules(model):
        raise ConfigError(
            "the model's projections are already FP8: quantization='fp8' takes an unquantized "
            "model or checkpoint (an FP8 checkpoint loads as it is)"
        )
    for i, layer in enumerate(model.layers):
        for p in FP8_PROJECTIONS:
            old = layer.get_submodule(p)
            if type(old) is not Linear:
                raise ConfigError(
                    f"layers.{i}.{p} is a {type(old).__name__}: quantization='fp8' takes an "
                    "unsharded model (tensor-parallel shards are not quantized)"
                )
            what = f"layers.{i}.{p}.weight"
            fw = (
                quantize_per_channel(old.weight, what)
                if block is None
                else quantize_per_block(old.weight, block, what)
            )
            _set(layer, p, Fp8Linear.from_weight(fw, old.bias))
            del old
    return model


__all__ = [
    "FP8_PROJECTIONS",
    "Fp8Linear",
    "LOAD_BLOCKS",
    "QUANTIZATIONS",
    "check_quantization",
    "load_format",
    "fp8_modules",
    "quantize_model",
    "scale_kwargs",
    "swap_in_fp8",
    "weight_format",
]
