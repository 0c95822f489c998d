"""`stepgraph check`: a differential harness users run on their own model.

Random request mixes go through one engine per mode, all over the same weights (one KV cache
and attention backend each), and every mode's tokens are compared with eager's:

    eager   the reference: ``ModelRunner.forward`` every step
    graph   ``CudaGraphRunner``, fixed split geometry (captured at the bucket's max context)
    exact   the same graphs, split geometry retuned to the live KV length before each replay
    walk    ``ConfigGraphRunner`` over the model's decode walk (``model/decode/graph_walks.py``)

A mix: 1 to ``max_bs`` requests; prompts log-uniform from 1 token up to the context;
1 to 24 new tokens; about a third run with ``max_running`` below the batch (requests join
mid-stream); about a quarter are sampled (temperature, top-k) from a seed. In about half, most
prompts start with one of one or two shared prefixes (1 to 3 pages and a part of one), and one
may repeat another whole: the engines run with prefix caching on (their default), so a later
request reads pages an earlier one computed, and its prefill starts after them.

Every engine runs with its defaults, the prefill too: every mode pads a step's chunks to the
same token bucket (``GraphPrefill``), replayed from graphs in graph, exact and walk, run eagerly
in eager, so exact's prefill gives eager's bits as its decode does.

Exit status 1 when a strict mode differs from eager in any mix, or when any mode raises.
Exact is strict: its geometry is eager's, so its tokens must be eager's. The fixed-geometry
graph and the walk may differ in bf16 (another reduction order flips near-ties), so they are
reported, not judged, on CUDA. On the CPU there is no exact mode and every graph replay re-runs
the eager step, so graph and walk are strict there.
"""

from __future__ import annotations

import argparse
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .cli_args import (
    UsageError,
    add_device_args,
    add_model_args,
    choose_modes,
    model_config,
    positive_int,
    resolve_device,
    resolve_dtype,
)

MODES = ("eager", "graph", "exact", "walk")
CPU_MODES = ("eager", "graph", "walk")  # exact edits CUDA graph kernel nodes: not on the CPU
MAX_NEW_TOKENS = 24
EXPLAIN = (
    "graph replays the split geometry captured for the bucket's longest context; in bf16 its\n"
    "reduction order differs from eager's, so a near-tie can flip a token and the rest of the\n"
    "request follows. exact retunes the geometry to the live KV length before every replay:\n"
    "it must equal eager. In float32 all modes should agree."
)


@dataclass(frozen=True)
class Mix:
    prompts: list[list[int]]
    max_new_tokens: int
    max_running: int | None  # below len(prompts): requests join mid-stream
    temperature: float = 0.0
    top_k: int | None = None
    seed: int | None = None


def shared_prefixes(
    rng: random.Random, prompts: list[list[int]], vocab: int, max_prompt: int, page_size: int
) -> list[list[int]]:
    """``prompts`` with most of them starting with one of one or two prefixes of 1 to 3 full
    pages and part of another (at most ``max_prompt - 1`` tokens: a tail follows), their
    lengths capped at ``max_prompt``; the last may repeat an earlier prompt whole."""
    heads = []
    for _ in range(rng.randint(1, 2)):
        k = min(rng.randint(1, 3) * page_size + rng.randrange(page_size), max_prompt - 1)
        heads.append([rng.randrange(1, vocab) for _ in range(k)])
    out = []
    for p in prompts:
        if rng.random() < 0.75:
            head = rng.choice(heads)
            p = (head + p)[:max_prompt]  # the head and at least one token of p
        out.append(p)
    if len(out) > 1 and rng.random() < 0.3:
        out[-1] = list(out[rng.randrange(len(out) - 1)])
    return out


def random_mix(
    rng: random.Random, vocab: int, max_bs: int, max_prompt: int, page_size: int = 16
) -> Mix:
    n = rng.randint(1, max_bs)
    lengths = [round(math.exp(rng.uniform(0.0, math.log(max_prompt)))) for _ in range(n)]
    prompts = [[rng.randrange(1, vocab) for _ in range(max(1, k))] for k in lengths]
    if max_prompt > 1 and rng.random() < 0.5:
        prompts = shared_prefixes(rng, prompts, vocab, max_prompt, page_size)
    max_running = rng.randint(1, n - 1) if n > 1 and rng.random() < 0.35 else None
    mix = Mix(prompts, rng.randint(1, MAX_NEW_TOKENS), max_running)
    if rng.random() < 0.25:
        top_k = rng.choice([None, 20])
        return Mix(mix.prompts, mix.max_new_tokens, max_running, 0.8, top_k, rng.randrange(2**31))
    return mix


@dataclass
class ModeResult:
    outputs: list[list[list[int]] | None] = field(default_factory=list)  # per mix
    first_logits: list[torch.Tensor | None] = field(default_factory=list)  # [bs, vocab] float32
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)
    hit_rate: float = 0.0  # prompt tokens found in the prefix cache, over all mixes


def build_engines(model_runner, modes: list[str], max_bs: int) -> dict[str, object]:
    """One engine per mode over ``model_runner``'s weights, each with its own KV cache and
    attention backend (two runners capturing one backend would share its static metadata)."""
    from .engine import Engine
    from .model.model_runner import ModelRunner
    from .runner import RunnerConfig

    engines = {}
    for mode in modes:
        mr = model_runner
        if mode != "eager":
            mr = ModelRunner.from_model(
                model_runner.model,
                device=model_runner.device,
                dtype=model_runner.dtype,
                max_bs=max_bs,
                max_context_len=model_runner.max_context_len,
                page_size=model_runner.page_size,
            )
        config = RunnerConfig(max_bs=max_bs, show_progress=False)
        if mode == "walk":
            engines[mode] = Engine(mr, "graph", config, decode_via="configs")
        else:
            engines[mode] = Engine(mr, mode, config if mode != "eager" else None)
    return engines


def run_mix(engine, mix: Mix) -> tuple[list[list[int]], torch.Tensor | None]:
    """The tokens of ``mix`` on ``engine`` and the logits of its first decode step."""
    first: list[torch.Tensor] = []
    decode = engine.decoder.logits  # recorded here only: the first step's logits, copied

    def record(*args, **kwargs):  # the decoder's own arguments, passed through
        logits = decode(*args, **kwargs)
        if not first:
            first.append(logits.float().clone())  # a static buffer: copy before the next replay
        return logits

    engine.decoder.logits = record
    engine.max_running = mix.max_running
    try:
        out = engine.generate(
            mix.prompts,
            mix.max_new_tokens,
            temperature=mix.temperature,
            top_k=mix.top_k,
            seed=mix.seed,
            ignore_eos=True,
        )
    finally:
        del engine.decoder.logits  # back to the class's method
    return out, (first[0] if first else None)


def run_check(
    model_runner,
    mixes: list[Mix],
    modes: list[str],
    max_bs: int,
    log: Callable[[str], None] = print,
) -> dict[str, ModeResult]:
    """Every mix through every mode (eager first). A mode that raises on a mix records the
    error and goes on with the next mix (the engine has freed the mix's pages)."""
    results = {m: ModeResult() for m in modes}
    engines = {}
    for mode in modes:
        t0 = time.perf_counter()
        try:
            engines.update(build_engines(model_runner, [mode], max_bs))
        except Exception as e:  # a mode that cannot even be built fails the check
            results[mode].errors.append(f"building the {mode} engine: {type(e).__name__}: {e}")
        log(f"  {mode}: engine ready in {time.perf_counter() - t0:.1f} s")
    for mode, engine in engines.items():
        res = results[mode]
        for mix in mixes:
            t0 = time.perf_counter()
            try:
                out, logits = run_mix(engine, mix)
            except Exception as e:
                out, logits = None, None
                res.errors.append(f"{type(e).__name__}: {e}")
            res.seconds += time.perf_counter() - t0
            res.outputs.append(out)
            res.first_logits.append(logits)
        res.hit_rate = engine.stats.hit_rate
        engine.shutdown()
    return results


def compare(eager: ModeResult, other: ModeResult) -> tuple[int, float | None]:
    """Mixes whose tokens differ from eager's, and the largest first-step logit difference."""
    differ = sum(a != b for a, b in zip(eager.outputs, other.outputs))
    diffs = [
        (a - b).abs().max().item()
        for a, b in zip(eager.first_logits, other.first_logits)
        if a is not None and b is not None and a.shape == b.shape
    ]
    return differ, (max(diffs) if diffs else None)


def report(results: dict[str, ModeResult], strict: set[str], n_mixes: int) -> int:
    """Print one line per mode; return the exit status."""
    failed = []
    print(f"{'mode':<6} {'differ':>8} {'max |dlogit| step 1':>20} {'time':>8} {'cached':>7}")
    for mode, res in results.items():
        if mode == "eager":
            differ, dmax = 0, 0.0
        else:
            differ, dmax = compare(results["eager"], res)
        dtext = "-" if dmax is None else f"{dmax:.3g}"
        ran = f"{differ:>4}/{n_mixes:<3}" if res.outputs else f"{'-':>4} {'':<3}"  # not built
        tag = "  (strict: differ must be 0)" if mode in strict else ""
        hits = f"{res.hit_rate:.0%}"
        print(f"{mode:<6} {ran} {dtext:>20} {res.seconds:>7.1f}s {hits:>7}{tag}")
        for err in res.errors[:3]:
            print(f"       error: {err}")
        if res.errors:
            failed.append(f"{mode} raised {len(res.errors)} time(s)")
        if mode in strict and differ:
            failed.append(f"{mode} differs from eager in {differ} mix(es)")
    print(
        "differ: mixes whose tokens differ from eager's (a strict mode must have 0); the logit "
        "difference is reported, not judged; cached: prompt tokens read from the prefix cache"
    )
    print(EXPLAIN)
    if failed:
        print("FAIL: " + "; ".join(failed))
        return 1
    print("OK")
    return 0


def default_modes(device: str) -> list[str]:
    return list(MODES) if device == "cuda" else list(CPU_MODES)


def check_args(args: argparse.Namespace, device: str, config) -> tuple[list[str], int]:
    """The modes (eager first) and the KV length of ``stepgraph check``, refused before any
    work when they cannot run: exact on the CPU, or a context no mix fits in."""
    why = "with --device cpu: exact edits CUDA graph kernel nodes; the CPU stand-in has none"
    runnable = MODES if device == "cuda" else CPU_MODES
    modes = choose_modes(args.modes, MODES, runnable, why) or default_modes(device)
    context = args.context or min(2048 if device == "cuda" else 128, config.max_position_embeddings)
    limit = config.max_position_embeddings
    if context < MAX_NEW_TOKENS:  # a one-token prompt and 24 new tokens need 24 KV slots
        raise UsageError(
            f"argument --context: {context} holds no mix: a mix runs up to {MAX_NEW_TOKENS} new "
            f"tokens after a prompt of at least one; pass --context {MAX_NEW_TOKENS} or more"
        )
    if context > limit:
        raise UsageError(
            f"argument --context: {context} is more than {args.model}'s "
            f"max_position_embeddings={limit}; pass --context {limit} or less"
        )
    return ["eager"] + [m for m in modes if m != "eager"], context


def run(args: argparse.Namespace) -> int:
    from .bench.constants import DTYPES
    from .model.launch import build_model_runner

    device = resolve_device(args.device)
    dtype = DTYPES[resolve_dtype(args.dtype, device)]
    config = model_config(args.model)
    modes, context = check_args(args, device, config)
    max_prompt = max(1, context - MAX_NEW_TOKENS)
    rng = random.Random(args.seed)
    page = 16  # the KV page size build_model_runner uses
    mixes = [
        random_mix(rng, config.vocab_size, args.max_bs, max_prompt, page)
        for _ in range(args.trials)
    ]
    fp8 = ", FP8 weights" if args.quantization else ""
    print(
        f"stepgraph check: {args.model}{fp8}, {str(dtype).removeprefix('torch.')} on {device}, "
        f"{len(mixes)} mixes of 1-{args.max_bs} requests, prompts 1-{max_prompt} tokens, "
        f"1-{MAX_NEW_TOKENS} new tokens, seed {args.seed}; modes {','.join(modes)}"
    )
    mr = build_model_runner(
        args.model,
        device,
        dtype,
        seed=args.seed,
        max_bs=args.max_bs,
        max_context_len=context,
        quantization=args.quantization,
    )
    results = run_check(mr, mixes, modes, args.max_bs)
    strict = {"exact"} if device == "cuda" else {"graph", "walk", "exact"}
    return report(results, strict & set(modes), len(mixes))


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_args(p, required=True, seed_help="mixes and random weights")
    add_device_args(p)
    p.add_argument("--trials", type=positive_int, default=20, help="random request mixes")
    p.add_argument("--max-bs", type=positive_int, default=8, help="requests per mix, at most")
    p.add_argument(
        "--context",
        type=positive_int,
        default=None,
        help=f"KV length, {MAX_NEW_TOKENS} to the model's max_position_embeddings "
        "(default 2048; CPU 128)",
    )
    p.add_argument(
        "--modes",
        default=None,
        help="comma list of eager,graph,exact,walk (default: all; CPU has no exact)",
    )


__all__ = [
    "CPU_MODES",
    "MODES",
    "Mix",
    "add_arguments",
    "check_args",
    "compare",
    "random_mix",
    "run",
    "run_check",
    "shared_prefixes",
]
