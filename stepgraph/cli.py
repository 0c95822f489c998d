"""`stepgraph bench | generate | buckets | check | serve | info`."""

from __future__ import annotations

import argparse
import json
import sys

from .cli_args import (
    DTYPE_NAMES,
    TP_HELP,
    Parser,
    add_device_args,
    add_model_args,
    check_prompts,
    check_tp,
    model_config,
    nonneg_float,
    positive_int,
    resolve_device,
    resolve_dtype,
    run_main,
)


def cmd_info(args: argparse.Namespace) -> int:
    import platform

    import torch

    config = model_config(args.model) if args.model is not None else None  # before any line
    print(f"stepgraph {__import__('stepgraph').__version__}, python {platform.python_version()}")
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda})")
    for name in ("triton", "cuda.bindings", "transformers", "safetensors", "matplotlib", "tqdm"):
        try:
            mod = __import__(name, fromlist=["__version__"])
            print(f"{name} {getattr(mod, '__version__', '?')}")
        except Exception as e:  # optional pieces: say what is missing, keep going
            print(f"{name}: missing ({type(e).__name__})")
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        print(f"GPU: {p.name}, {p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB")
        try:
            from .graph_update.driver import get_driver

            v = int(get_driver()._call("cuDriverGetVersion"))
            print(f"driver: supports CUDA {v // 1000}.{v % 1000 // 10}")
        except Exception as e:
            print(f"driver: unavailable ({e})")
    else:
        print("GPU: none visible (graphs run on the CPU stand-in; exact mode needs a GPU)")
    if args.model is not None:
        from .bench.constants import DTYPES
        from .model.decode.kernel_plan import format_plan

        dtype = args.dtype or "bfloat16"
        itemsize = DTYPES[dtype].itemsize
        print(format_plan(args.model, dtype, config, itemsize, quantization=args.quantization))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from .bench.main import DTYPES
    from .engine import Engine
    from .model.launch import build_model_runner, finish, is_main_rank

    device = resolve_device(args.device)
    dtype = DTYPES[resolve_dtype(args.dtype, device)]
    config = model_config(args.model)
    check_tp(args.tp, "generate")
    from .prompts import decode_outputs, text_tokenizer

    tokenizer = text_tokenizer(args.model, required=args.prompt is not None)
    if args.prompt is not None:
        prompts = [list(tokenizer.encode(args.prompt))]
    elif args.prompt_file is not None:
        from .prompts import read_prompt_file

        prompts = read_prompt_file(args.prompt_file)
    else:
        from .prompts import parse_prompt_ids

        prompts = parse_prompt_ids(args.prompt_ids)
    flag = next(
        f"--{k.replace('_', '-')}"
        for k in ("prompt", "prompt_file", "prompt_ids")
        if getattr(args, k) is not None
    )
    check_prompts(prompts, args.max_new_tokens, config, flag)  # before any weight is built
    from .prompts import parse_stop_ids

    stop_ids = parse_stop_ids(args.stop_ids, config.vocab_size) if args.stop_ids else None
    longest = max(len(p) for p in prompts) + args.max_new_tokens
    mr = build_model_runner(
        args.model,
        device,
        dtype,
        seed=args.seed,
        tp=args.tp,
        max_bs=max(len(prompts), 1),
        max_context_len=min(max(longest, 64), config.max_position_embeddings),
        quantization=args.quantization,
    )
    if args.kernels:
        mr.set_kernels(args.kernels)  # default: fused on CUDA (one-row steps), reference on CPU
    if args.kernels == "fused" and device == "cpu" and is_main_rank():
        from .bench.cpu import FUSED_NOTE

        print(f"stepgraph: note: {FUSED_NOTE}", file=sys.stderr)
    engine = Engine(mr, mode=args.mode)

    outputs = engine.generate(
        prompts,
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        seed=args.seed,
        stop_ids=stop_ids,
        ignore_eos=args.ignore_eos,
    )
    engine.shutdown()
    if is_main_rank():  # with --tp every rank holds the same tokens; one prints
        texts = decode_outputs(tokenizer, outputs)  # None without a tokenizer
        if args.json:
            print(json.dumps({"outputs": outputs, **({"texts": texts} if texts else {})}))
        else:
            for i, out in enumerate(outputs):
                print(f"[{i}] {texts[i] if texts else ' '.join(map(str, out))}")
    finish()
    return 0


def cmd_buckets(args: argparse.Namespace) -> int:
    from .bucket_plan import plan_buckets, read_trace
    from .errors import ConfigError

    if args.trace == "-":
        text = sys.stdin.read()
    else:
        try:
            with open(args.trace) as f:
                text = f.read()
        except OSError as e:
            raise ConfigError(f"--trace {args.trace}: {e.strerror}; check the path.") from e
    plan = plan_buckets(read_trace(text, f"trace {args.trace}"), args.max_graphs)
    print(json.dumps(plan.as_json()) if args.json else plan)
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from .check import run

    return run(args)


def cmd_serve(args: argparse.Namespace) -> int:
    from .serve.cli import run

    return run(args)


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench.args import NO_GPU_NOTE, check_bench_args, choose_device
    from .bench.main import run

    fell_back = choose_device(args)
    check_bench_args(args)
    if fell_back:  # the first line of the main job on a machine without a GPU
        print(NO_GPU_NOTE, flush=True)
    return run(args)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="stepgraph", description=__doc__)
    parser.add_argument(
        "--debug", action="store_true", help="show the traceback of an error (anywhere in argv)"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    from .bench.main import add_arguments

    bench = sub.add_parser("bench", help="time every mode and peer side by side (main job)")
    add_arguments(bench)
    bench.set_defaults(func=cmd_bench)

    gen = sub.add_parser(
        "generate", help="generate for prompts: the text with a tokenizer, else token ids"
    )
    add_model_args(
        gen,
        model="tiny",
        mode_help="decode steps: eager, CUDA graphs, or graphs retuned to the live KV length",
        kernels_help="decode-step kernels: fused (default on CUDA) or reference (unfused)",
        seed_help="random weights and sampling, 0..2**64-1",
        tp_help=TP_HELP,
    )
    add_device_args(gen)
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt-ids", help='token ids, prompts split by ";": "1,2,3;4,5"')
    src.add_argument("--prompt", help="text (needs a tokenizer in --model DIR)")
    src.add_argument(
        "--prompt-file",
        help="JSON list of token-id lists, or JSON Lines (one list per line); - reads stdin",
    )
    gen.add_argument(
        "--max-new-tokens", type=positive_int, default=16, help="new tokens per prompt, at most"
    )
    gen.add_argument("--temperature", type=nonneg_float, default=0.0, help="0: greedy")
    gen.add_argument("--top-k", type=positive_int, default=None, help="sample from the k likeliest")
    gen.add_argument(
        "--json",
        action="store_true",
        help='print {"outputs": [[ids...], ...]}, and "texts": [...] with a tokenizer',
    )
    gen.add_argument(
        "--stop-ids",
        default=None,
        help='extra ids that end a request, "2,7" (the checkpoint\'s eos_token_id always does)',
    )
    gen.add_argument(
        "--ignore-eos",
        action="store_true",
        help="do not stop at the checkpoint's eos_token_id (--stop-ids still apply)",
    )
    gen.set_defaults(func=cmd_generate)

    buckets = sub.add_parser(
        "buckets", help="choose capture sizes from a trace of observed decode batch sizes"
    )
    buckets.add_argument(
        "--trace",
        required=True,
        help="batch sizes, one per line or a JSON list (Engine.stats.write_trace); - reads stdin",
    )
    buckets.add_argument(
        "--max-graphs", type=positive_int, required=True, help="at most this many buckets"
    )
    buckets.add_argument(
        "--json",
        action="store_true",
        help="print the buckets and the padding waste as JSON: padding_waste (rows run per "
        "real row) and padding_waste_pct (extra rows, %%, as the text shows)",
    )
    buckets.set_defaults(func=cmd_buckets)

    from .check import add_arguments as add_check_arguments

    check = sub.add_parser(
        "check", help="differential check: every mode's tokens against eager on random mixes"
    )
    add_check_arguments(check)
    check.set_defaults(func=cmd_check)

    from .serve.cli import add_arguments as add_serve_arguments

    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server over the engine")
    add_serve_arguments(serve)
    serve.set_defaults(func=cmd_serve)

    info = sub.add_parser("info", help="versions, GPU, driver, and what is missing")
    add_model_args(
        info,
        quantization_help="for --model: the plan with the projections' weights in FP8 (e4m3) "
        "per channel (fp8) or per 128x128 block (fp8-block), as --quantization loads them",
        model_help="also print which decode kernels run at each batch bucket for this preset "
        "or local HF directory (no weights are read)",
    )
    info.add_argument(
        "--dtype", choices=DTYPE_NAMES, help="for --model: the weights' dtype (default bfloat16)"
    )
    info.set_defaults(func=cmd_info)
    return parser


def _run(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


def main(argv: list[str] | None = None) -> int:
    """Exit status: 0, 1 (a check failed), 2 (an error, printed as one line on stderr)."""
    from .model.launch import exit_after_group

    return exit_after_group(run_main(_run, argv))


if __name__ == "__main__":
    sys.exit(main())
