"""`stepgraph serve`: its flags, checked before anything is built, and ``run``: bind the port,
build the model and the engine in the engine process (``proc_worker.py``, the default) or on an
engine thread (``worker.py``, ``--engine thread``), load the tokenizer of a checkpoint
directory (an API key guards ``/v1/`` when given), serve until SIGINT/SIGTERM, stop the
engine, exit 0. Also ``python -m stepgraph.serve``."""

from __future__ import annotations

import argparse
import functools
import shlex
import sys

from .. import env
from ..cli_args import (
    UsageError,
    add_device_args,
    add_model_args,
    check_threads,
    model_config,
    nonneg_float,
    positive_int,
    resolve_device,
    resolve_dtype,
)

ENGINES = ("process", "thread")
MASTER_PORT = 29500  # torchrun's default (tp_launch.MASTER_PORT, not imported: flags only)


def port_number(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be in [0, 65535] (0: any free port), got {value}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags; imports neither the engine nor the serve extra (every command builds this)."""
    from .protocol import DEFAULT_MAX_WAITING

    add_model_args(
        p,
        required=True,
        mode_help="decode steps: eager, CUDA graphs, or graphs retuned to the KV length",
        kernels_help="decode-step kernels (default: fused on CUDA)",
        seed_help="random weights of a preset",
        tp_help="tensor-parallel ranks, one process per device, started through torchrun by "
        "this command (NCCL on CUDA, gloo on the CPU); rank 0 runs the schedule "
        "(docs/tensor_parallel.md)",
        threads=True,
    )
    add_device_args(p)
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on: 127.0.0.1 (the default) is reached from this machine only; "
        "0.0.0.0 or :: from every network it is on (then pass --api-key)",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="requests to /v1/ then need the header 'Authorization: Bearer KEY', else 401; "
        "/health and /metrics stay open (default: $STEPGRAPH_API_KEY, else none)",
    )
    p.add_argument("--port", type=port_number, default=8000, help="0: any free port")
    p.add_argument(
        "--engine",
        default="process",
        choices=ENGINES,
        help="where the engine runs: its own process, one message per step through pipes (the "
        "default and the faster on the GPU: the HTTP side's Python and the engine's never share "
        "a GIL; docs/results.md), or a thread of the HTTP process",
    )
    p.add_argument(
        "--max-running",
        type=positive_int,
        default=64,
        help="requests decoding at once (the largest graph bucket)",
    )
    p.add_argument(
        "--max-waiting",
        type=int,
        default=DEFAULT_MAX_WAITING,
        help="requests queued beyond those running; more get 503 + Retry-After",
    )
    p.add_argument(
        "--max-context",
        type=positive_int,
        default=None,
        help="prompt + new tokens of one request (default: the model's, at most 4096)",
    )
    p.add_argument(
        "--max-prefill-tokens",
        type=positive_int,
        default=None,
        help="prompt tokens one engine step prefills (default: the engine's, 8192)",
    )
    p.add_argument(
        "--max-prefill-tokens-with-decode",
        type=nonneg_int,
        default=None,
        help="prompt tokens a step that also decodes prefills, at most, so running requests "
        "keep their pace (default: the engine's, 2048; 1024: a lower ITL p99 for 4-9%% of the "
        "throughput; a token bucket, a power of two, else its steps run padded; 0: no cap)",
    )
    p.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="prefill every prompt whole (default: reuse the KV pages of cached prompt prefixes)",
    )
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the name clients send as model (default: --model)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=nonneg_float,
        default=30.0,
        help="on SIGINT/SIGTERM, seconds requests in flight get to finish",
    )
    add_node_args(p)
    p.add_argument(
        "--log-level",
        default="warning",
        choices=("critical", "error", "warning", "info", "debug"),
        help="uvicorn's",
    )


def nonneg_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def master_port(text: str) -> int:
    value = port_number(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be in [1, 65535]: the other nodes connect to it")
    return value


def add_node_args(p: argparse.ArgumentParser) -> None:
    """``--tp N`` over several nodes: torchrun's static rendezvous flags, passed through."""
    g = p.add_argument_group("tensor parallelism over nodes (torchrun's static rendezvous)")
    g.add_argument(
        "--nnodes",
        type=positive_int,
        default=1,
        help="nodes the --tp ranks span, --tp / --nnodes on each (default 1: this one)",
    )
    g.add_argument(
        "--node-rank",
        type=nonneg_int,
        default=None,
        help="this node's rank, 0 to --nnodes - 1: node 0 serves HTTP and runs global rank 0; "
        "the others run their ranks only, and exit when the group ends",
    )
    g.add_argument(
        "--master-addr",
        default=None,
        help="node 0's address, reachable from every node (torchrun's store listens there)",
    )
    g.add_argument(
        "--master-port",
        type=master_port,
        default=None,
        help=f"the port of torchrun's store on node 0 (default {MASTER_PORT})",
    )
    g.add_argument(
        "--rdzv-backend",
        default="static",
        help="torchrun's rendezvous: static only (c10d numbers nodes by their ids, so rank 0 "
        "might not run on node 0, beside the HTTP server)",
    )


def rendezvous(args: argparse.Namespace):
    """The ``Rendezvous`` of ``--nnodes``, ``--node-rank``, ``--master-addr``, ``--master-port``
    (one-line errors naming the flags)."""
    from .tp_launch import Rendezvous

    nnodes, tp = args.nnodes, args.tp
    if args.rdzv_backend != "static":
        raise UsageError(
            f"argument --rdzv-backend: {args.rdzv_backend!r} is not supported; only static "
            "rendezvous (--node-rank, --master-addr) keeps global rank 0 on node 0, beside the "
            "HTTP server: drop --rdzv-backend"
        )
    if nnodes == 1:
        given = [
            f
            for f, v in (
                ("--node-rank", args.node_rank),
                ("--master-addr", args.master_addr),
                ("--master-port", args.master_port),
            )
            if v is not None
        ]
        if given:
            raise UsageError(
                f"argument {given[0]}: goes with --nnodes 2 or more (one node needs no "
                "rendezvous); pass --nnodes or drop it"
            )
        return Rendezvous()
    if tp % nnodes:
        raise UsageError(
            f"argument --nnodes: --tp {tp} ranks do not split evenly over --nnodes {nnodes} "
            "(each node runs --tp / --nnodes ranks); pass a --tp that --nnodes divides"
        )
    if args.node_rank is None or args.node_rank >= nnodes:
        got = "none" if args.node_rank is None else args.node_rank
        raise UsageError(
            f"argument --node-rank: --nnodes {nnodes} needs this node's rank, 0 (the HTTP "
            f"server's node) to {nnodes - 1}; got {got}"
        )
    if args.master_addr is None:
        raise UsageError(
            f"argument --master-addr: --nnodes {nnodes} needs node 0's address, reachable "
            "from every node"
        )
    port = MASTER_PORT if args.master_port is None else args.master_port
    return Rendezvous(nnodes, args.node_rank, args.master_addr, port)


def check_args(args: argparse.Namespace, config) -> int:
    """The context length to serve; one-line errors naming the flag."""
    if args.max_waiting < 0:
        raise UsageError(f"argument --max-waiting: must be >= 0, got {args.max_waiting}")
    limit = config.max_position_embeddings
    context = args.max_context or min(limit, 4096)
    if context > limit:
        raise UsageError(
            f"argument --max-context: {context} is more than the model's "
            f"max_position_embeddings={limit}; pass at most {limit}"
        )
    check_serve_tp(args)
    return context


def check_serve_tp(args: argparse.Namespace) -> None:
    """``--tp N``: this process starts the N ranks (through torchrun), so it must not be one."""
    tp = getattr(args, "tp", 1)
    rendezvous(args)
    if tp <= 1:
        return
    from ..model.distributed import torchrun_world_size

    if torchrun_world_size() is not None:
        raise UsageError(
            f"argument --tp: `stepgraph serve --tp {tp}` starts its {tp} ranks through torchrun "
            "itself; run it as a plain command, not under torchrun"
        )
    if args.engine != "process":
        raise UsageError(
            f"argument --engine: {args.engine} runs one engine in this process; --tp {tp} runs "
            "its ranks in processes of their own: drop --engine"
        )
    if args.quantization is not None:
        raise UsageError(
            "argument --quantization: FP8 weights run unsharded; drop it or pass --tp 1"
        )


def api_key(args: argparse.Namespace) -> str | None:
    """``--api-key``, else ``$STEPGRAPH_API_KEY``, else None; an empty key is refused."""
    if args.api_key is not None:
        if not args.api_key.strip():
            raise UsageError("argument --api-key: empty; pass a key, or drop the flag")
        return args.api_key
    return env.api_key()


def need_extras() -> None:
    missing = []
    for name in ("starlette", "uvicorn", "prometheus_client"):
        try:
            __import__(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise UsageError(
            f"stepgraph serve needs {', '.join(missing)}; install the serve extra: "
            "pip install -e '.[serve]'"
        )


def engine_spec(args: argparse.Namespace, device: str, dtype: str, context: int):
    """What the engine process (or thread) builds: the model runner, the engine, a warm-up."""
    from .engine_proc import EngineSpec

    return EngineSpec(
        args.model,
        device,
        dtype,
        args.mode,
        args.max_running,
        context,
        args.seed,
        args.kernels,
        args.max_prefill_tokens,
        args.threads,
        quantization=args.quantization,
        prefix_caching=not args.no_prefix_caching,
        tp=args.tp,
        max_prefill_tokens_with_decode=args.max_prefill_tokens_with_decode,
    )


def follow_node(args: argparse.Namespace, rdzv) -> int:
    """``--node-rank K`` > 0: this node's ranks of node 0's group, no HTTP front end."""
    from .tp_launch import follow

    config = model_config(args.model)
    context = check_args(args, config)
    device = resolve_device(args.device)
    check_threads(args.threads, device)
    spec = engine_spec(args, device, resolve_dtype(args.dtype, device), context)
    say(
        f"node {rdzv.node_rank} of {rdzv.nnodes}: starting {args.tp // rdzv.nnodes} of the "
        f"{args.tp} tensor-parallel ranks through torchrun, joining node 0 at "
        f"{rdzv.master_addr}:{rdzv.master_port}"
    )
    status = follow(spec, rdzv)
    say("the rank group stopped" if status == 0 else f"the rank group failed (status {status})")
    return 0 if status == 0 else 1


def run(args: argparse.Namespace) -> int:
    rdzv = rendezvous(args)
    if rdzv.node_rank > 0:
        return follow_node(args, rdzv)
    need_extras()
    from .app import build_app
    from .auth import exposure_warning
    from .metrics import ServeMetrics
    from .proc_worker import ProcessWorker
    from .server import Server, listen, uvicorn_config
    from .tokenizer import load_tokenizer
    from .worker import EngineWorker

    config = model_config(args.model)
    context = check_args(args, config)
    device = resolve_device(args.device)
    check_threads(args.threads, device)
    dtype = resolve_dtype(args.dtype, device)
    key = api_key(args)
    sock = listen(args.host, args.port)  # a busy port fails now, not after the weights
    try:
        if (warning := exposure_warning(sock.getsockname()[0], key)) is not None:
            say(warning)
        tokenizer = load_tokenizer(args.model)
        say(
            f"building {args.model} and the engine ({args.mode}, max running "
            f"{args.max_running}, in its own {args.engine})"
        )
        spec = engine_spec(args, device, dtype, context)
        Worker = ProcessWorker if args.engine == "process" else EngineWorker
        if args.tp > 1:
            from .tp import TPWorker

            Worker = functools.partial(TPWorker, rendezvous=rdzv)
            say(f"starting {args.tp // rdzv.nnodes} tensor-parallel ranks through torchrun")
            if rdzv.nnodes > 1:
                from .tp_launch import follower_command

                say(f"{args.tp} ranks over {rdzv.nnodes} nodes; start the others with:")
                for k in range(1, rdzv.nnodes):
                    say(f"  node {k}: {shlex.join(follower_command(spec, rdzv, k))}")
        worker = Worker(spec, ServeMetrics())
        try:
            worker.start()
            name = args.served_model_name or args.model
            chat = tokenizer is not None and tokenizer.has_chat_template
            limits = worker.limits(name, tokenizer is not None, chat)
            drain = args.shutdown_timeout + 5
            app = build_app(worker, limits, tokenizer, args.max_waiting, drain, api_key=key)
            host, port = sock.getsockname()[:2]
            say(f"serving {name!r} on http://{host}:{port} (OpenAI API: /v1/completions)")
            Server(uvicorn_config(app, args.shutdown_timeout, args.log_level)).run([sock])
        finally:
            worker.stop(args.shutdown_timeout + 5)  # the app's shutdown did, unless it failed
    finally:
        sock.close()
    say("stopped")
    return 0


def say(text: str) -> None:
    print(f"stepgraph serve: {text}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    """``python -m stepgraph.serve ...``: the same as ``stepgraph serve ...``."""
    from ..cli_args import Parser, run_main

    def _run(a: list[str]) -> int:
        parser = Parser(prog="stepgraph serve", description=__doc__)
        add_arguments(parser)
        return run(parser.parse_args(a))

    return run_main(_run, argv)


__all__ = ["add_arguments", "check_args", "main", "run"]
