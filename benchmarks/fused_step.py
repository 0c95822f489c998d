"""The fused one-row decode step (6 launches a layer: qkv+RoPE+KV write, split-KV, combine,
o_proj+residual, gate-up+SiLU, down+residual; LM head+argmax) against the reference kernels'
step, on the llama-3.2-1b preset (bf16, random weights, page size 64, context 512), replayed
from a CUDA graph, PDL on and off.

    PYTHONPATH=. python3 benchmarks/fused_step.py --json $OUT/fused_step.json

1. Each fused kernel alone: one graph of 16 calls over the 16 layers' weights (64+ MB rotated
   past the 50 MB L2), µs per call and GB/s of weight bytes, PDL on and off.
2. The whole step: ms per step (CUDA events, median of graph replays; tokens = argmax), the
   bandwidth floor ((weights + live KV) / copy bandwidth measured in the same run) and its
   fraction, kernels per step and the top kernels from torch.profiler; the fused logits against
   the reference step's (relative error, greedy tokens equal).
A short table is printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import defaultdict

import torch

from stepgraph.bench.timing import copy_bandwidth_gbps, cuda_time_ms
from stepgraph.bench.workload import (
    Point,
    build_model_runner,
    decode_batch,
    fill_kv_random,
    kv_bytes,
    weight_bytes,
)
from stepgraph.kernels.decode.flash_decode import flash_decode
from stepgraph.kernels.proj.gate_up_silu import gate_up_silu
from stepgraph.kernels.proj.norm_gemv import gemv_residual
from stepgraph.kernels.proj.qkv_rope import qkv_rope
from stepgraph.kernels.sampling.lm_head_argmax import lm_head_argmax

MODEL, DTYPE, PAGE_SIZE, CONTEXT = "llama-3.2-1b", torch.bfloat16, 64, 512
BATCH_SIZES = (1, 8)
TOP_K = 12


def fused_forward(mr, batch, use_pdl: bool, blocks: dict | None = None):
    """(float32 logits [bs, vocab], greedy tokens [bs]) of one decode step, fused kernels;
    ``blocks``: {kernel name: (BLOCK_N, BLOCK_K, num_warps)} overriding the defaults."""
    blk = (blocks or {}).get
    be, model, cfg = mr.attn_backend, mr.model, mr.config
    if not be.is_prepared_for(batch):
        be.init_forward_metadata(batch)
    m = be.meta
    bs = batch.input_ids.shape[0]
    r = model.embed_tokens(batch.input_ids)  # [bs, hidden], the residual stream
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        kc, vc = mr.kv_cache.k_caches[i], mr.kv_cache.v_caches[i]
        norm1, norm2 = layer.input_layernorm, layer.post_attention_layernorm
        q = qkv_rope(
            r,
            norm1.weight,
            attn.qkv_proj.weight,
            attn.qkv_proj.bias,
            norm1.eps,
            batch.positions,
            model.rope_cos,
            model.rope_sin,
            kc,
            vc,
            m.out_cache_loc,
            cfg.num_heads,
            use_pdl=use_pdl,
            blocks=blk("qkv_rope"),
        )
        o = flash_decode(
            q,
            kc,
            vc,
            m.block_table,
            m.seq_lens,
            num_splits=m.num_splits,
            workspace=m.workspace,
            sm_scale=be.sm_scale,
            num_sms=be.num_sms,
        )
        r = gemv_residual(
            o.view(bs, -1), attn.o_proj.weight, r, use_pdl=use_pdl, blocks=blk("o_proj+res")
        )
        a = gate_up_silu(
            r,
            norm2.weight,
            mlp.gate_up_proj.weight,
            norm2.eps,
            use_pdl=use_pdl,
            blocks=blk("gate_up_silu"),
        )
        r = gemv_residual(a, mlp.down_proj.weight, r, use_pdl=use_pdl, blocks=blk("down+res"))
    return lm_head_argmax(
        r,
        model.norm.weight,
        model.lm_head.weight,
        model.norm.eps,
        use_pdl=use_pdl,
        blocks=blk("lm_head+argmax"),
    )


def reference_forward(mr, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, greedy tokens) of the reference step: ``ModelRunner.forward`` then ``argmax``."""
    mr.set_kernels("reference")  # the unfused kernels (ModelRunner's default on CUDA is fused)
    try:
        logits = mr.forward(batch)
    finally:
        mr.set_kernels("fused")
    return logits, logits.argmax(-1)


def capture(fn):
    """(graph, output) of ``fn`` warmed up on a side stream, then captured."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def profile_replays(graph, replays: int = 5) -> dict:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    total, count = defaultdict(float), defaultdict(int)
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            total[e.name] += e.time_range.elapsed_us()
            count[e.name] += 1
    top = sorted(total, key=total.get, reverse=True)[:TOP_K]
    return dict(
        kernels_per_step=sum(count.values()) / replays,
        top=[dict(name=n[:70], us=total[n] / replays, calls=count[n] / replays) for n in top],
    )


def time_graph_ms(graph) -> tuple[float, list[float]]:
    runs = [cuda_time_ms(graph.replay, warmup=10, iters=30, inner=5) for _ in range(3)]
    return statistics.median(runs), runs


SWEEP = {  # (BLOCK_N, BLOCK_K, num_warps) per kernel at bs=1, PDL on; None: the defaults.
    # Swept on 2026-11-30 (see gemv_tiles.proj_blocks for the outcome); defaults only now.
    "qkv_rope": [None],
    "o_proj+res": [None],
    "gate_up_silu": [None],
    "down+res": [None],
    "lm_head+argmax": [None],
}


def time_kernels(mr, gbps: float) -> tuple[list[dict], dict]:
    """Each fused kernel alone at bs=1 over the 16 layers' weights (the LM head: once), at
    the default tiles PDL off and on, then the SWEEP tiles PDL on; returns rows and the best
    tiles per kernel."""
    model, cfg, rows = mr.model, mr.config, []
    g = torch.Generator(device=mr.device).manual_seed(1)
    r = torch.randn(1, cfg.hidden_size, device=mr.device, generator=g).to(DTYPE)
    o = torch.randn(1, cfg.q_size, device=mr.device, generator=g).to(DTYPE)
    act = torch.randn(1, cfg.intermediate_size, device=mr.device, generator=g).to(DTYPE)
    pos = torch.tensor([CONTEXT - 1], device=mr.device)
    slot = torch.tensor([PAGE_SIZE * 2 + 3], device=mr.device)
    layers = list(model.layers)
    cases = {
        "qkv_rope": (
            lambda L, p, b: qkv_rope(
                r,
                L.input_layernorm.weight,
                L.self_attn.qkv_proj.weight,
                L.self_attn.qkv_proj.bias,
                1e-5,
                pos,
                model.rope_cos,
                model.rope_sin,
                mr.kv_cache.k_caches[0],
                mr.kv_cache.v_caches[0],
                slot,
                cfg.num_heads,
                use_pdl=p,
                blocks=b,
            ),
            lambda L: L.self_attn.qkv_proj.weight,
        ),
        "o_proj+res": (
            lambda L, p, b: gemv_residual(o, L.self_attn.o_proj.weight, r, use_pdl=p, blocks=b),
            lambda L: L.self_attn.o_proj.weight,
        ),
        "gate_up_silu": (
            lambda L, p, b: gate_up_silu(
                r,
                L.post_attention_layernorm.weight,
                L.mlp.gate_up_proj.weight,
                1e-5,
                use_pdl=p,
                blocks=b,
            ),
            lambda L: L.mlp.gate_up_proj.weight,
        ),
        "down+res": (
            lambda L, p, b: gemv_residual(act, L.mlp.down_proj.weight, r, use_pdl=p, blocks=b),
            lambda L: L.mlp.down_proj.weight,
        ),
        "lm_head+argmax": (
            lambda L, p, b: lm_head_argmax(
                r, model.norm.weight, model.lm_head.weight, 1e-5, use_pdl=p, blocks=b
            ),
            lambda L: model.lm_head.weight,
        ),
    }
    best = {}
    for name, (fn, weight) in cases.items():
        calls = layers[:1] if name == "lm_head+argmax" else layers
        nbytes = weight(layers[0]).numel() * 2
        for pdl, blocks in [(False, None)] + [(True, b) for b in SWEEP[name]]:
            graph, _ = capture(lambda fn=fn, p=pdl, b=blocks, c=calls: [fn(L, p, b) for L in c])
            us = cuda_time_ms(graph.replay, warmup=5, iters=20) * 1e3 / len(calls)
            rows.append(
                dict(
                    kernel=name,
                    pdl=pdl,
                    blocks=blocks,
                    us=us,
                    gbps=nbytes / us / 1e3,
                    floor_us=nbytes / gbps / 1e3,
                )
            )
            if pdl and us < best.get(name, (float("inf"), None))[0]:
                best[name] = (us, blocks)
            del graph
    return rows, {k: b for k, (_, b) in best.items() if b is not None}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the full results here")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    torch.manual_seed(0)
    gbps = copy_bandwidth_gbps()
    mr = build_model_runner(MODEL, "cuda", DTYPE, max_bs=8, max_context=1024, page_size=PAGE_SIZE)
    fill_kv_random(mr)
    kernel_rows, best_blocks = time_kernels(mr, gbps)
    # yardstick for the logit error: the reference step with cuBLAS against the Triton GEMV
    batch, pages = decode_batch(mr, Point(1, CONTEXT))
    ref_gemv = reference_forward(mr, batch)[0]
    mr.model.use_gemv(None)
    ref_cublas = reference_forward(mr, batch)[0]
    mr.model.use_gemv("all", max_bs=1)
    yardstick = ((ref_gemv - ref_cublas).norm() / ref_gemv.norm()).item()
    for p in pages:
        mr.kv_cache.release(p)
    steps = []
    for bs in BATCH_SIZES:
        point = Point(bs, CONTEXT)
        floor = (weight_bytes(mr) + kv_bytes(mr, point)) / gbps / 1e6
        batch, pages = decode_batch(mr, point)
        variants = {
            "reference": lambda b=batch: reference_forward(mr, b),
            "fused": lambda b=batch: fused_forward(mr, b, use_pdl=False),
            "fused+pdl": lambda b=batch: fused_forward(mr, b, use_pdl=True),
        }
        if bs > 1:  # the fused kernels serve one row; larger batches keep the unfused path
            variants = {"reference": variants["reference"]}
        outs = {}
        for name, fn in variants.items():
            graph, out = capture(fn)
            graph.replay()
            torch.cuda.synchronize()
            outs[name] = [t.clone() for t in out]
            ms, runs = time_graph_ms(graph)
            row = dict(
                bs=bs,
                variant=name,
                ms=ms,
                ms_runs=runs,
                floor_ms=floor,
                fraction=floor / ms,
                **profile_replays(graph),
            )
            if name != "reference":
                ref_lg, ref_tok = outs["reference"]
                lg, tok = outs[name]
                row["logits_rel_err"] = ((lg - ref_lg).norm() / ref_lg.norm()).item()
                row["tokens_equal"] = bool(torch.equal(tok, ref_tok))
                row["pdl_identical"] = name != "fused" and all(
                    torch.equal(a, b) for a, b in zip(outs[name], outs["fused"])
                )
            steps.append(row)
            del graph
        for p in pages:
            mr.kv_cache.release(p)
    result = dict(
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        copy_gbps=gbps,
        model=MODEL,
        context=CONTEXT,
        kernels=kernel_rows,
        best_blocks=best_blocks,
        logit_err_cublas_vs_gemv=yardstick,
        steps=steps,
        seconds=time.perf_counter() - t_start,
    )
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)

    for s in steps:
        print(f"\n[{s['variant']} bs={s['bs']}] top kernels (µs/step, calls/step):")
        for t in s["top"]:
            print(f"  {t['us']:8.1f} {t['calls']:5.0f}  {t['name']}")
    print(f"\ncopy bandwidth {gbps:.0f} GB/s; {result['seconds']:.0f} s in all")
    print(
        f"{'kernel (bs=1)':>15} {'pdl':>5} {'tiles':>16} {'us/call':>8} {'GB/s':>6} {'floor us':>8}"
    )
    for k in kernel_rows:
        print(
            f"{k['kernel']:>15} {k['pdl']!s:>5} {str(k['blocks'] or 'default'):>16} "
            f"{k['us']:8.2f} {k['gbps']:6.0f} {k['floor_us']:8.2f}"
        )
    print(f"best tiles {best_blocks}; logit error cuBLAS vs GEMV reference: {yardstick:.2e}")
    print(
        f"{'variant':>14} {'bs':>3} {'ms/step':>8} {'floor':>6} {'% floor':>7} {'kernels':>7} "
        f"{'logit err':>9} tokens"
    )
    for s in steps:
        print(
            f"{s['variant']:>14} {s['bs']:>3} {s['ms']:8.3f} {s['floor_ms']:6.3f} "
            f"{100 * s['fraction']:6.1f}% {s['kernels_per_step']:7.0f} "
            f"{s.get('logits_rel_err', 0):9.2e} {s.get('tokens_equal', '')}"
            f"{' pdl==nopdl' if s.get('pdl_identical') else ''}"
        )
    return result


if __name__ == "__main__":
    main()
