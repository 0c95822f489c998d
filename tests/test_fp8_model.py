"""FP8 weights in the model, on the CPU: a preset and tiny Llama / Qwen2 checkpoints in both FP8
formats (and unquantized ones quantized on load) give, with float32 activations, the greedy
tokens of a float32 run on the same weights dequantized (scale x weight), ours and
transformers'; what stays unquantized; the refusals, one line each; the plan's routing."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import save_file

from stepgraph.engine import Engine
from stepgraph.errors import ConfigError
from stepgraph.model import ModelRunner
from stepgraph.model.decode.step_plan import (
    CUBLAS,
    CUBLAS_HANDOFF,
    FP8_FUSED,
    FP8_REFERENCE,
    plan_step,
    reference_reason,
    step_shapes,
)
from stepgraph.model.fp8_linear import (
    LOAD_BLOCKS,
    Fp8Linear,
    check_quantization,
    fp8_modules,
    load_format,
    quantize_model,
    weight_format,
)
from stepgraph.model.fp8_weight import Fp8Weight, quantize_per_block, quantize_per_channel
from stepgraph.model.hf_loader import _cat
from stepgraph.model.llama import Linear, build_model
from stepgraph.tuning import DecodeTuning

from .test_quant import ARCH, SHAPES, hf_tensors, one_line, write_checkpoint

NEW = 10


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in (3, 11, 20)]


def dequantized_runner(mr: ModelRunner) -> ModelRunner:
    """A float32 ModelRunner over the same weights, every FP8 projection dequantized into a
    plain ``Linear`` (the reference the FP8 model must equal)."""
    model = mr.model
    ref = build_model(model.config, "cpu", torch.float32, max_positions=model.max_positions)
    fp8 = fp8_modules(model)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            mod, _, leaf = name.rpartition(".")
            if mod in fp8 and leaf == "weight":
                p.copy_(fp8[mod].fp8.dequantize(torch.float32))
            else:
                p.copy_(model.get_parameter(name))
    ref.build_rope()
    return ModelRunner.from_model(
        ref, device="cpu", dtype=torch.float32, max_bs=mr.max_bs, max_context_len=mr.max_context_len
    )


def _generate(mr: ModelRunner, prompts) -> list[list[int]]:
    return Engine(mr, mode="eager").generate(prompts, max_new_tokens=NEW, ignore_eos=True)


@pytest.mark.parametrize("quant", ["fp8", "fp8-block"])
def test_preset_quantized_on_load_equals_its_dequantized_float32_run(quant):
    mr = ModelRunner.from_preset(
        "tiny", "cpu", torch.float32, quantization=quant, max_bs=4, max_context_len=128
    )
    model = mr.model
    fp8 = fp8_modules(model)
    block = LOAD_BLOCKS[quant]
    assert len(fp8) == 4 * model.config.num_layers
    assert all(m.block == block and m.weight.dtype == torch.float8_e4m3fn for m in fp8.values())
    assert type(model.lm_head) is Linear and model.lm_head.weight.dtype == torch.float32
    assert model.embed_tokens.weight.dtype == torch.float32
    assert weight_format(model) == load_format(quant)[0]
    prompts = _prompts(model.config.vocab_size)
    ours = _generate(mr, prompts)
    assert ours == _generate(dequantized_runner(mr), prompts)
    assert len({tuple(t) for t in ours}) == 3
    # the quantization is the per-channel rule of the unquantized preset's weights
    plain = ModelRunner.from_preset("tiny", "cpu", torch.float32, max_bs=4, max_context_len=128)
    w = plain.model.layers[1].mlp.down_proj.weight
    q = model.layers[1].mlp.down_proj
    want = quantize_per_channel(w) if block is None else quantize_per_block(w, block)
    assert torch.equal(q.weight.view(torch.uint8), want.data.view(torch.uint8))
    assert torch.equal(q.weight_scale, want.scale)


def _hf_reference(arch: str, mr: ModelRunner):
    """transformers' float32 model over ``mr``'s weights dequantized."""
    transformers = pytest.importorskip("transformers")
    cfg = {**SHAPES, **ARCH[arch], "torch_dtype": "float32"}
    hf_cfg = transformers.AutoConfig.for_model(
        **{k: v for k, v in cfg.items() if k != "architectures"}
    )
    hf = transformers.AutoModelForCausalLM.from_config(hf_cfg).float().eval()
    ref = dequantized_runner(mr).model
    hd = mr.config.head_dim
    q, kv = mr.config.num_heads * hd, mr.config.num_kv_heads * hd
    inter = mr.config.intermediate_size
    state = {}
    for name, t in ref.state_dict().items():
        if "rope" in name:
            continue
        if "qkv_proj" in name:
            for part, sl in (
                ("q_proj", slice(0, q)),
                ("k_proj", slice(q, q + kv)),
                ("v_proj", slice(q + kv, q + 2 * kv)),
            ):
                state["model." + name.replace("qkv_proj", part)] = t[sl]
        elif "gate_up_proj" in name:
            state["model." + name.replace("gate_up_proj", "gate_proj")] = t[:inter]
            state["model." + name.replace("gate_up_proj", "up_proj")] = t[inter:]
        elif name == "lm_head.weight":
            state[name] = t
        else:
            state["model." + name] = t
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied in Qwen2
    return hf


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("kind", ["fp8", "channel"])
def test_fp8_checkpoints_equal_their_dequantized_float32_runs(tmp_path, arch, kind):
    write_checkpoint(tmp_path, arch, kind)
    mr = ModelRunner.from_hf_dir(tmp_path, "cpu", torch.float32, max_bs=4, max_context_len=128)
    fp8 = fp8_modules(mr.model)
    assert len(fp8) == 8
    want = (16, 32) if kind == "fp8" else None  # 32-row blocks re-expressed on 16 (144 rows)
    assert {m.block for n, m in fp8.items() if "gate_up" in n} == {want}
    assert weight_format(mr.model) == ("fp8-block" if kind == "fp8" else "fp8-channel")
    assert (mr.model.layers[0].self_attn.qkv_proj.bias is not None) == (arch == "qwen2")
    prompts = _prompts(SHAPES["vocab_size"])
    ours = _generate(mr, prompts)
    assert ours == _generate(dequantized_runner(mr), prompts)
    hf = _hf_reference(arch, mr)
    with torch.no_grad():
        for p, got in zip(prompts, ours):
            out = hf.generate(
                torch.tensor([p]),
                max_new_tokens=NEW,
                min_new_tokens=NEW,
                do_sample=False,
                pad_token_id=0,
            )
            assert got == out[0, len(p) :].tolist()


@pytest.mark.parametrize("quant", ["fp8", "fp8-block"])
def test_unquantized_checkpoint_quantized_on_load(tmp_path, quant):
    tensors = hf_tensors("llama")
    cfg = {**SHAPES, **ARCH["llama"]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    mr = ModelRunner.from_hf_dir(
        tmp_path, "cpu", torch.float32, quantization=quant, max_bs=4, max_context_len=128
    )
    block = LOAD_BLOCKS[quant]
    qkv = mr.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, Fp8Linear) and qkv.block == block
    stacked = torch.cat([tensors[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
    want = quantize_per_channel(stacked) if block is None else quantize_per_block(stacked, block)
    assert torch.equal(qkv.weight_scale, want.scale)
    assert torch.equal(qkv.weight.view(torch.uint8), want.data.view(torch.uint8))
    plain = ModelRunner.from_hf_dir(tmp_path, "cpu", torch.float32, max_bs=4, max_context_len=128)
    assert not fp8_modules(plain.model)
    prompts = _prompts(SHAPES["vocab_size"])
    assert _generate(mr, prompts) == _generate(dequantized_runner(mr), prompts)


def test_an_fp8_checkpoint_with_quantization_fp8_loads_as_it_is(tmp_path):
    write_checkpoint(tmp_path, "llama", "fp8")
    mr = ModelRunner.from_hf_dir(
        tmp_path, "cpu", torch.float32, quantization="fp8", max_context_len=64
    )
    assert weight_format(mr.model) == "fp8-block"


@pytest.mark.parametrize("bad", ["int4", "FP8", "bf16", ""])
def test_other_quantizations_are_refused_in_one_line(bad, tmp_path):
    with pytest.raises(ConfigError, match="supported: None") as e:
        check_quantization(bad)
    assert repr(bad) in one_line(e)
    with pytest.raises(ConfigError, match="supported"):
        ModelRunner.from_preset("tiny", quantization=bad)
    write_checkpoint(tmp_path, "llama", "channel")
    with pytest.raises(ConfigError, match="supported"):
        ModelRunner.from_hf_dir(tmp_path, quantization=bad)


def test_a_quantized_model_is_not_quantized_twice():
    mr = ModelRunner.from_preset("tiny", quantization="fp8", max_context_len=64)
    with pytest.raises(ConfigError, match="already FP8") as e:
        quantize_model(mr.model)
    one_line(e)


def test_stacked_parts_take_one_format():
    fw = quantize_per_channel(torch.randn(8, 16))
    with pytest.raises(ConfigError, match="some of its parts in FP8") as e:
        _cat([fw, torch.randn(8, 16)], "layers.0.self_attn.qkv")
    one_line(e)
    a = Fp8Weight(fw.data, torch.rand(1, 1) + 0.5, (8, 16))
    b = Fp8Weight(torch.zeros(4, 16, dtype=torch.float8_e4m3fn), torch.rand(1, 1) + 0.5, (8, 16))
    # a's 8 rows then b's 4: stacked on 8-row blocks as they are
    both = _cat([a, b], "x")
    assert both.block == (8, 16) and torch.equal(
        both.dequantize(), torch.cat([a.dequantize(), b.dequantize()])
    )
    # 12 rows then 4 on 8-row blocks: re-expressed on 4-row blocks, the same values
    c = Fp8Weight(torch.ones(12, 16).to(torch.float8_e4m3fn), torch.tensor([[2.0], [3.0]]), (8, 16))
    both = _cat([c, b], "x")
    assert both.block == (4, 16)
    assert torch.equal(both.dequantize(), torch.cat([c.dequantize(), b.dequantize()]))


def test_the_plan_routes_fp8_weights_in_one_place(tmp_path):
    mr = ModelRunner.from_preset(
        "llama-3.2-1b", quantization="fp8", num_layers=1, max_context_len=64
    )
    shapes = step_shapes(mr.model)
    # per channel: the fused kernels (W_FP8), looked up at the activations' element size
    assert shapes.weight_format == FP8_FUSED and shapes.elem_bytes == 4
    plain = step_shapes(ModelRunner.from_preset("tiny", max_context_len=64).model)
    assert plain.weight_format == "plain"
    t = DecodeTuning.default()
    bf16 = replace(shapes, elem_bytes=2)  # the 1B's measured tables
    for rows in (1, 8, 32, 64):
        plan = plan_step(bf16, rows, rows, t)
        assert plan.fused, (rows, plan.reference)
        for proj in (plan.qkv0, plan.qkv, plan.gate_up):  # never cuBLAS: no e4m3 there
            assert proj.how not in (CUBLAS, CUBLAS_HANDOFF), (rows, proj)
    plain_plan = plan_step(replace(bf16, weight_format="plain"), 64, 64, t)
    assert CUBLAS in (plain_plan.qkv.how, plain_plan.qkv0.how) or "cublas" in str(plain_plan)
    # block scales: the fused kernels too, where every program's rows lie inside a row
    # block; from two rows of bf16 every tile runs W8A8 (x scaled by the block's scales, then
    # rounded to e4m3); else the reference kernels (the FP8-weight GEMV)
    # (the plan reads the shapes alone: the 1B's, as --quantization fp8-block loads them)
    blocks = replace(bf16, weight_format="fp8-block", scale_block=LOAD_BLOCKS["fp8-block"])
    for rows in (1, 8, 32, 64):
        plan = plan_step(blocks, rows, rows, t)
        assert plan.fused, (rows, plan.reference)
        tiles = [p.tile for p in (plan.qkv0, plan.qkv, plan.o_proj, plan.gate_up, plan.down)]
        assert all(tile.a8 for tile in tiles) == (rows > 1), (rows, tiles)
    narrow = replace(blocks, scale_block=(16, 128))  # 16-row blocks: the one-row tiles fit
    assert plan_step(narrow, 1, 1, t).fused
    assert "FP8 block scales of 16 rows" in plan_step(narrow, 8, 8, t).reference
    for mixed in (replace(blocks, scale_block=None), replace(blocks, weight_format="mixed")):
        assert reference_reason(mixed, 8, t) == FP8_REFERENCE  # blocks or formats that differ
    # a checkpoint's blocks that differ between projections: the reference kernels
    write_checkpoint(tmp_path, "llama", "fp8")
    ckpt = step_shapes(ModelRunner.from_hf_dir(tmp_path, max_context_len=64).model)
    if ckpt.scale_block is None:
        assert plan_step(ckpt, 8, 8, t).reference == FP8_REFERENCE


def test_an_fp8_projection_takes_the_gemv_up_to_64_rows_and_dequantized_chunks_past_them():
    """On CUDA the way through an FP8 projection is a function of its rows alone (a decode
    bucket, a prefill, eager or captured alike): the GEMV exactly at 64 rows, cuBLAS over
    dequantized chunks one past; the CPU runs the reference."""
    from stepgraph.kernels.proj.fp8_gemv import MAX_M

    way = Fp8Linear.way
    assert MAX_M == 64
    assert [way(r, True) for r in (1, 63, 64)] == ["gemv"] * 3
    assert [way(r, True) for r in (65, 512, 4096)] == ["dequant"] * 3
    assert way(0, True) == "dequant" and way(8, True, rows_contiguous=False) == "dequant"
    assert {way(r, False) for r in (1, 64, 65)} == {"reference"}
