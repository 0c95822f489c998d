"""Compile, for sm_90 and without a GPU, every Triton kernel the fused decode step launches.

Run by ``tests/test_sm90_compile.py`` in a process of its own without ``TRITON_INTERPRET`` (the
kernels must be Triton's compiled functions, not the interpreter's). A stand-in driver answers
Triton's device queries with an H200's target, every launch is turned into Triton's warm-up
(compile, no launch), and PDL and TMA are switched on as on a Hopper GPU. The step then runs
its Python over CPU tensors at Llama-3.2-1B's shapes (two layers) at bs 1, 8, 32 and 64, so
each kernel variant the GPU would compile is compiled here, to PTX and a cubin (Triton ships
ptxas); the attention's split + combine and its folded merge, the greedy tokens after a
cuBLAS head, the prefill's extend attention, the graph-input kernel, the reference path's GEMV
and SiLU·mul, the FP8-weight GEMV (both scale layouts, one row and tensor-core rows) and
the one-pass FP8 dequantization are launched directly (the test checks that every kernel
of the package is among them). The interpreter takes what the GPU compiler refuses (a
plain-int global, a type mismatch), so this is the CPU tier's only check of that. Prints
one JSON line.
"""

from __future__ import annotations

import json
import os
import re
import sys

assert "TRITON_INTERPRET" not in os.environ, "run without TRITON_INTERPRET"

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
import triton.runtime.jit as jit  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402


class _H200:
    """Triton's device queries, answered for device 0 of an H200 (sm_90)."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")


driver.set_active(_H200())
COMPILED: list[tuple[str, object]] = []
_run = jit.JITFunction.run


def _warmup(self, *args, grid, warmup, **kwargs):  # every launch compiles and returns
    kernel = _run(self, *args, grid=grid, warmup=True, **kwargs)
    COMPILED.append((self.fn.__name__, kernel))
    return kernel


jit.JITFunction.run = _warmup

from stepgraph.kernels import pdl  # noqa: E402
from stepgraph.kernels.prefill import extend_attention as ea  # noqa: E402
from stepgraph.kernels.proj import proj_tiles, tma_tiles  # noqa: E402


def _tma_ready(*tensors):  # as on a Hopper GPU: the layout rules alone
    return all(
        t.dim() == 2
        and t.stride(1) == 1
        and t.shape[0] > 0
        and t.data_ptr() % 16 == 0
        and (t.stride(0) * t.element_size()) % 16 == 0
        for t in tensors
    )


pdl.pdl_enabled = lambda device: device is not None and pdl.HAS_GDC
tma_tiles.tma_ready = proj_tiles.tma_ready = _tma_ready
_check_extend = ea.check_extend_inputs  # its CPU-tensor refusal lifted, as the interpreter's
ea.check_extend_inputs = lambda *a, **k: _check_extend(*a, **{**k, "interpreted": True})

from stepgraph.bench.workload import Point, decode_batch  # noqa: E402
from stepgraph.kernels.decode.decode_inputs import DecodeWorkspace  # noqa: E402
from stepgraph.kernels.decode.flash_decode import flash_decode  # noqa: E402
from stepgraph.kernels.elementwise.fused_act import silu_mul  # noqa: E402
from stepgraph.kernels.proj.fp8_dequant import dequantize_fp8  # noqa: E402
from stepgraph.kernels.proj.fp8_gemv import fp8_gemv  # noqa: E402
from stepgraph.kernels.proj.gemv import gemv  # noqa: E402
from stepgraph.kernels.sampling.argmax_rows import argmax_rows  # noqa: E402
from stepgraph.model import ModelRunner  # noqa: E402
from stepgraph.model.decode import fused_decode  # noqa: E402
from stepgraph.runner.graph_inputs import fill_inputs  # noqa: E402
from stepgraph.runner.input_buffers import GraphInputBuffers, pad_row  # noqa: E402
from stepgraph.runner.staging import PinnedStaging  # noqa: E402
from stepgraph.runner.token_mirror import BLOCK, SLOTS, _mirror_kernel  # noqa: E402

PLAIN = 64  # a plain global: the compiler refuses it in a kernel, the interpreter takes it


@triton.jit
def _refused(x_ptr):
    tl.store(x_ptr, tl.load(x_ptr) + PLAIN)


def _trigger(ptx: str) -> str:
    """Where ``launch_dependents`` sits: "none"; "before loops" (before every loop: a backward
    branch's span); "after mma loops" (after every loop holding a tensor-core op); "other"."""
    lines = ptx.splitlines()
    at = [i for i, s in enumerate(lines) if "griddepcontrol.launch_dependents" in s]
    if not at:
        return "none"
    labels = {m[1]: i for i, s in enumerate(lines) if (m := re.match(r"\s*(\$L__\w+):", s))}
    loops = []
    for i, s in enumerate(lines):
        m = re.search(r"\bbra(?:\.uni)?\s+(\$L__\w+);", s)
        if m and labels.get(m[1], i + 1) <= i:
            loops.append((labels[m[1]], i))
    mma = [(a, b) for a, b in loops if any("mma" in lines[j] for j in range(a, b))]
    if not loops or at[0] < min(a for a, _ in loops):
        return "before loops"
    return "after mma loops" if mma and at[0] > max(b for _, b in mma) else "other"


def _variants(since: int) -> list[dict]:
    out = []
    for name, k in COMPILED[since:]:
        ptx = k.asm.get("ptx", "")
        tma = "cp.async.bulk.tensor" in ptx
        wait, go = (ptx.find(f"griddepcontrol.{op}") for op in ("wait", "launch_dependents"))
        first = "trigger" if go >= 0 and not 0 <= wait < go else "wait" if wait >= 0 else ""
        out.append(
            dict(
                kernel=name,
                pdl="griddepcontrol.wait" in ptx,
                tma=tma,
                first=first,
                trigger=_trigger(ptx),
                cubin=bool(k.asm.get("cubin")),
            )
        )
    return out


def main() -> dict:
    result: dict = {"steps": {}, "errors": {}}
    mr = ModelRunner.from_preset(
        "llama-3.2-1b",
        "cpu",
        torch.bfloat16,
        seed=0,
        num_layers=2,
        max_bs=64,
        max_context_len=640,
        page_size=64,
    )
    backend = mr.attn_backend
    backend.use_kernel = True  # the Triton attention, as on CUDA
    for bs in (1, 8, 32, 64):
        batch, pages = decode_batch(mr, Point(bs, 500))
        since = len(COMPILED)
        try:
            backend.init_forward_metadata(batch)
            tokens = torch.empty(bs, dtype=torch.int64)  # greedy tokens in the step, as served
            fused_decode.fused_decode_step(
                mr.model, backend, batch.input_ids, batch.positions, tokens_out=tokens
            )
            result["steps"][bs] = _variants(since)
        except Exception as e:  # noqa: BLE001 - reported, the test fails on it
            result["errors"][f"step bs {bs}"] = f"{type(e).__name__}: {e}"[:600]
        for p in pages:
            mr.kv_cache.release(p)
    # the same step with FP8 weights (per channel: the projections' W_FP8 variants)
    mr8 = ModelRunner.from_preset(
        "llama-3.2-1b",
        "cpu",
        torch.bfloat16,
        seed=0,
        num_layers=2,
        max_bs=64,
        max_context_len=640,
        page_size=64,
        quantization="fp8",
    )
    mr8.attn_backend.use_kernel = True
    for bs in (1, 8, 64):
        batch, pages = decode_batch(mr8, Point(bs, 500))
        since = len(COMPILED)
        try:
            mr8.attn_backend.init_forward_metadata(batch)
            tokens = torch.empty(bs, dtype=torch.int64)
            fused_decode.fused_decode_step(
                mr8.model, mr8.attn_backend, batch.input_ids, batch.positions, tokens_out=tokens
            )
            result["steps"][f"fp8 {bs}"] = _variants(since)
        except Exception as e:  # noqa: BLE001 - reported, the test fails on it
            result["errors"][f"fp8 step bs {bs}"] = f"{type(e).__name__}: {e}"[:600]
        for p in pages:
            mr8.kv_cache.release(p)
    # the attention's two-kernel path and its folded merge (what bs 8 takes on the H200)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(8, 32, 64, generator=g).bfloat16()
    kc, vc = (torch.randn(20, 64, 8, 64, generator=g).bfloat16() for _ in range(2))
    table = torch.arange(16, dtype=torch.int32).reshape(8, 2)
    lens = torch.full((8,), 100, dtype=torch.int32)
    modes = pdl.TRIGGER_MODES
    for name, fold, mode in (
        ("fold=False", False, modes["late"]),
        ("fold=True", True, modes["late"]),
        ("detached", False, (modes["detached"], modes["early"])),
    ):
        since = len(COMPILED)
        try:
            ws = DecodeWorkspace.allocate(8, 32, 64, 8, q.device)
            flash_decode(
                q, kc, vc, table, lens, num_splits=8, workspace=ws, fold_combine=fold, use_pdl=mode
            )
            result["steps"][f"attention {name}"] = _variants(since)
        except Exception as e:  # noqa: BLE001
            result["errors"][f"attention {name}"] = f"{type(e).__name__}: {e}"[:600]
    since = len(COMPILED)
    try:  # the greedy tokens after a cuBLAS head (bs 32 and 64 on the H200)
        argmax_rows(torch.randn(32, 128256, generator=g), torch.empty(32, dtype=torch.int64))
        result["steps"]["greedy tokens"] = _variants(since)
    except Exception as e:  # noqa: BLE001
        result["errors"]["greedy tokens"] = f"{type(e).__name__}: {e}"[:600]
    since = len(COMPILED)
    try:  # the prefill's attention: two requests, a cached prefix and new tokens each
        q = torch.randn(40, 32, 64, generator=g).bfloat16()
        indptr = torch.tensor([0, 24, 40], dtype=torch.int32)
        kv_lens = torch.tensor([88, 16], dtype=torch.int32)
        bt = torch.tensor([[1, 2], [3, 4]], dtype=torch.int32)
        ea.extend_attention(q, kc, vc, indptr, kv_lens, bt, max_q_len=24, sm_scale=0.125)
        result["steps"]["prefill attention"] = _variants(since)
    except Exception as e:  # noqa: BLE001
        result["errors"]["prefill attention"] = f"{type(e).__name__}: {e}"[:600]
    since = len(COMPILED)
    try:  # the graph's input kernel, staged and fed
        bufs = GraphInputBuffers.allocate(16, 4, torch.device("cpu"), 1)
        staging = PinnedStaging(pad_row(4, 1, torch.device("cpu")), 16, torch.device("cpu"))
        fill_inputs(bufs, 16, staging, torch.zeros(4, dtype=torch.int64))
        host = torch.zeros(SLOTS, 16, dtype=torch.int64)  # the token mirror: the graph's last
        _mirror_kernel[(1,)](  # launch, as TokenMirror.store makes it on CUDA
            bufs.input_ids, staging.copies, host, 16, host.stride(0), SLOTS=SLOTS, BLOCK=BLOCK
        )
        result["steps"]["inputs"] = _variants(since)
    except Exception as e:  # noqa: BLE001
        result["errors"]["inputs"] = f"{type(e).__name__}: {e}"[:600]
    since = len(COMPILED)
    try:  # the reference path's own kernels (bucket 2, `--kernels reference`): GEMV, SiLU·mul
        x = torch.randn(2, 2048, generator=g).bfloat16()
        gemv(
            x,
            torch.randn(3072, 2048, generator=g).bfloat16(),
            torch.randn(3072, generator=g).bfloat16(),
        )
        silu_mul(torch.randn(2, 16384, generator=g).bfloat16())
        result["steps"]["reference kernels"] = _variants(since)
    except Exception as e:  # noqa: BLE001
        result["errors"]["reference kernels"] = f"{type(e).__name__}: {e}"[:600]
    since = len(COMPILED)
    try:  # the FP8-weight GEMV: scales per channel and per block, one row and eight; a
        # prefill's one-pass dequantization
        w8 = torch.randn(3072, 2048, generator=g).to(torch.float8_e4m3fn)
        for rows in (1, 8):
            x = torch.randn(rows, 2048, generator=g).bfloat16()
            fp8_gemv(x, w8, torch.rand(3072, generator=g))
            fp8_gemv(x, w8, torch.rand(24, 16, generator=g), block=(128, 128))
        dequantize_fp8(w8, torch.rand(3072, generator=g))
        dequantize_fp8(w8, torch.rand(24, 16, generator=g), (128, 128), torch.float32)
        result["steps"]["fp8 gemv"] = _variants(since)
    except Exception as e:  # noqa: BLE001
        result["errors"]["fp8 gemv"] = f"{type(e).__name__}: {e}"[:600]
    try:
        _refused[(1,)](torch.zeros(1))
        result["refused"] = False
    except Exception as e:  # noqa: BLE001 - the compiler's refusal, as on the GPU
        result["refused"] = "PLAIN" in str(e)
    return result


if __name__ == "__main__":
    print(json.dumps(main()))
    sys.exit(0)
