"""The LM head on CUDA writes float32 logits itself (cuBLAS through ``torch.mm``'s
``out_dtype``), into the caller's rows when it has them all: no temporary in the model dtype,
the same bits with or without ``out``, and closer to float64 than bf16's rounding allows."""

from __future__ import annotations

import pytest
import torch

from stepgraph.graph_pool import GraphPool
from stepgraph.model.llama import Linear
from stepgraph.model.model_runner import ModelRunner
from stepgraph.runner import CudaGraphRunner, RunnerConfig

pytestmark = pytest.mark.cuda
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

HIDDEN, VOCAB = 2048, 128256  # llama-3.2-1b's


@pytest.fixture(scope="module")
def mr():
    return ModelRunner.from_preset(
        "llama-3.2-1b",
        "cuda",
        torch.bfloat16,
        seed=1,
        num_layers=1,
        max_bs=128,
        max_context_len=256,
    )


def head(dtype=torch.bfloat16) -> Linear:
    lin = Linear(HIDDEN, VOCAB, bias=False).to("cuda", dtype)
    lin.out_dtype = torch.float32  # as LlamaModel sets its head
    torch.nn.init.normal_(lin.weight, std=HIDDEN**-0.5)
    return lin


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 65, 512])
def test_cublas_writes_float32_logits_closer_to_float64_than_bf16_rounding(rows, dtype):
    lin = head(dtype)
    g = torch.Generator(device="cuda").manual_seed(rows)
    h = torch.randn(rows, HIDDEN, device="cuda", generator=g).to(dtype)
    assert lin.widens(h)
    got = lin(h)
    assert got.dtype == torch.float32 and got.shape == (rows, VOCAB)
    ref = h.double() @ lin.weight.double().t()
    err = (got.double() - ref).abs().max().item()
    rounding = (ref - ref.to(dtype).double()).abs().max().item()  # one rounding to dtype
    assert err < rounding / 4, (err, rounding)


def test_logits_into_out_are_the_same_bits_as_without_and_leave_other_rows(mr):
    model = mr.model
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(80, HIDDEN, device="cuda", generator=g).to(torch.bfloat16)
    ref = model.logits(h)
    out = torch.full((96, VOCAB), float("nan"), device="cuda")
    got = model.logits(h, out[:80])  # every row: the head writes into out
    assert got.data_ptr() == out.data_ptr() and torch.equal(got, ref)
    assert out[80:].isnan().all()  # rows past the head's untouched
    out.fill_(float("nan"))
    part = model.logits(h, out[:33])  # fewer rows than h: the GEMM at 80 rows, 33 kept
    assert torch.equal(part, ref[:33]) and out[33:].isnan().all()


def test_no_head_temporary_in_the_decode_graph_pool_past_64_rows(mr):
    """At bucket 128 (the reference kernels past the fused 64 rows) the graph's pool holds no
    ``[128, vocab]`` bf16 head output: the head writes float32 into the shared output."""
    cfg = RunnerConfig(max_bs=128, capture_bs=(128,), show_progress=False)
    runner = CudaGraphRunner(mr, cfg, pool=GraphPool())
    temp = 128 * VOCAB * 2  # the bf16 head output the pool held before
    assert runner.stats.capture.pool_bytes < temp, runner.stats.capture.ledger_table()
    runner.shutdown()
