"""``benchmarks/proj_sweep.py --preset``: the shapes it sweeps are the weight shapes the fused
step looks its tiles up by (``fused_decode._measured``: ``lin.weight.shape``), so a sweep's
``--tiles-out`` file applies to that model. Checked on the tiny preset's real weights."""

from __future__ import annotations

import importlib.util
import pathlib

import torch

from stepgraph.model import ModelRunner

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load_sweep():
    spec = importlib.util.spec_from_file_location(
        "proj_sweep", ROOT / "benchmarks" / "proj_sweep.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_preset_shapes_are_the_model_weight_shapes():
    sweep = load_sweep()
    assert sweep.SHAPES["qkv"] == ("qkv_rope", 3072, 2048)  # llama-3.2-1b by default
    sweep.use_preset("tiny")
    mr = ModelRunner.from_preset("tiny", "cpu", torch.float32, max_bs=2, max_context_len=16)
    layer, model = mr.model.layers[0], mr.model
    weights = {
        "qkv": layer.self_attn.qkv_proj,
        "o_proj": layer.self_attn.o_proj,
        "gate_up": layer.mlp.gate_up_proj,
        "down": layer.mlp.down_proj,
        "lm_head": model.lm_head,
    }
    for case, lin in weights.items():
        assert sweep.SHAPES[case][1:] == tuple(lin.weight.shape), case
    assert sweep.SHAPES["qkv_normed"][1:] == sweep.SHAPES["qkv"][1:]
    sweep.use_preset("llama-3.1-8b")
    assert sweep.SHAPES["down"] == ("gemv_residual", 4096, 14336)


def test_a_local_hf_directory_gives_its_shapes(tmp_path):
    import json

    hf = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 1000,
        "hidden_size": 256,
        "intermediate_size": 688,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 512,
        "rope_theta": 10000.0,
    }
    (tmp_path / "config.json").write_text(json.dumps(hf))
    sweep = load_sweep()
    sweep.use_preset(str(tmp_path))
    assert sweep.SHAPES["qkv"] == ("qkv_rope", 256 + 2 * 64, 256)  # head_dim 32, 2 KV heads
    assert sweep.SHAPES["down"] == ("gemv_residual", 256, 688)
    assert sweep.SHAPES["lm_head"] == ("lm_head", 1000, 256)
