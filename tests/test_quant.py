"""FP8 checkpoints on the CPU: tiny synthetic Llama and Qwen2 checkpoints written with
safetensors in both formats (Hugging Face's fine-grained ``fp8`` with block scales,
``compressed-tensors`` per channel and per tensor), their detection, every refusal as one line
naming the format found and the formats supported, the weights dequantized against float64,
quantization on load and its error bounds."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from stepgraph.errors import ConfigError
from stepgraph.model.config import ModelConfig
from stepgraph.model.fp8_weight import (
    E4M3_MAX,
    MAX_SCALE,
    Fp8Weight,
    concat_rows,
    quantize_per_block,
    quantize_per_channel,
)
from stepgraph.model.hf_loader import convert_hf_state_dict, read_json
from stepgraph.model.quant import (
    SUPPORTED,
    QuantFormat,
    check_tensors,
    detect_format,
    fp8_weights,
    is_projection,
    quantize_weights,
    read_safetensors,
)

F8 = torch.float8_e4m3fn
BLOCK = [32, 32]
SHAPES = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=144,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
)  # intermediate 144: the last 32-blocks of gate/up (N) and down (K) are partial
ARCH = {
    "llama": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", tie_word_embeddings=False
    ),
    "qwen2": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", tie_word_embeddings=True),
}
QC = {
    "fp8": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": BLOCK},
    "channel": {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "ignore": ["lm_head"],
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 8,
                    "type": "float",
                    "strategy": "channel",
                    "symmetric": True,
                },
                "input_activations": {
                    "num_bits": 8,
                    "type": "float",
                    "strategy": "token",
                    "dynamic": True,
                },
            }
        },
    },
}


def one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def hf_tensors(arch: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random float32 weights by Hugging Face name (Qwen2: q/k/v biases, tied head)."""
    g = torch.Generator().manual_seed(seed)
    h, inter, v, hd = 64, 144, 96, 16
    out = {
        "model.embed_tokens.weight": torch.randn(v, h, generator=g),
        "model.norm.weight": 1 + 0.1 * torch.randn(h, generator=g),
    }
    if arch == "llama":
        out["lm_head.weight"] = torch.randn(v, h, generator=g)
    for i in range(2):
        p = f"model.layers.{i}."
        shapes = {
            "self_attn.q_proj": (4 * hd, h),
            "self_attn.k_proj": (2 * hd, h),
            "self_attn.v_proj": (2 * hd, h),
            "self_attn.o_proj": (h, 4 * hd),
            "mlp.gate_proj": (inter, h),
            "mlp.up_proj": (inter, h),
            "mlp.down_proj": (h, inter),
        }
        for name, shape in shapes.items():
            out[f"{p}{name}.weight"] = torch.randn(*shape, generator=g) * shape[1] ** -0.5
        if arch == "qwen2":
            for name in ("q_proj", "k_proj", "v_proj"):
                out[f"{p}self_attn.{name}.bias"] = 0.1 * torch.randn(
                    shapes[f"self_attn.{name}"][0], generator=g
                )
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[f"{p}{norm}.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
    return out


def quantized_tensors(arch: str, kind: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """``hf_tensors`` with the projections in FP8 the way the format stores them."""
    out = {}
    for name, t in hf_tensors(arch, seed).items():
        if not is_projection(name):
            out[name] = t.to(torch.bfloat16)
            continue
        mod = name.removesuffix(".weight")
        if kind == "fp8":
            fw = quantize_per_block(t, tuple(BLOCK))
            out[name], out[mod + ".weight_scale_inv"] = fw.data, fw.scale
        else:
            fw = quantize_per_channel(t)
            out[name], out[mod + ".weight_scale"] = fw.data, fw.scale[:, None].clone()
            out[mod + ".input_scale"] = torch.ones(1)  # static activation scale: dropped
    return out


def write_checkpoint(path, arch: str, kind: str, tensors=None) -> None:
    cfg = {**SHAPES, **ARCH[arch], "quantization_config": QC[kind]}
    (path / "config.json").write_text(json.dumps(cfg))
    save_file(
        tensors if tensors is not None else quantized_tensors(arch, kind),
        str(path / "model.safetensors"),
    )


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("kind", ["fp8", "channel"])
def test_synthetic_checkpoint_loads_and_dequantizes_exactly(tmp_path, arch, kind):
    write_checkpoint(tmp_path, arch, kind)
    config = read_json(tmp_path / "config.json")
    fmt = detect_format(config)
    assert fmt.method == ("fp8" if kind == "fp8" else "compressed-tensors")
    assert fmt.block == (tuple(BLOCK) if kind == "fp8" else None)
    tensors = read_safetensors(tmp_path / "model.safetensors")
    fp8, rest = fp8_weights(fmt, tensors)
    assert len(fp8) == 14 and all(is_projection(n) for n in fp8)
    assert not any(n.endswith(("scale", "scale_inv")) for n in rest)  # input_scale dropped too
    for name, fw in fp8.items():
        mod = name.removesuffix(".weight")
        scale = tensors[f"{mod}.weight_scale_inv" if kind == "fp8" else f"{mod}.weight_scale"]
        ref = tensors[name].double()
        if kind == "fp8":  # element (n, k) times block (n // 32, k // 32), by hand
            n, k = ref.shape
            rows, cols = torch.arange(n) // 32, torch.arange(k) // 32
            ref = ref * scale.double()[rows[:, None], cols[None, :]]
        else:
            ref = ref * scale.double()
        assert torch.equal(fw.dequantize(torch.float64), ref)
        assert torch.equal(fw.dequantize(), ref.float())  # float32: the product rounded once
    # the dequantized weights and the rest are exactly what the loader takes
    model_cfg = ModelConfig.from_hf_config(config)
    state = {**rest, **{n: fw.dequantize() for n, fw in fp8.items()}}
    ours = convert_hf_state_dict(state, model_cfg)
    assert "layers.1.mlp.gate_up_proj.weight" in ours


def test_detect_format_reads_both_formats_fields():
    assert detect_format({"hidden_size": 8}) is None
    fmt = detect_format(
        {
            "quantization_config": {
                "quant_method": "fp8",
                "weight_block_size": [128, 128],
                "fmt": "e4m3",
                "modules_to_not_convert": ["lm_head", "model.layers.0.mlp"],
            }
        }
    )
    assert fmt == QuantFormat(
        "fp8", "block", (128, 128), "weight_scale_inv", ("lm_head", "model.layers.0.mlp")
    )
    per_tensor = detect_format({"quantization_config": {"quant_method": "fp8"}})
    assert (per_tensor.strategy, per_tensor.scale_name) == ("tensor", "weight_scale")
    ct = detect_format({"quantization_config": QC["channel"]})
    assert ct == QuantFormat("compressed-tensors", "channel", None, "weight_scale", ("lm_head",))
    block = json.loads(json.dumps(QC["channel"]))
    w = block["config_groups"]["group_0"]["weights"]
    w.update(strategy="block", block_structure=[128, 64])
    assert detect_format({"compression_config": block}).block == (128, 64)


def test_ignore_lists_match_names_patterns_and_dotted_parts():
    ignore = ("lm_head", "re:.*layers\\.1\\..*down_proj", "layers.0.mlp")
    fmt = QuantFormat("compressed-tensors", "channel", ignore=ignore)
    assert fmt.skips("lm_head") and fmt.skips("model.layers.1.mlp.down_proj")
    assert fmt.skips("model.layers.0.mlp.up_proj")
    assert not fmt.skips("model.layers.0.mlp_x.up_proj")  # a dotted part, not a prefix
    assert not fmt.skips("model.layers.10.mlp.up_proj") and not fmt.skips("lm_head_2")
    assert not fmt.skips("model.layers.0.mlp.down_proj".replace("0", "2"))


def _ct(**weights) -> dict:
    qc = json.loads(json.dumps(QC["channel"]))
    qc["config_groups"]["group_0"]["weights"].update(weights)
    return {"quantization_config": qc}


@pytest.mark.parametrize(
    "config, found",
    [
        ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "'gptq' (4-bit)"),
        ({"quantization_config": {"quant_method": "awq", "w_bit": 4}}, "'awq' (4-bit)"),
        ({"quantization_config": {"quant_method": "bitsandbytes"}}, "'bitsandbytes'"),
        ({"quantization_config": {"load_in_4bit": True}}, "quant_method None"),
        ({"quantization_config": "fp8"}, "a str"),
        ({"quantization_config": {"quant_method": "fp8", "fmt": "e5m2"}}, "fmt 'e5m2'"),
        ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128]}}, "[128]"),
        (
            {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 96]}},
            "128x96",
        ),
        (
            {"quantization_config": {"quant_method": "fp8", "modules_to_not_convert": "lm_head"}},
            "modules_to_not_convert",
        ),
        (_ct(num_bits=4, type="int"), "4-bit int weights"),
        (_ct(num_bits=8, type="int"), "8-bit int weights"),
        (_ct(num_bits=4), "4-bit float weights"),
        (_ct(strategy="group", group_size=128), "strategy 'group'"),
        (
            {"quantization_config": {**QC["channel"], "format": "pack-quantized"}},
            "format 'pack-quantized'",
        ),
        ({"quantization_config": {**QC["channel"], "config_groups": {}}}, "no config_groups"),
        (
            {
                "quantization_config": {
                    **QC["channel"],
                    "config_groups": {"g": {"input_activations": {"num_bits": 8}}},
                }
            },
            "quantizes no weights",
        ),
        (
            {
                "quantization_config": {
                    **QC["channel"],
                    "config_groups": {
                        "a": {"weights": {"num_bits": 8, "type": "float", "strategy": "channel"}},
                        "b": {"weights": {"num_bits": 8, "type": "float", "strategy": "tensor"}},
                    },
                }
            },
            "different schemes",
        ),
    ],
)
def test_detect_format_refuses_in_one_line_naming_found_and_supported(config, found):
    with pytest.raises(ConfigError) as e:
        detect_format(config)
    msg = one_line(e)
    assert found in msg and SUPPORTED in msg


def _refused(tensors, kind="fp8") -> str:
    fmt = detect_format({"quantization_config": QC[kind]})
    with pytest.raises(ConfigError) as e:
        check_tensors(fmt, tensors)
    msg = one_line(e)
    assert "quant_method" in msg, msg  # the format found is named
    return msg


Q0 = "model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize("kind", ["fp8", "channel"])
def test_check_tensors_refuses_a_weight_of_the_wrong_dtype(kind):
    for dtype in (torch.bfloat16, torch.int8, torch.float8_e5m2):
        t = quantized_tensors("llama", kind)
        t[Q0 + ".weight"] = t[Q0 + ".weight"].float().to(dtype)
        msg = _refused(t, kind)
        assert f"{Q0}.weight: {dtype}" in msg and SUPPORTED in msg


@pytest.mark.parametrize("kind", ["fp8", "channel"])
def test_check_tensors_refuses_a_missing_scale_and_a_wrong_shape(kind):
    name = Q0 + (".weight_scale_inv" if kind == "fp8" else ".weight_scale")
    t = quantized_tensors("qwen2", kind)
    del t[name]
    assert f"{name} is missing" in _refused(t, kind)
    for bad in ((2, 3), (64, 2), (65, 1), (3,)):
        t = quantized_tensors("qwen2", kind)
        t[name] = torch.ones(bad)
        assert f"{name} has shape {bad}" in _refused(t, kind)
    t = quantized_tensors("qwen2", kind)
    t[name] = t[name].to(torch.int32)
    assert "scales of torch.int32" in _refused(t, kind)


@pytest.mark.parametrize("kind", ["fp8", "channel"])
def test_check_tensors_refuses_nan_inf_and_overflowing_scales(kind):
    name = Q0 + (".weight_scale_inv" if kind == "fp8" else ".weight_scale")
    for bad, said in ((float("nan"), "NaN"), (float("inf"), "inf"), (-float("inf"), "inf")):
        t = quantized_tensors("llama", kind)
        t[name].view(-1)[-1] = bad
        with pytest.raises(ConfigError, match=f"{name}: a scale is {said}"):
            check_tensors(detect_format({"quantization_config": QC[kind]}), t)
    # the largest finite scale 448 times which stays finite is taken; the next float is not
    limit = torch.tensor(MAX_SCALE, dtype=torch.float32)
    assert torch.isfinite(limit * E4M3_MAX) and (limit.double() * E4M3_MAX) <= 3.4028234664e38
    for value, ok in ((limit, True), (torch.nextafter(limit, torch.tensor(1e38)), False)):
        t = quantized_tensors("llama", kind)
        t[name].view(-1)[0] = value
        fmt = detect_format({"quantization_config": QC[kind]})
        if ok:
            assert torch.isfinite(fp8_weights(fmt, t)[0][Q0 + ".weight"].dequantize()).all()
        else:
            with pytest.raises(ConfigError, match="overflows float32"):
                check_tensors(fmt, t)


def test_check_tensors_keeps_the_head_and_ignored_modules_unquantized():
    t = quantized_tensors("llama", "channel")
    t["lm_head.weight"] = t["lm_head.weight"].float().to(F8)
    assert "lm_head.weight is float8" in _refused(t, "channel")
    # an ignored projection stays in the model's dtype: taken as such, refused in FP8
    qc = json.loads(json.dumps(QC["fp8"]))
    qc["modules_to_not_convert"] = ["model.layers.1.mlp.down_proj"]
    fmt = detect_format({"quantization_config": qc})
    t = quantized_tensors("llama", "fp8")
    name = "model.layers.1.mlp.down_proj"
    with pytest.raises(ConfigError, match=f"{name}.weight is float8 but"):
        check_tensors(fmt, t)
    t[name + ".weight"] = hf_tensors("llama")[name + ".weight"].to(torch.bfloat16)
    del t[name + ".weight_scale_inv"]
    fp8, rest = fp8_weights(fmt, t)
    assert name + ".weight" not in fp8 and rest[name + ".weight"].dtype == torch.bfloat16
    assert len(fp8) == 13


def test_truncated_and_missing_safetensors_are_one_line(tmp_path):
    write_checkpoint(tmp_path, "llama", "fp8")
    f = tmp_path / "model.safetensors"
    data = f.read_bytes()
    for cut in (len(data) // 2, 7):
        f.write_bytes(data[:cut])
        with pytest.raises(ConfigError, match="truncated or corrupt") as e:
            read_safetensors(f)
        assert str(f) in one_line(e)
    with pytest.raises(ConfigError, match="truncated or corrupt"):
        read_safetensors(tmp_path / "absent.safetensors")


def test_quantize_per_channel_error_bounds_and_safe_scales():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(48, 200, generator=g) * torch.logspace(-3, 3, 48)[:, None]
    w[5] = 0  # a zero row
    w[6] = 1e-44  # amax / 448 underflows float32
    w[7, 3] = -7.5  # one large element sets the row's scale
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        src = w.to(dtype)
        fw = quantize_per_channel(src)
        assert fw.data.dtype == F8 and fw.scale.dtype == torch.float32 and fw.block is None
        assert torch.isfinite(fw.scale).all() and (fw.scale > 0).all()
        assert fw.scale[5] == 1 and fw.scale[6] == 1
        assert fw.data.view(torch.uint8)[5].eq(0).all()
        amax = src.float().abs().amax(1)
        assert torch.equal(
            fw.data.float().abs().amax(1)[amax > 1e-30],
            torch.full((int((amax > 1e-30).sum()),), E4M3_MAX),
        )
        deq, ref = fw.dequantize(torch.float64), src.double()
        bound = ref.abs() / 16 + fw.scale.double()[:, None] / 1024 + 1e-40
        assert ((deq - ref).abs() <= bound).all()
        assert not torch.isnan(fw.dequantize()).any()


def test_quantize_per_block_partial_blocks_and_bounds():
    g = torch.Generator().manual_seed(4)
    w = torch.randn(70, 90, generator=g)
    w[64:, :] *= 1000  # the last, partial row block has its own scale
    fw = quantize_per_block(w, (32, 64))
    assert fw.scale.shape == (3, 2) and fw.kind == "per 32x64 block"
    assert fw.scale[2, 0] > 100 * fw.scale[0, 0]
    deq = fw.dequantize(torch.float64)
    assert (
        (deq - w.double()).abs() <= w.double().abs() / 16 + fw.expanded_scale(torch.float64) / 1024
    ).all()
    assert fw.nbytes == 70 * 90 + 4 * 6


def test_fp8_weight_refuses_mismatched_parts_and_concatenates():
    data = torch.zeros(4, 8, dtype=F8)
    with pytest.raises(ConfigError, match=r"shape \(4,\) .*got torch.float32 of shape \(4, 1\)"):
        Fp8Weight(data, torch.ones(4, 1))
    with pytest.raises(ConfigError, match="float8_e4m3fn"):
        Fp8Weight(torch.zeros(4, 8), torch.ones(4))
    with pytest.raises(ConfigError, match=r"shape \(2, 1\)"):
        Fp8Weight(data, torch.ones(1, 1), (2, 8))
    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(64, 40, generator=g), torch.randn(40, 40, generator=g)
    cat = concat_rows([quantize_per_channel(a), quantize_per_channel(b)])
    assert torch.equal(
        cat.dequantize(), torch.cat([quantize_per_channel(x).dequantize() for x in (a, b)])
    )
    blocks = concat_rows([quantize_per_block(a, (32, 32)), quantize_per_block(b, (32, 32))])
    assert blocks.scale.shape == (2 + 2, 2)
    with pytest.raises(ConfigError, match="not multiples of the 32-row"):
        concat_rows([quantize_per_block(b, (32, 32)), quantize_per_block(a, (32, 32))])
    with pytest.raises(ConfigError, match="differ in scale layout"):
        concat_rows([quantize_per_channel(a), quantize_per_block(b, (32, 32))])


def test_quantize_weights_takes_projections_only_and_honours_ignore():
    t = hf_tensors("qwen2")
    t["model.layers.0.self_attn.qkv_proj.weight"] = torch.randn(128, 64)  # our fused name
    fp8, rest = quantize_weights(t, ignore=["model.layers.1.mlp.up_proj"])
    assert "model.layers.0.self_attn.qkv_proj.weight" in fp8
    assert "model.layers.1.mlp.up_proj.weight" in rest and len(fp8) == 14
    assert {n for n in rest if "embed" in n or "norm" in n or "bias" in n} == set(rest) - {
        "model.layers.1.mlp.up_proj.weight"
    }
    with pytest.raises(ConfigError, match="NaN or inf"):
        quantize_weights({"model.layers.0.mlp.down_proj.weight": torch.full((2, 2), torch.nan)})
    already = {"model.layers.0.mlp.down_proj.weight": torch.zeros(2, 2, dtype=F8)}
    with pytest.raises(ConfigError, match="already float8"):
        quantize_weights(already)
