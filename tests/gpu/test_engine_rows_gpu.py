"""On a real GPU, no decode batch outgrows the model runner: 33 prompts of 1-1,700 tokens on a
runner of 8 rows run in every mode (eager, graph, exact, the configs walk), in bf16 and float32,
without a device-side assert, never more than 8 rows a step, and exact equals eager token for
token. An eager forward of one row too many is refused on the host and the runner still works.
A differential fuzz (``stepgraph.check``'s harness) sends random mixes of up to 70 requests with
prompts up to 2,000 tokens through runners of 8 and 64 rows in every mode: no mode raises, and
exact equals eager token for token (graph and the walk may flip bf16 near-ties: reported only).

Random weights, two layers of the llama-3.2-1b shapes; nothing touches CUDA at import time."""

from __future__ import annotations

import random

import pytest
import torch

from stepgraph.check import MAX_NEW_TOKENS, Mix, compare, run_check
from stepgraph.engine import Engine
from stepgraph.errors import ConfigError
from stepgraph.model import ModelRunner
from stepgraph.runner import RunnerConfig

pytestmark = pytest.mark.cuda

PRESET = "llama-3.2-1b"
NUM_LAYERS = 2
CONTEXT = 2048
REPRO_PROMPTS, REPRO_LONGEST, REPRO_NEW = 33, 1700, 23
FUZZ_MIXES = 3  # per runner size: the whole file stays within about three minutes on an H200
FUZZ_MOST_REQUESTS, FUZZ_LONGEST = 70, 2000


def _runner(dtype: torch.dtype, max_bs: int, seed: int = 11) -> ModelRunner:
    return ModelRunner.from_preset(
        PRESET, "cuda", dtype, seed, num_layers=NUM_LAYERS, max_bs=max_bs, max_context_len=CONTEXT
    )


def _engine(mr: ModelRunner, mode: str) -> Engine:
    """Each mode on its own model runner over ``mr``'s weights (own KV cache and backend)."""
    own = ModelRunner.from_model(
        mr.model, device="cuda", dtype=mr.dtype, max_bs=mr.max_bs, max_context_len=CONTEXT
    )
    if mode == "walk":
        return Engine(own, "graph", decode_via="configs")
    return Engine(own, mode)  # runner_config and max_running: the model runner's max_bs


def _repro_prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(40)
    lengths = [1, REPRO_LONGEST] + [rng.randint(1, REPRO_LONGEST) for _ in range(31)]
    return [[rng.randrange(1, vocab) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_33_prompts_on_8_rows_in_every_mode(dtype):
    mr = _runner(dtype, 8)
    prompts = _repro_prompts(mr.config.vocab_size)
    assert len(prompts) == REPRO_PROMPTS
    outs = {}
    for mode in ("eager", "graph", "exact", "walk"):
        engine = _engine(mr, mode)
        assert engine.max_running == 8
        outs[mode] = engine.generate(prompts, REPRO_NEW, ignore_eos=True)
        torch.cuda.synchronize()  # a device-side assert would surface here
        assert max(engine.stats.batch_sizes) == 8, (mode, engine.stats.batch_sizes)
        assert [len(o) for o in outs[mode]] == [REPRO_NEW] * REPRO_PROMPTS
        if mode != "eager":
            assert engine.stats.eager_steps == 0, mode  # every decode step replayed a graph
        engine.shutdown()
    assert outs["exact"] == outs["eager"]


def test_default_mode_on_cuda_is_exact_and_equals_eager():
    mr = _runner(torch.bfloat16, 8)
    engine = Engine(mr)
    assert engine.mode == "exact" and engine.runner.config.mode == "exact"
    assert engine.runner.capture_bs == [1, 2, 4, 8]  # the model runner's max_bs, not 256
    prompts = _repro_prompts(mr.config.vocab_size)[:12]
    eager = _engine(mr, "eager")
    assert engine.generate(prompts, 9, ignore_eos=True) == eager.generate(
        prompts, 9, ignore_eos=True
    )


def test_eager_forward_of_one_row_too_many_is_refused_on_the_host():
    mr = _runner(torch.bfloat16, 8)

    def batch(bs: int):
        pages = [mr.kv_cache.reserve(20) for _ in range(bs)]
        return mr.decode_batch(list(range(1, bs + 1)), [19] * bs, pages), pages

    nine, pages = batch(9)
    with pytest.raises(ConfigError, match=r"9 rows .* max_bs=8"):
        mr.forward(nine)
    for p in pages:
        mr.kv_cache.release(p)
    eight, _ = batch(8)
    logits = mr.forward(eight)
    torch.cuda.synchronize()
    assert logits.shape[0] == 8 and torch.isfinite(logits).all()
    with pytest.raises(ConfigError, match="max_bs=8"):
        Engine(mr, "eager", max_running=9)


def _fuzz_mixes(rng: random.Random, vocab: int, rows: int) -> list[Mix]:
    """Random mixes: 1-70 requests (the first mix the most), prompts log-uniform up to 2,000
    tokens, 1-24 new tokens; some below the runner's rows of max_running, some sampled."""
    mixes = []
    for k in range(FUZZ_MIXES):
        n = FUZZ_MOST_REQUESTS if k == 0 else rng.randint(1, FUZZ_MOST_REQUESTS)
        lengths = [round(FUZZ_LONGEST ** rng.random()) for _ in range(n)]
        prompts = [[rng.randrange(1, vocab) for _ in range(max(1, m))] for m in lengths]
        max_running = rng.randint(1, rows) if rng.random() < 0.3 else None
        new = rng.randint(1, MAX_NEW_TOKENS)
        if rng.random() < 0.25:
            mixes.append(Mix(prompts, new, max_running, 0.8, rng.choice([None, 20]), k))
        else:
            mixes.append(Mix(prompts, new, max_running))
    return mixes


@pytest.mark.parametrize("rows", [8, 64])
def test_fuzz_every_mode_runs_and_exact_equals_eager(rows):
    mr = _runner(torch.bfloat16, rows, seed=rows)
    mixes = _fuzz_mixes(random.Random(rows), mr.config.vocab_size, rows)
    modes = ["eager", "graph", "exact", "walk"]
    results = run_check(mr, mixes, modes, rows, log=lambda line: None)
    for mode in modes:
        assert results[mode].errors == [], (mode, results[mode].errors[:3])
        assert all(o is not None for o in results[mode].outputs), mode
    differ, _ = compare(results["eager"], results["exact"])
    assert differ == 0, f"exact differs from eager in {differ} of {len(mixes)} mixes"


def test_runner_config_above_the_model_runner_is_refused_before_capture():
    mr = _runner(torch.bfloat16, 8)
    with pytest.raises(ConfigError, match=r"max_bs=8"):
        Engine(mr, "exact", RunnerConfig(max_bs=64, show_progress=False))
