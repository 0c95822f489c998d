"""Load a local Hugging Face ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` directory.

Reads ``config.json`` and the ``*.safetensors`` shards (``model.safetensors.index.json`` when
sharded), fuses q/k/v and gate/up on load, and never downloads anything.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch

from ..errors import ConfigError
from .config import ModelConfig, eos_token_ids
from .llama import LlamaModel, build_model


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
    """All tensors of the checkpoint, by their Hugging Face names (on the CPU)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in shard_files(Path(path)):
        try:
            state.update(load_file(str(f)))
        except (SafetensorError, OSError) as e:  # truncated, corrupt or unreadable
            raise ConfigError(
                f"{f} cannot be read as safetensors ({e}); the file is truncated or corrupt: "
                "re-copy the checkpoint."
            ) from e
    return state


def convert_hf_state_dict(
    hf: dict[str, torch.Tensor], config: ModelConfig
) -> dict[str, torch.Tensor]:
    """Hugging Face names -> ours, with q/k/v and gate/up concatenated on the output dim."""
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
        out[attn + "qkv_proj.weight"] = torch.cat([take(f"{attn}{n}.weight") for n in qkv])
        if config.attention_bias:
            out[attn + "qkv_proj.bias"] = torch.cat([take(f"{attn}{n}.bias") for n in qkv])
        out[attn + "o_proj.weight"] = take(attn + "o_proj.weight")
        gate_up = [take(mlp + "gate_proj.weight"), take(mlp + "up_proj.weight")]
        out[mlp + "gate_up_proj.weight"] = torch.cat(gate_up)
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


def load_hf_model(
    path: str | Path,
    device: torch.device | str,
    dtype: torch.dtype,
    *,
    max_positions: int | None = None,
) -> LlamaModel:
    """Build the model of ``path`` on ``device`` in ``dtype`` with the checkpoint's weights."""
    config = load_hf_config(path)
    state = convert_hf_state_dict(read_hf_state_dict(path), config)
    model = build_model(config, device, dtype, max_positions=max_positions)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, t in state.items():
            if tuple(t.shape) != tuple(params[name].shape):
                raise ConfigError(
                    f"checkpoint tensor {name} has shape {tuple(t.shape)}, the config implies "
                    f"{tuple(params[name].shape)}; config.json and the weights disagree."
                )
            params[name].copy_(t)
    model.build_rope()
    return model


__all__ = ["convert_hf_state_dict", "load_hf_config", "load_hf_model", "read_hf_state_dict"]
