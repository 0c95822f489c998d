"""FP8 weights in the decode step on a real GPU (random weights quantized per channel on load, 2
layers of the llama-3.2-1b shapes; block scales whose row blocks the tiles straddle): the fused
step at bs 1 and 8 against the same weights dequantized (float32: per channel and per 128 x 128
block); the plan's routing; exact equals eager bit for bit in bf16 for both (``stepgraph check
--quantization fp8``'s comparison); float32 graph equals eager. Block scales' kernels:
``test_fp8_block_gpu.py``.

Nothing touches CUDA at import time: without a GPU the module imports and every test skips.
"""

from __future__ import annotations

import random

import pytest
import torch

from stepgraph.bench.workload import Point, decode_batch, fill_kv_random
from stepgraph.check import Mix, compare, random_mix, run_check
from stepgraph.engine import Engine
from stepgraph.model import ModelRunner
from stepgraph.model.decode.fused_decode import step_plan
from stepgraph.model.fp8_linear import Fp8Linear, fp8_modules
from stepgraph.model.fp8_weight import quantize_per_block
from stepgraph.tuning import DecodeTuning, NormHandoff

pytestmark = pytest.mark.cuda

DEV = "cuda"


def _runner(dtype, *, layers=2, max_bs=8, ctx=1024, quantization="fp8", seed=3, tuning=None):
    mr = ModelRunner.from_preset(
        "llama-3.2-1b",
        DEV,
        dtype,
        seed=seed,
        num_layers=layers,
        max_bs=max_bs,
        max_context_len=ctx,
        page_size=64,
        quantization=quantization,
        tuning=tuning,
    )
    fill_kv_random(mr)
    return mr


def _dequantized_twin(mr: ModelRunner) -> ModelRunner:
    """Same weights, every FP8 projection dequantized into the model dtype's ``Linear``, run on
    the reference kernels (float32: dequantization exact)."""
    twin = _runner(
        mr.dtype,
        layers=mr.config.num_layers,
        max_bs=mr.max_bs,
        ctx=mr.max_context_len,
        quantization=None,
    )
    with torch.no_grad():
        for name, mod in fp8_modules(mr.model).items():
            twin.model.get_submodule(name).weight.copy_(mod.fp8.dequantize(torch.float32))
        for name, p in mr.model.named_parameters():
            twin.model.get_parameter(name).copy_(p)
    twin.set_kernels("reference")
    return twin


def _logits(mr, bs, ctx=512):
    batch, pages = decode_batch(mr, Point(bs, ctx))
    try:
        return mr.forward(batch).float().clone(), mr.fused_tokens(bs)
    finally:
        for p in pages:
            mr.kv_cache.release(p)


def _quantizing_hook(block_k, quantized_x):
    def hook(module, args):
        return (quantized_x(args[0], block_k).to(args[0].dtype), *args[1:])

    return hook


def _quantize_inputs_as(plan, model) -> list:
    """Forward pre-hooks on ``model``'s projections giving each the input the plan's W8A8
    tiles (``a8``) see: x quantized to e4m3 per row per ``block_k`` chunk
    (``tests.test_fp8_tiles.quantized_x``, exact in the model dtype); the handles."""
    from tests.test_fp8_tiles import quantized_x

    handles = []
    for i, layer in enumerate(model.layers):
        pieces = {
            "self_attn.qkv_proj": plan.qkv0 if i == 0 else plan.qkv,
            "self_attn.o_proj": plan.o_proj,
            "mlp.gate_up_proj": plan.gate_up,
            "mlp.down_proj": plan.down,
        }
        for name, piece in pieces.items():
            if piece.tile is not None and piece.tile.a8:
                hook = _quantizing_hook(piece.tile.block_k, quantized_x)
                handles.append(layer.get_submodule(name).register_forward_pre_hook(hook))
    return handles


@pytest.mark.parametrize("bs", [1, 8])
def test_fused_fp8_step_equals_the_dequantized_weights(bs):
    """The fused FP8 step against the same weights dequantized on the reference kernels; where
    the plan's tiles run W8A8 (from 2 rows), the reference's projections take x quantized
    alike. The norm handoff is off here: with it the kernels quantize r * norm_w, whose e4m3
    roundings a reference normed first cannot reproduce."""
    mr = _runner(torch.bfloat16, tuning=DecodeTuning(handoff=NormHandoff(enabled=False)))
    plan = step_plan(bs, mr.model, mr.attn_backend, mr.tuning)
    assert plan.fused and mr.uses_fused(bs) and not plan.handoff
    assert bs == 1 or any(p.tile.a8 for p in (plan.o_proj, plan.gate_up, plan.down) if p.tile)
    got, tokens = _logits(mr, bs)
    twin = _dequantized_twin(mr)
    _quantize_inputs_as(plan, twin.model)
    ref, _ = _logits(twin, bs)
    assert _rel_err(got, ref, bs) < 3e-2
    assert torch.equal(tokens, got.argmax(-1))
    # the reference kernels (the FP8-weight GEMV) on the same FP8 weights agree as well
    mr.set_kernels("reference")
    _quantize_inputs_as(plan, mr.model)
    fp8_ref, _ = _logits(mr, bs)
    assert _rel_err(got, fp8_ref, bs) < 3e-2


def _rel_err(got: torch.Tensor, ref: torch.Tensor, bs: int) -> float:
    """The error over the reference's size, in the measure each path's rounding allows. One
    row (weights alone in FP8): the largest error over the largest logit, under 3e-2. Several
    rows (W8A8): the error's norm over the reference's, under 3e-2 once divided by
    ``A8_ALLOWANCE``: the kernel and the reference each quantize x to e4m3, from inputs that
    differ by bf16 roundings, so each rounds some values to the neighbouring e4m3 step (1/8
    apart), and over two layers that moved the logits by 6.6% of their norm (measured on the
    H200); a wrong scale or chunk moves them by their whole size."""
    if bs == 1:
        return float((got - ref).abs().max() / ref.abs().max())
    return float((got - ref).norm() / ref.norm()) / A8_ALLOWANCE


A8_ALLOWANCE = 3.5  # 3e-2 x 3.5 = 0.105 of the norm: 1.6 x the 6.6% measured


@pytest.mark.parametrize("quant", ["fp8", "fp8-block"])
@pytest.mark.parametrize("bs", [1, 8])
def test_float32_fp8_step_equals_dequantized_float32(bs, quant):
    mr = _runner(torch.float32, quantization=quant)
    got, _ = _logits(mr, bs)
    ref, _ = _logits(_dequantized_twin(mr), bs)
    assert (got - ref).abs().max() / ref.abs().max() < 1e-4
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_block_scales_whose_row_blocks_the_tiles_straddle_run_the_fp8_gemv():
    """16-row scale blocks: the one-row tiles (4-8 rows a program) fit them and run fused; the
    tensor-core tiles (32-64 rows) do not, and the step runs the FP8-weight GEMV there."""
    mr = _runner(torch.bfloat16)
    with torch.no_grad():
        for name, mod in list(fp8_modules(mr.model).items()):
            fw = quantize_per_block(mod.fp8.dequantize(torch.float32), (16, 128))
            parent, _, child = name.rpartition(".")
            setattr(mr.model.get_submodule(parent), child, Fp8Linear.from_weight(fw, mod.bias))
    assert step_plan(1, mr.model, mr.attn_backend, mr.tuning).fused
    plan = step_plan(8, mr.model, mr.attn_backend, mr.tuning)
    assert "FP8 block scales of 16 rows" in plan.reference
    got, tokens = _logits(mr, 8)
    ref, _ = _logits(_dequantized_twin(mr), 8)
    assert (got - ref).abs().max() / ref.abs().max() < 3e-2
    assert torch.equal(tokens, got.argmax(-1))


@pytest.mark.parametrize("quant", ["fp8", "fp8-block"])
def test_exact_equals_eager_bit_for_bit_with_fp8_weights(quant):
    rows = 8
    mr = _runner(torch.bfloat16, max_bs=rows, seed=5, quantization=quant)
    rng = random.Random(1)
    mixes = [random_mix(rng, mr.config.vocab_size, rows, 200) for _ in range(6)]
    results = run_check(mr, mixes, ["eager", "graph", "exact"], rows, log=lambda line: None)
    for mode in results:
        assert results[mode].errors == [], (mode, results[mode].errors[:3])
    differ, _ = compare(results["eager"], results["exact"])
    assert differ == 0, f"exact differs from eager in {differ} of {len(mixes)} mixes"


def test_exact_equals_eager_with_fp8_weights_in_decode_buckets_past_64_rows():
    """80 and 100 requests decoding at once on a runner of 128 rows: the buckets of 80 and 112
    rows run the FP8 projections as cuBLAS over dequantized chunks (``dequant_linear``), as do
    the prefills of more than 64 tokens; exact equals eager token for token."""
    rows = 128
    mr = _runner(torch.bfloat16, max_bs=rows, seed=7)
    rng = random.Random(2)
    vocab = mr.config.vocab_size
    mixes = [
        Mix(
            [[rng.randrange(1, vocab) for _ in range(rng.randint(1, 150))] for _ in range(n)],
            6,
            None,
        )
        for n in (80, 100)
    ]
    results = run_check(mr, mixes, ["eager", "exact"], rows, log=lambda line: None)
    for mode in results:
        assert results[mode].errors == [], (mode, results[mode].errors[:3])
    differ, _ = compare(results["eager"], results["exact"])
    assert differ == 0, f"exact differs from eager in {differ} of {len(mixes)} mixes"


def test_fp8_1b_graph_equals_eager_in_float32():
    mr = _runner(torch.float32, layers=None, max_bs=4, ctx=256)
    assert len(fp8_modules(mr.model)) == 4 * mr.config.num_layers
    prompts = [[1, 2, 3], list(range(5, 40)), [7] * 11]
    eager = Engine(mr, mode="eager").generate(prompts, max_new_tokens=12, ignore_eos=True)
    graph = Engine(mr, mode="graph").generate(prompts, max_new_tokens=12, ignore_eos=True)
    assert graph == eager
