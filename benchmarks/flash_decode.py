"""Split-KV flash decode (main + combine, one CUDA graph) against torch SDPA, on Llama-3.2-1B
attention: 32 query heads, 8 KV heads, head dim 64, bf16, page size 64.

    PYTHONPATH=. python benchmarks/flash_decode.py --json out/flash_decode.json

Per (bs, t_kv): microseconds per replay of a graph holding the two launches, captured with the
ladder's split count for t_kv ("exact" geometry) and with the split count for 128k keys replayed
at the live t_kv ("fixed" geometry); achieved bandwidth = K and V bytes of live tokens / time,
as a fraction of copy_bandwidth_gbps() from the same run; and the peer,
torch.nn.functional.scaled_dot_product_attention (enable_gqa) on the same keys gathered into
contiguous tensors (gather not timed), also replayed from a graph.

Targets (reported, not tested): >= 70% of copy bandwidth at t_kv >= 32k; <= 8 us at t_kv <= 4k,
bs=1; faster than SDPA everywhere.
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import torch.nn.functional as F

from stepgraph.bench.timing import copy_bandwidth_gbps, cuda_time_ms
from stepgraph.kernels.decode.flash_decode import DecodeWorkspace, default_variant, flash_decode
from stepgraph.kernels.decode.splits import PROGRAMS_PER_SM, num_splits_for

N_HEADS, N_KV, HEAD_DIM, PAGE_SIZE, DTYPE = 32, 8, 64, 64, torch.bfloat16
T_FIXED = 131072
MAX_SPLITS = 64


def graph_of(fn) -> torch.cuda.CUDAGraph:
    """Warm ``fn`` up on a side stream, then capture it there."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        fn()
    torch.cuda.synchronize()
    return graph


def time_us(fn) -> float:
    """Median µs per call; enough calls per event pair that each sample spans about 0.5 ms."""
    probe = cuda_time_ms(fn, warmup=3, iters=3)
    inner = max(1, min(200, math.ceil(0.5 / max(probe, 1e-4))))
    return cuda_time_ms(fn, warmup=5, iters=15, inner=inner) * 1e3


def bench_point(bs: int, t_kv: int, num_sms: int, copy_gbps: float) -> dict:
    g = torch.Generator(device="cuda").manual_seed(bs * 7 + t_kv)
    pages_per_req = -(-t_kv // PAGE_SIZE)
    n_pages = bs * pages_per_req
    k_cache = torch.randn(n_pages, PAGE_SIZE, N_KV, HEAD_DIM, generator=g, device="cuda").to(DTYPE)
    v_cache = torch.randn_like(k_cache)
    # pages scattered over the cache, as a real allocator leaves them
    block_table = torch.randperm(n_pages, generator=g, device="cuda").to(torch.int32)
    block_table = block_table.view(bs, pages_per_req)
    seq_lens = torch.full((bs,), t_kv, dtype=torch.int32, device="cuda")
    q = torch.randn(bs, N_HEADS, HEAD_DIM, generator=g, device="cuda").to(DTYPE)
    ws = DecodeWorkspace.allocate(bs, N_HEADS, HEAD_DIM, MAX_SPLITS, "cuda")
    out = torch.empty_like(q)

    def attn(ns: int):
        return lambda: flash_decode(
            q, k_cache, v_cache, block_table, seq_lens, num_splits=ns, workspace=ws, out=out
        )

    ns = num_splits_for(t_kv, N_KV, bs, num_sms, MAX_SPLITS)
    ns_fixed = num_splits_for(T_FIXED, N_KV, bs, num_sms, MAX_SPLITS)
    us = time_us(graph_of(attn(ns)).replay)
    us_fixed = time_us(graph_of(attn(ns_fixed)).replay)
    exact = out.clone()

    # the peer: contiguous K/V [bs, n_kv, t_kv, hd], gathered once outside the timing
    idx = block_table.long()
    k = k_cache[idx].flatten(1, 2)[:, :t_kv].transpose(1, 2).contiguous()
    v = v_cache[idx].flatten(1, 2)[:, :t_kv].transpose(1, 2).contiguous()
    q4 = q.unsqueeze(2)  # [bs, n_heads, 1, hd]
    sdpa_out = torch.empty_like(q4)
    sdpa = lambda: sdpa_out.copy_(F.scaled_dot_product_attention(q4, k, v, enable_gqa=True))
    try:
        sdpa_us = time_us(graph_of(sdpa).replay)
    except RuntimeError:  # a backend that refuses capture: time it eagerly (costs it launches)
        torch.cuda.synchronize()
        sdpa_us = time_us(sdpa)
    max_diff = (sdpa_out.squeeze(2).float() - exact.float()).abs().max().item()

    kv_bytes = 2 * bs * t_kv * N_KV * HEAD_DIM * k.element_size()
    gbps = lambda t_us: kv_bytes / (t_us * 1e-6) / 1e9
    return {
        "bs": bs,
        "t_kv": t_kv,
        "ns": ns,
        "us": us,
        "gbps": gbps(us),
        "frac_copy": gbps(us) / copy_gbps,
        "ns_fixed": ns_fixed,
        "us_fixed": us_fixed,
        "frac_copy_fixed": gbps(us_fixed) / copy_gbps,
        "sdpa_us": sdpa_us,
        "sdpa_frac_copy": gbps(sdpa_us) / copy_gbps,
        "speedup_vs_sdpa": sdpa_us / us,
        "max_abs_diff_vs_sdpa": max_diff,
    }


def fits(bs: int, t_kv: int) -> bool:
    kv_bytes = 2 * bs * t_kv * N_KV * HEAD_DIM * 2
    return 3.5 * kv_bytes < 0.8 * torch.cuda.mem_get_info()[0]  # caches, gathered copy, temps


def table(rows: list[dict], copy_gbps: float) -> str:
    head = (
        f"{'bs':>3} {'t_kv':>7} {'ns':>3} {'us':>8} {'%copy':>6} | {'ns_fx':>5} {'us_fx':>8} "
        f"{'%copy':>6} | {'sdpa_us':>8} {'x_sdpa':>6}"
    )
    cfg = default_variant(HEAD_DIM, PAGE_SIZE, DTYPE).name
    lines = [
        f"copy bandwidth {copy_gbps:.0f} GB/s (read+write); kernel {cfg}, ladder "
        f"{PROGRAMS_PER_SM} programs/SM",
        head,
        "-" * len(head),
    ]
    for r in rows:
        if "skipped" in r:
            lines.append(f"{r['bs']:>3} {r['t_kv']:>7}  skipped: {r['skipped']}")
            continue
        lines.append(
            f"{r['bs']:>3} {r['t_kv']:>7} {r['ns']:>3} {r['us']:>8.1f}"
            f" {100 * r['frac_copy']:>5.0f}%"
            f" | {r['ns_fixed']:>5} {r['us_fixed']:>8.1f} {100 * r['frac_copy_fixed']:>5.0f}%"
            f" | {r['sdpa_us']:>8.1f} {r['speedup_vs_sdpa']:>6.2f}"
        )
    done = [r for r in rows if "skipped" not in r]
    long = [r["frac_copy"] >= 0.70 for r in done if r["t_kv"] >= 32768]
    short = [r["us"] <= 8.0 for r in done if r["t_kv"] <= 4096 and r["bs"] == 1]
    faster = [r["speedup_vs_sdpa"] > 1.0 for r in done]
    lines.append(
        f"targets: >=70% copy at t>=32k {sum(long)}/{len(long)}; <=8us at t<=4k bs=1 "
        f"{sum(short)}/{len(short)}; faster than SDPA {sum(faster)}/{len(faster)}"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--contexts", default="512,4096,32768,131072")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/flash_decode.py needs a CUDA GPU")

    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    copy_gbps = copy_bandwidth_gbps()
    rows = []
    for bs in map(int, args.batch_sizes.split(",")):
        for t_kv in map(int, args.contexts.split(",")):
            if not fits(bs, t_kv):
                rows.append({"bs": bs, "t_kv": t_kv, "skipped": "does not fit in free memory"})
                continue
            rows.append(bench_point(bs, t_kv, num_sms, copy_gbps))
            torch.cuda.empty_cache()
    result = {
        "device": torch.cuda.get_device_name(0),
        "num_sms": num_sms,
        "copy_gbps": copy_gbps,
        "config": default_variant(HEAD_DIM, PAGE_SIZE, DTYPE).name,
        "programs_per_sm": PROGRAMS_PER_SM,
        "shape": {
            "n_heads": N_HEADS,
            "n_kv_heads": N_KV,
            "head_dim": HEAD_DIM,
            "page_size": PAGE_SIZE,
            "dtype": str(DTYPE),
        },
        "rows": rows,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    print(table(rows, copy_gbps))


if __name__ == "__main__":
    main()
