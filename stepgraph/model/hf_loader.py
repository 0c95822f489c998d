"""Load a local Hugging Face ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` directory.

Reads ``config.json`` and the ``*.safetensors`` shards (``model.safetensors.index.json`` when
sharded), fuses q/k/v and gate/up on load, and never downloads anything. FP8 checkpoints
(``model/quant.py``: Hugging Face's fine-grained ``fp8``, ``compressed-tensors``) load with their
projections in FP8 (``model/fp8_linear.Fp8Linear``); ``quantization="fp8"`` quantizes an
unquantized checkpoint's projections per channel on load, on the device.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import torch

from ..errors import ConfigError
from .config import ModelConfig, eos_token_ids
from .fp8_linear import LOAD_BLOCKS, check_quantization, swap_in_fp8
from .fp8_weight import Fp8Weight, concat_rows, quantize_per_block, quantize_per_channel
from .llama import LlamaModel
from .quant import detect_format, fp8_weights, is_projection, read_safetensors


def load_hf_config(path: str | Path) -> ModelConfig:
    """The ``ModelConfig`` of the checkpoint directory ``path``."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ConfigError(
            f"{cfg_file} not found; pass a local Hugging Face model directory holding "
            "config.json and *.safetensors (stepgraph never downloads weights)."
        )
    raw = read_json(cfg_file)  # its errors name the file once
    try:
        config = ModelConfig.from_hf_config(raw)
    except ConfigError as e:  # a model stepgraph does not support: it says so, and what is
        raise ConfigError(f"{cfg_file}: {e}") from e
    except KeyError as e:  # a field every Llama/Qwen2 config.json has is missing
        raise ConfigError(
            f"{cfg_file} has no {e} field; is it the checkpoint's own config.json?"
        ) from e
    except (TypeError, ValueError) as e:  # a field of the wrong type
        raise ConfigError(f"{cfg_file}: {e}; is it the checkpoint's own config.json?") from e
    # transformers' generate stops at generation_config.json's eos_token_id when that file
    # exists (even if it names none), else at config.json's: so do we.
    gen_file = path / "generation_config.json"
    if gen_file.is_file():
        eos = read_json(gen_file).get("eos_token_id")
        config = replace(config, eos_token_ids=eos_token_ids(eos))
    return config


def read_json(file: Path) -> dict:
    """The JSON object in ``file``, or ``ConfigError`` naming the file and what is wrong."""
    try:
        value = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{file} is not valid JSON ({e}); re-copy it from the checkpoint.") from e
    if not isinstance(value, dict):
        raise ConfigError(f"{file} holds a {type(value).__name__}, not a JSON object.")
    return value


def shard_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ConfigError(f'{index} has no "weight_map" object; re-copy the checkpoint.')
        names = sorted(set(weight_map.values()))
        files = [path / n for n in names]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ConfigError(
                f"{index.name} lists shards that are missing: {missing}; re-copy the checkpoint."
            )
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ConfigError(
            f"no *.safetensors file in {path}; save the model with safe_serialization=True "
            "(.bin checkpoints are not supported)."
        )
    return files


def read_hf_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint, by their Hugging Face names (on the CPU); a truncated,
    corrupt or unreadable shard is a one-line ConfigError naming it."""
    state: dict[str, torch.Tensor] = {}
    for f in shard_files(Path(path)):
        state.update(read_safetensors(f))
    return state


def _cat(parts: list, name: str):
    """``parts`` stacked on the output dim: tensors by ``torch.cat``, FP8 weights by
    ``concat_rows`` (block scales whose row blocks do not tile every part but the last are
    re-expressed on finer row blocks first: the same scale per element)."""
    fp8 = [isinstance(p, Fp8Weight) for p in parts]
    if not any(fp8):
        return torch.cat(parts)
    if not all(fp8):
        raise ConfigError(
            f"{name}: the checkpoint stores some of its parts in FP8 and some not; the stacked "
            "projections (q/k/v, gate/up) take one format: quantize all of them or none"
        )
    block = parts[0].block
    if block is not None and all(p.block == block for p in parts):
        bn = block[0]
        for p in parts[:-1]:
            bn = math.gcd(bn, p.shape[0])
        if bn != block[0]:
            parts = [_finer_rows(p, bn) for p in parts]
    return concat_rows(parts, name)


def _finer_rows(fw: Fp8Weight, bn: int) -> Fp8Weight:
    """``fw`` with its block scales on row blocks of ``bn`` (a divisor of its ``block[0]``)."""
    rows = -(-fw.shape[0] // bn)
    scale = fw.scale.repeat_interleave(fw.block[0] // bn, 0)[:rows].contiguous()
    return Fp8Weight(fw.data, scale, (bn, fw.block[1]))


def convert_hf_state_dict(
    hf: dict[str, torch.Tensor | Fp8Weight], config: ModelConfig
) -> dict[str, torch.Tensor | Fp8Weight]:
    """Hugging Face names -> ours, with q/k/v and gate/up concatenated on the output dim
    (projections in FP8 stay ``Fp8Weight``s, stacked with their scales)."""
    hf = {k.removeprefix("model."): v for k, v in hf.items()}
    # Buffers some exports carry; they are recomputed.
    hf = {k: v for k, v in hf.items() if not k.endswith("rotary_emb.inv_freq")}
    taken: set[str] = set()

    def take(name: str) -> torch.Tensor:
        if name not in hf:
            raise ConfigError(
                f"checkpoint has no tensor {name!r} ({config.architecture}, "
                f"{config.num_layers} layers); is the directory complete?"
            )
        taken.add(name)
        return hf[name]

    out = {"embed_tokens.weight": take("embed_tokens.weight"), "norm.weight": take("norm.weight")}
    if config.tie_word_embeddings:
        taken.add("lm_head.weight")  # some exports store the tied head; ours shares the embedding
    else:
        out["lm_head.weight"] = take("lm_head.weight")
    for i in range(config.num_layers):
        p = f"layers.{i}."
        attn, mlp = p + "self_attn.", p + "mlp."
        qkv = ("q_proj", "k_proj", "v_proj")
        out[attn + "qkv_proj.weight"] = _cat([take(f"{attn}{n}.weight") for n in qkv], attn + "qkv")
        if config.attention_bias:
            out[attn + "qkv_proj.bias"] = torch.cat([take(f"{attn}{n}.bias") for n in qkv])
        out[attn + "o_proj.weight"] = take(attn + "o_proj.weight")
        gate_up = [take(mlp + "gate_proj.weight"), take(mlp + "up_proj.weight")]
        out[mlp + "gate_up_proj.weight"] = _cat(gate_up, mlp + "gate_up")
        out[mlp + "down_proj.weight"] = take(mlp + "down_proj.weight")
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[f"{p}{norm}.weight"] = take(f"{p}{norm}.weight")
    unused = sorted(set(hf) - taken)
    if unused:
        raise ConfigError(
            f"checkpoint tensors not used by the {config.architecture} model: {unused[:8]}"
            f"{' ...' if len(unused) > 8 else ''}; the config and the weights disagree."
        )
    return out


def fp8_state(path: str | Path, config: ModelConfig, quantization: str | None = None) -> dict:
    """The checkpoint's tensors by our names (``convert_hf_state_dict``), its FP8 projections
    as ``Fp8Weight``s: an FP8 checkpoint's own (``quant.fp8_weights`` checks them), or none;
    ``quantization`` is checked here, applied by ``load_hf_model`` on the device."""
    check_quantization(quantization)
    fmt = detect_format(read_json(Path(path) / "config.json"))
    hf = read_hf_state_dict(path)
    if fmt is not None:
        fp8, rest = fp8_weights(fmt, hf)
        hf = {**rest, **fp8}
    return convert_hf_state_dict(hf, config)


def _build(
    config: ModelConfig,
    device,
    dtype: torch.dtype,
    max_positions: int | None,
    blocks: dict[str, tuple[int, int] | None],
) -> LlamaModel:
    # llama.build_model with the FP8 projections swapped in on meta, before any allocation
    with torch.device("meta"):
        model = LlamaModel(config, max_positions)
    model = model.to(dtype=dtype)
    swap_in_fp8(model, blocks)
    model = model.to_empty(device=device)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model.eval().requires_grad_(False)


def load_hf_model(
    path: str | Path,
    device: torch.device | str,
    dtype: torch.dtype,
    *,
    max_positions: int | None = None,
    quantization: str | None = None,
) -> LlamaModel:
    """Build the model of ``path`` on ``device`` in ``dtype`` with the checkpoint's weights: an
    FP8 checkpoint's projections in FP8; ``quantization="fp8"``: an unquantized checkpoint's
    projections quantized per channel on the device (``"fp8-block"``: per 128 x 128 block;
    an FP8 checkpoint loads as it is)."""
    config = load_hf_config(path)
    state = fp8_state(path, config, quantization)
    if quantization is not None:
        block = LOAD_BLOCKS[quantization]
        for name, t in list(state.items()):
            if is_projection(name) and not isinstance(t, Fp8Weight):
                state[name] = (
                    quantize_per_channel(t.to(device), name)
                    if block is None
                    else quantize_per_block(t.to(device), block, name)
                )
    blocks = {
        name.removesuffix(".weight"): t.block
        for name, t in state.items()
        if isinstance(t, Fp8Weight)
    }
    model = _build(config, device, dtype, max_positions, blocks)
    params = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    with torch.no_grad():
        for name, t in state.items():
            if isinstance(t, Fp8Weight):
                mod = model.get_submodule(name.removesuffix(".weight"))
                if tuple(t.shape) != tuple(mod.weight.shape):
                    raise ConfigError(
                        f"checkpoint tensor {name} has shape {tuple(t.shape)}, the config "
                        f"implies {tuple(mod.weight.shape)}; config.json and the weights disagree."
                    )
                mod.weight.copy_(t.data)
                mod.weight_scale.copy_(t.scale)
                continue
            if tuple(t.shape) != tuple(params[name].shape):
                raise ConfigError(
                    f"checkpoint tensor {name} has shape {tuple(t.shape)}, the config implies "
                    f"{tuple(params[name].shape)}; config.json and the weights disagree."
                )
            params[name].copy_(t)
    model.build_rope()
    return model


__all__ = [
    "convert_hf_state_dict",
    "fp8_state",
    "load_hf_config",
    "load_hf_model",
    "read_hf_state_dict",
]
