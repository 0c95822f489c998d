"""The decode batch never holds more rows than the model runner was built for: the engine's
``max_running`` defaults to ``model_runner.max_bs`` and may not exceed it, the graph runner takes
the model runner's ``max_bs`` and refuses a larger config, and an eager ``ModelRunner.forward``
refuses a batch above it on the host, before anything reaches the device."""

from __future__ import annotations

import pytest
import torch

from stepgraph.engine import Engine
from stepgraph.errors import ConfigError, StepGraphError
from stepgraph.model import ModelRunner
from stepgraph.runner import CudaGraphRunner, RunnerConfig

VOCAB = 512
ROWS = 8


def _runner(max_bs: int = ROWS, **kw) -> ModelRunner:
    return ModelRunner.from_preset(
        "tiny", "cpu", torch.float32, seed=5, max_bs=max_bs, max_context_len=64, **kw
    )


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 40, (n,), generator=g).tolist()
    return [torch.randint(1, VOCAB, (k,), generator=g).tolist() for k in lengths]


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    """33 prompts' tokens on a model runner wide enough for all of them at once (no limit)."""
    mr = _runner(max_bs=33, num_pages=33 * 4 + 1)
    engine = Engine(mr, "eager")
    assert engine.max_running == 33
    out = engine.generate(_prompts(33), 5)
    assert max(engine.stats.batch_sizes) == 33  # the reference really ran them together
    return out


@pytest.mark.parametrize(
    "mode, decode_via", [("eager", "runner"), ("graph", "runner"), ("graph", "configs")]
)
def test_33_prompts_on_8_rows_never_decode_more_than_8(reference, mode, decode_via):
    """Exact mode edits CUDA graph kernel nodes, so the CPU runs it nowhere (the GPU tier does);
    the pages fit all 33 at once, so only ``max_running`` holds the batch to 8 rows."""
    mr = _runner(num_pages=33 * 4 + 1)
    engine = Engine(mr, mode, decode_via=decode_via)
    assert engine.max_running == ROWS
    out = engine.generate(_prompts(33), 5)
    assert out == reference
    assert max(engine.stats.batch_sizes) == ROWS  # at the limit, never past it
    assert sum(engine.stats.batch_sizes.values()) > 0
    if mode == "graph":
        assert engine.stats.graph_steps > 0 and engine.stats.eager_steps == 0


def test_max_running_at_the_limit_and_one_past_it():
    mr = _runner()
    assert Engine(mr, "eager", max_running=ROWS).max_running == ROWS
    assert Engine(mr, "eager", max_running=3).max_running == 3
    with pytest.raises(ConfigError) as e:
        Engine(mr, "eager", max_running=ROWS + 1)
    msg = str(e.value)
    assert "max_running=9" in msg and "max_bs=8" in msg and "max_running <= 8" in msg


def test_max_running_set_later_is_checked_and_none_restores_the_limit():
    engine = Engine(_runner(), "eager", max_running=2)
    engine.max_running = None
    assert engine.max_running == ROWS
    with pytest.raises(ConfigError, match="max_bs=8"):
        engine.max_running = ROWS + 1
    assert engine.max_running == ROWS
    with pytest.raises(ConfigError, match="integer >= 1"):
        engine.max_running = 0


def test_a_model_runner_without_max_bs_has_no_limit():
    from stepgraph.engine.requests import running_limit

    class Own:  # a model runner of your own that does not say how many rows it holds
        pass

    assert running_limit(Own(), None) is None
    assert running_limit(Own(), 1000) == 1000


def _batch(mr: ModelRunner, bs: int):
    pages = [mr.kv_cache.reserve(4) for _ in range(bs)]
    return mr.decode_batch([1 + i for i in range(bs)], [3] * bs, pages), pages


def test_eager_forward_of_max_bs_rows_runs_and_one_more_is_refused():
    mr = _runner(max_bs=ROWS)
    batch, pages = _batch(mr, ROWS)
    assert mr.forward(batch).shape == (ROWS, VOCAB)
    for p in pages:
        mr.kv_cache.release(p)
    batch, _ = _batch(mr, ROWS + 1)
    with pytest.raises(StepGraphError) as e:
        mr.forward(batch)
    assert isinstance(e.value, ConfigError)
    assert "9 rows" in str(e.value) and "max_bs=8" in str(e.value)


def test_graph_runner_takes_the_model_runners_max_bs():
    mr = _runner(max_bs=ROWS)
    runner = CudaGraphRunner(mr, capture=False)
    assert runner.max_bs == ROWS and runner.capture_bs == [1, 2, 4, 8]


def test_graph_runner_config_above_the_model_runner_is_refused():
    mr = _runner(max_bs=ROWS)
    at = CudaGraphRunner(mr, RunnerConfig(max_bs=ROWS, show_progress=False), capture=False)
    assert at.max_bs == ROWS
    for config in (RunnerConfig(max_bs=ROWS + 1), RunnerConfig(capture_bs=(1, 2, 16))):
        with pytest.raises(ConfigError) as e:
            CudaGraphRunner(mr, config, capture=False)
        largest = max(config.buckets())
        assert f"{largest} rows" in str(e.value) and "max_bs=8" in str(e.value)
        assert "RunnerConfig(max_bs=8)" in str(e.value)


@pytest.mark.parametrize("decode_via", ["runner", "configs"])
def test_engine_refuses_a_runner_config_above_the_model_runner(decode_via):
    mr = _runner(max_bs=ROWS)
    with pytest.raises(ConfigError, match="max_bs=8"):
        Engine(mr, "graph", RunnerConfig(max_bs=16), decode_via=decode_via)


def test_default_mode_is_the_fastest_that_equals_eager():
    """Exact on CUDA (graphs retuned to eager's geometry); eager on the CPU, whose graph
    stand-in only re-runs the eager step; the configs walk has graph mode alone."""
    from types import SimpleNamespace

    from stepgraph.engine.requests import default_mode

    cuda, cpu = SimpleNamespace(device="cuda:0"), SimpleNamespace(device=torch.device("cpu"))
    assert default_mode(cuda, "runner") == "exact"
    assert default_mode(cpu, "runner") == "eager"
    assert default_mode(cuda, "configs") == default_mode(cpu, "configs") == "graph"
    engine = Engine(_runner())
    assert engine.mode == "eager" and engine.runner is None
    walk = Engine(_runner(), decode_via="configs")
    assert walk.mode == "graph" and walk.config_runner is not None
