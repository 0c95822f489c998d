"""FP8 weights in the decode step on a real GPU (random weights quantized per channel on load, 2
layers of the llama-3.2-1b shapes; block scales from a fine-grained layout): the fused step at bs
1 and 8 against the same weights dequantized; the plan's routing; exact equals eager bit for
bit in bf16 (``stepgraph check --quantization fp8``'s comparison); float32 graph equals eager.

Nothing touches CUDA at import time: without a GPU the module imports and every test skips.
"""

from __future__ import annotations

import random

import pytest
import torch

from stepgraph.bench.workload import Point, decode_batch, fill_kv_random
from stepgraph.check import compare, random_mix, run_check
from stepgraph.engine import Engine
from stepgraph.model import ModelRunner
from stepgraph.model.decode.fused_decode import step_plan
from stepgraph.model.decode.step_plan import FP8_REFERENCE
from stepgraph.model.fp8_linear import Fp8Linear, fp8_modules
from stepgraph.model.fp8_weight import quantize_per_block

pytestmark = pytest.mark.cuda

DEV = "cuda"


def _runner(dtype, *, layers=2, max_bs=8, ctx=1024, quantization="fp8", seed=3):
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


@pytest.mark.parametrize("bs", [1, 8])
def test_fused_fp8_step_equals_the_dequantized_weights(bs):
    mr = _runner(torch.bfloat16)
    plan = step_plan(bs, mr.model, mr.attn_backend, mr.tuning)
    assert plan.fused and mr.uses_fused(bs)
    got, tokens = _logits(mr, bs)
    ref, _ = _logits(_dequantized_twin(mr), bs)
    # W8A8 tiles (from 2 rows) quantize the activations to e4m3 too: 4 significant bits
    tol = 8e-2 if any(p.tile.a8 for p in (plan.qkv, plan.o_proj, plan.down) if p.tile) else 3e-2
    err = (got - ref).abs().max() / ref.abs().max()
    assert err < tol, float(err)
    assert torch.equal(tokens, got.argmax(-1))
    # the reference kernels (the FP8-weight GEMV) on the same FP8 weights agree as well
    mr.set_kernels("reference")
    fp8_ref, _ = _logits(mr, bs)
    assert (got - fp8_ref).abs().max() / fp8_ref.abs().max() < tol


@pytest.mark.parametrize("bs", [1, 8])
def test_float32_fp8_step_equals_dequantized_float32(bs):
    mr = _runner(torch.float32)
    got, _ = _logits(mr, bs)
    ref, _ = _logits(_dequantized_twin(mr), bs)
    assert (got - ref).abs().max() / ref.abs().max() < 1e-4
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_block_scales_run_the_fp8_gemv():
    mr = _runner(torch.bfloat16)
    with torch.no_grad():
        for name, mod in list(fp8_modules(mr.model).items()):
            fw = quantize_per_block(mod.fp8.dequantize(torch.float32), (128, 128))
            parent, _, child = name.rpartition(".")
            setattr(mr.model.get_submodule(parent), child, Fp8Linear.from_weight(fw, mod.bias))
    for bs in (1, 8):
        plan = step_plan(bs, mr.model, mr.attn_backend, mr.tuning)
        assert plan.reference == FP8_REFERENCE
    got, tokens = _logits(mr, 8)
    ref, _ = _logits(_dequantized_twin(mr), 8)
    assert (got - ref).abs().max() / ref.abs().max() < 3e-2
    assert torch.equal(tokens, got.argmax(-1))


def test_exact_equals_eager_bit_for_bit_with_fp8_weights():
    rows = 8
    mr = _runner(torch.bfloat16, max_bs=rows, seed=5)
    rng = random.Random(1)
    mixes = [random_mix(rng, mr.config.vocab_size, rows, 200) for _ in range(6)]
    results = run_check(mr, mixes, ["eager", "graph", "exact"], rows, log=lambda line: None)
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
