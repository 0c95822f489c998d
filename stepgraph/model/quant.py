"""FP8 checkpoint formats: which one a ``config.json`` names (``detect_format``), whether the
tensors agree with it (``check_tensors``), which modules are quantized, and the checkpoint's
projections as ``Fp8Weight``s (``fp8_weights``), or a bf16 checkpoint's quantized on load
(``quantize_weights``).

Formats, from ``config.json``'s ``quantization_config``:
- ``quant_method: "fp8"``: Hugging Face's fine-grained FP8 (transformers' ``FineGrainedFP8Config``;
  Qwen3-FP8 and DeepSeek-V3 ship it): e4m3 ``weight``, float32 ``weight_scale_inv`` per
  ``weight_block_size`` block (``[128, 128]``), dequantized as ``weight * weight_scale_inv``;
  ``modules_to_not_convert`` stay unquantized. Without ``weight_block_size``, vLLM's serialized
  FP8: one ``weight_scale`` per tensor.
- ``quant_method: "compressed-tensors"`` (llm-compressor, ``float-quantized``): every config
  group's ``weights`` 8-bit ``float``, ``strategy`` channel (``weight_scale [N, 1]``), tensor
  (``[1]``) or block (``block_structure``); ``ignore`` names (or ``re:`` patterns) unquantized.
Activation quantization (``activation_scheme``, ``input_activations``, ``input_scale``) is
dropped: activations stay in the model's dtype. Per-tensor scales become per-channel ones (the
number repeated), so fused q/k/v and gate/up keep one layout. The projections (q, k, v, o,
gate, up, down) are quantized; the embeddings, norms and LM head stay in the model's dtype.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigError
from .fp8_weight import FP8_DTYPE, Fp8Weight, check_scale_values, quantize_per_channel

SUPPORTED = (
    "supported: quant_method 'fp8' (e4m3 weights, weight_scale_inv per weight_block_size "
    "block, or one weight_scale per tensor), 'compressed-tensors' (8-bit float weights, "
    "strategy channel, tensor or block), or an unquantized checkpoint with quantization='fp8' "
    "(per-channel scales on load)"
)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FUSED_PROJECTIONS = ("qkv_proj", "gate_up_proj")  # ours, after q/k/v and gate/up are stacked
DROPPED_SUFFIXES = (".input_scale", ".k_scale", ".v_scale")  # activation / KV-cache scales


@dataclass(frozen=True)
class QuantFormat:
    """An FP8 checkpoint format: ``method`` as ``quant_method`` names it, ``strategy`` block,
    channel or tensor, the scale ``block`` (block strategy), the scale tensors' suffix and the
    modules left unquantized (``ignore``)."""

    method: str  # "fp8" | "compressed-tensors"
    strategy: str  # "block" | "channel" | "tensor"
    block: tuple[int, int] | None = None
    scale_name: str = "weight_scale"
    ignore: tuple[str, ...] = ()

    def describe(self) -> str:
        detail = f"{self.block[0]}x{self.block[1]} blocks" if self.block else self.strategy
        return f"quant_method {self.method!r} ({detail}, {self.scale_name})"

    def skips(self, module: str) -> bool:
        """Whether ``module`` (a Hugging Face module name) is left unquantized: an ``ignore``
        entry equal to it or to a dotted part of it, or a ``re:`` pattern matching it."""
        dotted = f".{module}."
        for entry in self.ignore:
            if entry.startswith("re:"):
                if re.match(entry[3:], module):
                    return True
            elif f".{entry}." in dotted:
                return True
        return False


def _refuse(found: str, why: str = "is not supported") -> ConfigError:
    return ConfigError(f"quantization_config: {found} {why}; {SUPPORTED}")


def _names(value: Any, field: str, found: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _refuse(found, f"has a {field} that is not a list of module names")
    return tuple(value)


def _block(value: Any, found: str) -> tuple[int, int]:
    if (
        not isinstance(value, (list, tuple))
        or len(value) != 2
        or not all(isinstance(b, int) and b > 0 for b in value)
    ):
        raise _refuse(found, f"has a block size {value!r}, not two positive integers")
    bn, bk = value
    if bk < 16 or bk & (bk - 1):
        raise _refuse(found, f"has blocks {bn}x{bk}: the kernels take K blocks of 2^j >= 16")
    return bn, bk


def _fp8_format(qc: Mapping[str, Any]) -> QuantFormat:
    found = "quant_method 'fp8'"
    if qc.get("fmt", "e4m3") != "e4m3":
        raise _refuse(f"{found} with fmt {qc.get('fmt')!r}", "is not supported (e4m3 only)")
    ignore = _names(qc.get("modules_to_not_convert"), "modules_to_not_convert", found)
    ignore += _names(qc.get("ignored_layers"), "ignored_layers", found)
    if qc.get("weight_block_size") is None:
        return QuantFormat("fp8", "tensor", None, "weight_scale", ignore)
    block = _block(qc["weight_block_size"], found)
    return QuantFormat("fp8", "block", block, "weight_scale_inv", ignore)


def _compressed_format(qc: Mapping[str, Any]) -> QuantFormat:
    found = "quant_method 'compressed-tensors'"
    fmt = qc.get("format")
    if fmt not in (None, "float-quantized", "naive-quantized"):
        raise _refuse(f"{found} with format {fmt!r}", "is not supported (float-quantized only)")
    groups = qc.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        raise _refuse(found, "has no config_groups")
    schemes = set()
    for name, group in groups.items():
        w = group.get("weights") if isinstance(group, Mapping) else None
        if not isinstance(w, Mapping):
            raise _refuse(f"{found} group {name!r}", "quantizes no weights")
        bits, kind, strategy = w.get("num_bits"), w.get("type"), w.get("strategy")
        if bits != 8 or kind != "float":
            raise _refuse(f"{found} group {name!r} with {bits}-bit {kind} weights")
        if strategy not in ("channel", "tensor", "block"):
            raise _refuse(f"{found} group {name!r} with strategy {strategy!r}")
        block = _block(w.get("block_structure"), found) if strategy == "block" else None
        schemes.add((strategy, block))
    if len(schemes) != 1:
        raise _refuse(f"{found} with groups of different schemes {sorted(map(str, schemes))}")
    ((strategy, block),) = schemes
    ignore = _names(qc.get("ignore"), "ignore", found)
    return QuantFormat("compressed-tensors", strategy, block, "weight_scale", ignore)


def detect_format(config: Mapping[str, Any]) -> QuantFormat | None:
    """The FP8 format a ``config.json`` object names, None when it names no quantization;
    a one-line ConfigError for any other (another ``quant_method``, int4, non-float types)."""
    qc = config.get("quantization_config", config.get("compression_config"))
    if qc is None:
        return None
    if not isinstance(qc, Mapping):
        raise _refuse(f"a {type(qc).__name__}", "is not an object")
    method = qc.get("quant_method")
    if method == "fp8":
        return _fp8_format(qc)
    if method == "compressed-tensors":
        return _compressed_format(qc)
    bits = qc.get("bits", qc.get("w_bit"))
    raise _refuse(f"quant_method {method!r}" + (f" ({bits}-bit)" if bits else ""))


def module_of(weight_name: str) -> str:
    """``"model.layers.0.mlp.up_proj.weight"`` -> ``"model.layers.0.mlp.up_proj"``."""
    return weight_name.removesuffix(".weight")


def is_projection(weight_name: str) -> bool:
    """Whether ``weight_name`` is a decoder layer's projection weight (HF names or ours)."""
    parts = weight_name.split(".")
    return (
        len(parts) >= 3
        and parts[-1] == "weight"
        and parts[-2] in PROJECTIONS + FUSED_PROJECTIONS
        and "layers" in parts
    )


def quantized_names(fmt: QuantFormat | None, names: Iterable[str]) -> list[str]:
    """The weight names among ``names`` the format stores in FP8: projections not ignored."""
    return [n for n in names if is_projection(n) and not (fmt and fmt.skips(module_of(n)))]


def _scale_ok(fmt: QuantFormat, scale: torch.Tensor, n: int, k: int) -> bool:
    shape = tuple(scale.shape)
    if fmt.strategy == "tensor":
        return shape in ((), (1,))
    if fmt.strategy == "channel":
        return shape in ((n,), (n, 1))
    bn, bk = fmt.block
    return shape == (-(-n // bn), -(-k // bk))


def check_tensors(fmt: QuantFormat, tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """The weight names stored in FP8 (HF names), after checking every tensor against ``fmt``:
    one-line ConfigErrors for a weight of the wrong dtype, a missing scale, a scale of the wrong
    dtype or shape, NaN or inf in a scale, an unquantized module stored in FP8."""
    where = f"checkpoint in {fmt.describe()}"
    quantized = quantized_names(fmt, tensors)
    for name in quantized:
        w = tensors[name]
        if w.dtype != FP8_DTYPE:
            raise ConfigError(
                f"{name}: {w.dtype} in a {where}; expected torch.float8_e4m3fn; {SUPPORTED}"
            )
        scale_name = f"{module_of(name)}.{fmt.scale_name}"
        scale = tensors.get(scale_name)
        if scale is None:
            raise ConfigError(f"{scale_name} is missing from the {where}; {SUPPORTED}")
        if not scale.is_floating_point() or scale.dtype == FP8_DTYPE:
            raise ConfigError(f"{scale_name}: scales of {scale.dtype} in a {where}; {SUPPORTED}")
        if not _scale_ok(fmt, scale, *w.shape):
            raise ConfigError(
                f"{scale_name} has shape {tuple(scale.shape)} for a {tuple(w.shape)} weight, "
                f"which is not the {fmt.strategy} layout of the {where}; {SUPPORTED}"
            )
        check_scale_values(scale, scale_name)
    taken = set(quantized)
    for name, t in tensors.items():
        if t.dtype == FP8_DTYPE and name not in taken:
            raise ConfigError(
                f"{name} is float8 but the {where} leaves it unquantized (the embeddings, norms "
                f"and LM head stay in the model's dtype; ignore lists are honoured); {SUPPORTED}"
            )
    return quantized


def _per_channel_or_block(fmt: QuantFormat, data: torch.Tensor, scale: torch.Tensor) -> Fp8Weight:
    s = scale.detach().float()
    if fmt.strategy == "tensor":
        s = s.reshape(1).expand(data.shape[0])
    elif fmt.strategy == "channel":
        s = s.reshape(-1)
    return Fp8Weight(data.contiguous(), s.contiguous(), fmt.block)


def fp8_weights(
    fmt: QuantFormat, tensors: Mapping[str, torch.Tensor]
) -> tuple[dict[str, Fp8Weight], dict[str, torch.Tensor]]:
    """``(FP8 weights by weight name, the other tensors)``: ``check_tensors``, then each FP8
    weight with its scale as an ``Fp8Weight``; scales and activation scales leave the rest."""
    quantized = check_tensors(fmt, tensors)
    scales = {f"{module_of(n)}.{fmt.scale_name}" for n in quantized}
    fp8 = {
        n: _per_channel_or_block(fmt, tensors[n], tensors[f"{module_of(n)}.{fmt.scale_name}"])
        for n in quantized
    }
    rest = {
        n: t
        for n, t in tensors.items()
        if n not in fp8 and n not in scales and not n.endswith(DROPPED_SUFFIXES)
    }
    return fp8, rest


def quantize_weights(
    tensors: Mapping[str, torch.Tensor], ignore: Iterable[str] = ()
) -> tuple[dict[str, Fp8Weight], dict[str, torch.Tensor]]:
    """An unquantized checkpoint's (or model's) projections quantized per channel on load,
    ``(FP8 weights by name, the other tensors)``; ``ignore`` as a format's ignore list."""
    fmt = QuantFormat("fp8", "channel", ignore=tuple(ignore))
    names = quantized_names(fmt, tensors)
    for name in names:
        if tensors[name].dtype == FP8_DTYPE:
            raise ConfigError(
                f"{name} is already float8: quantization='fp8' takes an unquantized checkpoint; "
                "an FP8 checkpoint loads as it is"
            )
    fp8 = {n: quantize_per_channel(tensors[n], n) for n in names}
    return fp8, {n: t for n, t in tensors.items() if n not in fp8}


def read_safetensors(file: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of one ``.safetensors`` file, or a one-line ConfigError naming the file when
    it is truncated, corrupt or unreadable."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(file))
    except (SafetensorError, OSError, RuntimeError) as e:
        raise safetensors_error(file, e) from e


def safetensors_error(file: str | Path, error: BaseException) -> ConfigError:
    """safetensors' error as one line: the file, what it said, the fix."""
    said = " ".join(str(error).split()) or type(error).__name__
    return ConfigError(
        f"{file} cannot be read as safetensors ({said}); the file is truncated or corrupt: "
        "re-copy the checkpoint"
    )


__all__ = [
    "DROPPED_SUFFIXES",
    "PROJECTIONS",
    "QuantFormat",
    "SUPPORTED",
    "check_tensors",
    "detect_format",
    "fp8_weights",
    "is_projection",
    "module_of",
    "quantize_weights",
    "quantized_names",
    "read_safetensors",
    "safetensors_error",
]
