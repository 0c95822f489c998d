"""`stepgraph bench | generate | info`."""

from __future__ import annotations

import argparse
import json
import sys


def cmd_info(args: argparse.Namespace) -> int:
    import platform

    import torch

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
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from pathlib import Path

    import torch

    from .bench.main import DTYPES
    from .model.engine import Engine
    from .model.launch import build_model_runner, finish, is_main_rank

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = DTYPES[args.dtype or ("bfloat16" if device == "cuda" else "float32")]
    if args.prompt is not None:
        if not Path(args.model).is_dir():
            print(
                "--prompt needs a tokenizer: pass --model DIR of a local HF checkpoint, or use "
                "--prompt-ids",
                file=sys.stderr,
            )
            return 2
        from transformers import AutoTokenizer

        prompts = [AutoTokenizer.from_pretrained(args.model).encode(args.prompt)]
    else:
        prompts = [[int(t) for t in p.split(",") if t.strip()] for p in args.prompt_ids.split(";")]
    longest = max(len(p) for p in prompts) + args.max_new_tokens
    mr = build_model_runner(
        args.model,
        device,
        dtype,
        seed=args.seed,
        tp=args.tp,
        max_bs=max(len(prompts), 1),
        max_context_len=max(longest, 64),
    )
    if args.kernels:
        mr.set_kernels(args.kernels)  # default: fused on CUDA (one-row steps), reference on CPU
    engine = Engine(mr, mode=args.mode)
    outputs = engine.generate(
        prompts, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, seed=args.seed
    )
    engine.shutdown()
    if is_main_rank():  # with --tp every rank holds the same tokens; one prints
        if args.json:
            print(json.dumps({"outputs": outputs}))
        else:
            for i, out in enumerate(outputs):
                print(f"[{i}] {' '.join(map(str, out))}")
    finish()
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench.main import run

    return run(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stepgraph", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    from .bench.main import add_arguments

    bench = sub.add_parser("bench", help="time every mode and peer side by side (main job)")
    add_arguments(bench)
    bench.set_defaults(func=cmd_bench)

    gen = sub.add_parser("generate", help="generate token ids for prompts")
    gen.add_argument("--model", default="tiny", help="preset name or local HF directory")
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt-ids", help='token ids, prompts split by ";": "1,2,3;4,5"')
    src.add_argument("--prompt", help="text (needs a tokenizer in --model DIR)")
    gen.add_argument("--max-new-tokens", type=int, default=16)
    gen.add_argument("--mode", default="graph", choices=("eager", "graph", "exact"))
    gen.add_argument(
        "--kernels",
        default=None,
        choices=("fused", "reference"),
        help="decode-step kernels: fused (default on CUDA) or reference (unfused)",
    )
    gen.add_argument("--device", choices=("cuda", "cpu"), default=None)
    gen.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--json", action="store_true")
    gen.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel ranks (launch with torchrun --nproc-per-node N)",
    )
    gen.set_defaults(func=cmd_generate)

    info = sub.add_parser("info", help="versions, GPU, driver, and what is missing")
    info.set_defaults(func=cmd_info)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
