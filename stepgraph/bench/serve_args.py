"""The flags of `stepgraph bench --serve` and their checks: every value is checked before any
work starts, and a bad one is a one-line ``ConfigError`` naming the flag (exit status 2)."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from ..cli_args import seed_int
from ..errors import ConfigError
from .serve_metrics import length_bounds
from .workload_prefix import (
    PREFIX_DEFAULTS,
    add_prefix_arguments,
    check_prefix_workload,
    requests_in_flight,
)

DEFAULT_INPUT_LEN, DEFAULT_RANGE_RATIO = 576, 7 / 9  # prompts of 128-1024 tokens
MAX_RUNNING = 64  # default --max-running: min(--num-requests, this)
# default --max-running of shared-prefix and multi-turn: the requests they can have in flight,
# at most this (the graph runner's buckets reach it), as SGLang and vLLM bound the running
# batch by KV memory rather than by a small count
PREFIX_MAX_RUNNING = 512
# tokens per KV page: the random workload's (the decode kernel's tuned page), and the prefix
# workloads' (the engine's default, the prefix cache's granularity)
PAGE_SIZE, PREFIX_PAGE_SIZE, MAX_PAGE_SIZE = 64, 16, 256
LATENCY_INPUT, LATENCY_OUTPUT = 512, 256  # the one-request latency case
ENGINE_MODES = ("eager", "graph", "exact")
# the --serve flags' defaults: argparse's default is None (False for --latency), so that a flag
# given without --serve is seen and refused (``bench.args.check_mode_flags``)
SERVE_DEFAULTS = {
    "num_requests": 64,
    "input_len": DEFAULT_INPUT_LEN,
    "output_len": 128,
    "range_ratio": DEFAULT_RANGE_RATIO,
    "request_rate": math.inf,
    "seed": 0,
    "max_running": None,  # min(--num-requests, MAX_RUNNING); prefix workloads: see above
    "page_size": None,  # PAGE_SIZE; prefix workloads: PREFIX_PAGE_SIZE
    "max_prefill_tokens": 8192,
    "max_prefill_tokens_with_decode": 2048,  # the Engine's default; 0: no cap
    "engine_prefill": None,  # the Engine's default for the mode (engine/prefill.py)
    "peers": None,  # both peers on CUDA, none on the CPU
    "latency": False,
    **PREFIX_DEFAULTS,  # --workload and its sizes
    "no_prefix_caching": False,
}


def serve_flags_given(args: argparse.Namespace) -> list[str]:
    """The ``--serve`` flags given on the command line (set, not left at argparse's None)."""
    unset = (None, False)  # by identity: --seed 0 is given (0 == False)
    given = [k for k in SERVE_DEFAULTS if not any(getattr(args, k, None) is u for u in unset)]
    return ["--" + k.replace("_", "-") for k in given]


def apply_serve_defaults(args: argparse.Namespace) -> None:
    """The defaults of the ``--serve`` flags left unset."""
    for key, value in SERVE_DEFAULTS.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """The ``--serve`` flags (``stepgraph bench --serve --help``)."""
    p.add_argument(
        "--serve",
        action="store_true",
        help="serving benchmark: seeded random requests through the Engine, TTFT/TPOT/ITL/E2E "
        "as `vllm bench serve` reports them, next to the GPU step time and transformers peers "
        "(stepgraph/bench/serve.py; --modes picks the engine mode, default graph)",
    )
    p.add_argument("--num-requests", type=int, default=None, help="--serve: requests (default 64)")
    p.add_argument(
        "--input-len",
        type=int,
        default=None,
        help="--serve: mean prompt tokens (default 576; with --range-ratio 7/9: 128-1024)",
    )
    p.add_argument(
        "--output-len", type=int, default=None, help="--serve: new tokens per request (default 128)"
    )
    p.add_argument(
        "--range-ratio",
        type=float,
        default=None,
        help="--serve: prompt lengths uniform in [len*(1-r), len*(1+r)], 0 <= r < 1 (vLLM's "
        "random dataset; outputs stay exactly --output-len) (default 0.778 = 7/9)",
    )
    p.add_argument(
        "--request-rate",
        type=float,
        default=None,
        help="--serve: Poisson arrivals at this many requests/s (default inf: all at once)",
    )
    p.add_argument(
        "--seed",
        type=seed_int,
        default=None,
        help="--serve: workload and arrival seed, 0..2**64-1 (default 0)",
    )
    p.add_argument(
        "--max-running",
        type=int,
        default=None,
        help="--serve: largest running batch, the graph runner's max_bs "
        f"(default min(--num-requests, {MAX_RUNNING}); --workload shared-prefix and "
        f"multi-turn: the requests they can have in flight, at most {PREFIX_MAX_RUNNING})",
    )
    p.add_argument(
        "--page-size",
        type=int,
        default=None,
        help="--serve: tokens per KV page, the prefix cache's granularity, a power of two up to "
        f"{MAX_PAGE_SIZE} (default {PAGE_SIZE}; --workload shared-prefix and multi-turn: "
        f"{PREFIX_PAGE_SIZE}, the engine's)",
    )
    p.add_argument(
        "--max-prefill-tokens",
        type=int,
        default=None,
        help="--serve: prompt tokens one engine step prefills, where the engine takes it "
        "(default 8192)",
    )
    p.add_argument(
        "--max-prefill-tokens-with-decode",
        type=int,
        default=None,
        help="--serve: prompt tokens a step that also decodes prefills, at most "
        "(Engine(max_prefill_tokens_with_decode=...); default 2048; 0: no cap)",
    )
    p.add_argument(
        "--engine-prefill",
        choices=("graph", "eager", "unpadded", "piecewise"),
        default=None,
        help="--serve: the engine's prefill (Engine(prefill=...)); graph replays a step's "
        "chunks padded to a token bucket from CUDA graphs, eager runs the same padded forward "
        "without graphs (default: the engine's, graph in modes graph and exact, else eager)",
    )
    p.add_argument(
        "--peers",
        default=None,
        help="--serve: comma list of hf-cb (transformers generate_batch), hf-static-compile "
        "(one-request latency), or none (default: both on CUDA, none on the CPU)",
    )
    p.add_argument(
        "--latency",
        action="store_true",
        help=f"--serve: add the one-request case ({LATENCY_INPUT} in, {LATENCY_OUTPUT} out); "
        "always run when a peer runs",
    )
    add_prefix_arguments(p)


@dataclass(frozen=True)
class ServePlan:
    model: str
    mode: str
    peers: tuple[str, ...]
    max_running: int
    latency: bool
    prefill: str = "eager"
    page_size: int = PAGE_SIZE


def check_serve_args(args: argparse.Namespace, config, model: str) -> ServePlan:
    """Every ``--serve`` flag, before any work: one-line ``ConfigError`` naming the flag."""
    from .serve_peers import SERVE_PEERS

    apply_serve_defaults(args)
    cuda = args.device == "cuda"
    counts = {
        "--num-requests": args.num_requests,
        "--input-len": args.input_len,
        "--output-len": args.output_len,
        "--max-running": 1 if args.max_running is None else args.max_running,
        "--max-prefill-tokens": args.max_prefill_tokens,
    }
    for flag, value in counts.items():
        if value < 1:
            raise ConfigError(f"{flag} must be >= 1, got {value}.")
    if args.max_prefill_tokens_with_decode < 0:
        raise ConfigError(
            "--max-prefill-tokens-with-decode must be >= 0 (0: no cap), got "
            f"{args.max_prefill_tokens_with_decode}."
        )
    r = args.range_ratio
    if not 0 <= r < 1:
        raise ConfigError(
            f"--range-ratio must be in [0, 1) (prompt lengths in [len*(1-r), len*(1+r)]), got {r}."
        )
    if not args.request_rate > 0:  # NaN too
        raise ConfigError(
            f"--request-rate must be > 0 requests/s (inf: all at once), got {args.request_rate}."
        )
    unused = {
        "--batch-sizes": args.batch_sizes is not None,
        "--contexts": args.contexts is not None,
        "--peer-points": args.peer_points is not None,
        "--tp": args.tp != 1,
        "--prefill": args.prefill,
    }
    for flag, given in unused.items():
        if given:
            raise ConfigError(
                f"{flag} does not apply to --serve (one unsharded engine on its own requests); "
                f"drop {flag}, or drop --serve."
            )
    mode = args.modes or "graph"
    if mode not in ENGINE_MODES or (mode == "exact" and not cuda):
        choices = "eager, graph or exact" if cuda else "eager or graph on the CPU"
        raise ConfigError(f"--modes {mode}: --serve runs one engine mode, {choices}.")
    names = args.peers if args.peers is not None else (",".join(SERVE_PEERS) if cuda else "none")
    peers = tuple(n for n in names.split(",") if n and n != "none")
    if any(n not in SERVE_PEERS for n in peers) or (not cuda and "hf-static-compile" in peers):
        raise ConfigError(
            f"--peers {names}: choose from {','.join(SERVE_PEERS)} or none (hf-static-compile "
            "is timed with CUDA syncs: not with --device cpu)."
        )
    limit = config.max_position_embeddings
    high = length_bounds(args.input_len, r)[1]
    if high + args.output_len - 1 > limit:
        raise ConfigError(
            f"--input-len {args.input_len} with --range-ratio {r:.3g} gives prompts up to {high} "
            f"tokens; with --output-len {args.output_len} that needs "
            f"{high + args.output_len - 1} positions, more than {model}'s "
            f"max_position_embeddings={limit}; lower --input-len, --range-ratio or --output-len."
        )
    check_prefix_workload(args, limit, model)
    if args.workload != "random":
        if args.no_prefix_caching:
            raise ConfigError(
                f"--no-prefix-caching does not apply to --workload {args.workload}: it runs "
                "with caching off and on; drop the flag."
            )
        peers = ()  # the peers and the latency case run on the random workload only
    latency = (args.latency or bool(peers)) and args.workload == "random"
    if latency and LATENCY_INPUT + LATENCY_OUTPUT - 1 > limit:
        raise ConfigError(
            f"--latency needs {LATENCY_INPUT + LATENCY_OUTPUT - 1} positions, more than "
            f"{model}'s {limit}; drop --latency (and --peers)."
        )
    if args.max_running is not None:
        max_running = args.max_running
    elif args.workload == "random":
        max_running = min(args.num_requests, MAX_RUNNING)
    else:
        max_running = min(requests_in_flight(args), PREFIX_MAX_RUNNING)
    page_size = args.page_size
    if page_size is None:
        page_size = PAGE_SIZE if args.workload == "random" else PREFIX_PAGE_SIZE
    elif not 1 <= page_size <= MAX_PAGE_SIZE or page_size & (page_size - 1):
        raise ConfigError(
            f"--page-size must be a power of two from 1 to {MAX_PAGE_SIZE}, got {page_size}."
        )
    from ..engine.prefill import default_prefill

    prefill = getattr(args, "engine_prefill", None) or default_prefill(mode)
    return ServePlan(model, mode, peers, max_running, latency, prefill, page_size)


def check_serve_memory(
    args: argparse.Namespace, config, plan: ServePlan, dtype, max_context: int
) -> None:
    """Refuse up front a run whose KV cache (``plan.max_running`` requests of ``max_context``
    tokens), weights and logits cannot fit in the memory free on the device: one line naming
    --max-running (``ConfigError``), before anything is built."""
    from .workload import bench_bytes, memory_shortfall

    parts = bench_bytes(config, dtype, plan.max_running, max_context, plan.page_size)
    short = memory_shortfall(parts, args.device)
    if short is None:
        return
    need, free, each = short
    raise ConfigError(
        f"--max-running {plan.max_running} requests of {max_context} tokens need at least "
        f"{need / 2**30:.2f} GiB ({each}), but {free / 2**30:.2f} GiB is free on "
        f"{args.device}; lower --max-running."
    )


__all__ = [
    "DEFAULT_INPUT_LEN",
    "DEFAULT_RANGE_RATIO",
    "ENGINE_MODES",
    "LATENCY_INPUT",
    "LATENCY_OUTPUT",
    "MAX_PAGE_SIZE",
    "MAX_RUNNING",
    "PAGE_SIZE",
    "PREFIX_MAX_RUNNING",
    "PREFIX_PAGE_SIZE",
    "ServePlan",
    "SERVE_DEFAULTS",
    "add_serve_arguments",
    "apply_serve_defaults",
    "check_serve_args",
    "check_serve_memory",
    "serve_flags_given",
]
