"""What per-token exec updates cost and buy: host time of ``fa_apply``, and the GPU time of one
step's attention (16 layers, Llama-3.2-1B shape, bs=1) eager-exact vs fixed-geometry graph vs
exact graph, across contexts.

    python benchmarks/graph_update.py [--json PATH] [--layers 16]

Needs a GPU (about 5 GB). Prints a short table last; the whole run takes well under 90 s.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch

from stepgraph.bench.timing import cuda_time_ms, host_time_us
from stepgraph.graph_update import fa_apply, fa_plan, kernel_nodes
from stepgraph.kernels.decode.flash_decode import DecodeWorkspace, flash_decode
from stepgraph.kernels.decode.splits import num_splits_for

# Llama-3.2-1B attention: 32 query heads, 8 KV heads, head dim 64, bf16, pages of 64 keys.
N_HEADS, N_KV, HEAD_DIM, PAGE, BS = 32, 8, 64, 64, 1
MAX_CTX = 131072
MAX_SPLITS = 64
CONTEXTS = (256, 1024, 4096, 16384, 65536)


class Step:
    """``layers`` decode-attention launches over their own KV caches; one shared workspace (as the
    model does)."""

    def __init__(self, layers: int) -> None:
        dev, dt = "cuda", torch.bfloat16
        pages = MAX_CTX // PAGE
        self.sms = torch.cuda.get_device_properties(0).multi_processor_count
        shape = (BS * pages + 1, PAGE, N_KV, HEAD_DIM)
        # one cache per layer: a shared one would sit in L2 at short contexts and flatter eager
        self.kv = [
            (torch.randn(shape, device=dev, dtype=dt), torch.randn(shape, device=dev, dtype=dt))
            for _ in range(layers)
        ]
        self.block_table = (torch.arange(BS * pages, device=dev, dtype=torch.int32) + 1).view(
            BS, -1
        )
        self.seq_lens = torch.full((BS,), MAX_CTX, device=dev, dtype=torch.int32)
        self.q = torch.randn(BS, N_HEADS, HEAD_DIM, device=dev, dtype=dt)
        self.outs = [torch.empty_like(self.q) for _ in range(layers)]
        self.ws = DecodeWorkspace.allocate(BS, N_HEADS, HEAD_DIM, MAX_SPLITS, dev)
        self.bucket = num_splits_for(MAX_CTX, N_KV, BS, self.sms, MAX_SPLITS)

    def run(self, num_splits: int | None = None, max_seq_len: int | None = None) -> None:
        for (k, v), out in zip(self.kv, self.outs):
            flash_decode(
                self.q,
                k,
                v,
                self.block_table,
                self.seq_lens,
                num_splits=num_splits,
                max_seq_len=max_seq_len,
                workspace=self.ws,
                out=out,
                num_sms=self.sms,
            )

    def capture(self) -> torch.cuda.CUDAGraph:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.run(num_splits=self.bucket)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph(keep_graph=True)
        with torch.cuda.graph(graph, stream=stream):
            self.run(num_splits=self.bucket)
        graph.instantiate()
        torch.cuda.synchronize()
        return graph


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=str, default=None, help="write the rows here")
    p.add_argument("--layers", type=int, default=16)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("graph_update benchmark: needs a GPU", file=sys.stderr)
        return 1
    step = Step(args.layers)
    fixed, exact = step.capture(), step.capture()
    plan = fa_plan(kernel_nodes(exact.raw_cuda_graph()), max_t_kv=MAX_CTX, num_sms=step.sms)
    assert len(plan.mains) == args.layers, len(plan.mains)
    ex = exact.raw_cuda_graph_exec()
    rows: list[dict] = []

    # -- host cost of fa_apply (no replay in between: the driver call alone) --------------------
    ns = lambda t: num_splits_for(t, N_KV, BS, step.sms, MAX_SPLITS)
    same = next(t for t in range(4096, MAX_CTX) if ns(t) == ns(t + 1))
    assert ns(1024) != ns(65536), "the all-change case needs two ladder steps"
    it = itertools.cycle([same, same + 1])  # per token: t_kv moves, the split count does not
    base = host_time_us(lambda: next(it))  # the loop's own cost, subtracted below
    fa_apply(plan, ex, same)
    noop = host_time_us(lambda: fa_apply(plan, ex, next(it))) - base
    it = itertools.cycle([1024, 65536])  # two ladder steps: every call pushes every node
    allc = host_time_us(lambda: fa_apply(plan, ex, next(it)), warmup=20, iters=400) - base
    n_nodes = 2 * args.layers
    rows.append(dict(kind="host", what="fa_apply_noop_us", value=noop, target=1.0))
    rows.append(
        dict(
            kind="host",
            what="fa_apply_all_change_us_per_node",
            value=allc / n_nodes,
            nodes=n_nodes,
            target=1.0,
        )
    )

    # -- GPU time of the attention of one step ---------------------------------------------------
    sync = torch.cuda.synchronize
    for t in CONTEXTS:
        step.seq_lens.fill_(t)
        eager = cuda_time_ms(lambda t=t: step.run(max_seq_len=t))
        fixed_ms = cuda_time_ms(fixed.replay)
        fa_apply(plan, ex, t)
        exact_ms = cuda_time_ms(exact.replay)
        wall_fixed = host_time_us(lambda: (fixed.replay(), sync()), warmup=20, iters=100, repeats=5)
        wall_exact = host_time_us(
            lambda t=t: (fa_apply(plan, ex, t), exact.replay(), sync()),
            warmup=20,
            iters=100,
            repeats=5,
        )
        rows.append(
            dict(
                kind="gpu",
                t_kv=t,
                ns_exact=ns(t),
                ns_fixed=step.bucket,
                eager_exact_us=eager * 1e3,
                graph_fixed_us=fixed_ms * 1e3,
                graph_exact_us=exact_ms * 1e3,
                exact_over_eager=exact_ms / eager,
                fixed_over_exact=fixed_ms / exact_ms,
                wall_graph_us=wall_fixed,
                wall_exact_us=wall_exact,
            )
        )

    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(benchmark="graph_update", layers=args.layers, rows=rows), f, indent=1)
    print(
        f"fa_apply host: no change {noop:.2f} us (target <= 1); all {n_nodes} nodes change "
        f"{allc / n_nodes:.2f} us/node (target <= 1)"
    )
    print(
        f"{'t_kv':>6} {'ns':>3}/{'fix':<3} {'eager us':>9} {'fixed us':>9} {'exact us':>9} "
        f"{'ex/eager':>8} {'fix/ex':>7} {'wall fix':>9} {'wall ex':>8}"
    )
    for r in (r for r in rows if r["kind"] == "gpu"):
        print(
            f"{r['t_kv']:>6} {r['ns_exact']:>3}/{r['ns_fixed']:<3} {r['eager_exact_us']:>9.1f} "
            f"{r['graph_fixed_us']:>9.1f} {r['graph_exact_us']:>9.1f} "
            f"{r['exact_over_eager']:>8.3f} {r['fixed_over_exact']:>7.2f} "
            f"{r['wall_graph_us']:>9.1f} {r['wall_exact_us']:>8.1f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
