"""The public API in Python: the names users import, the model
runner checked against the protocol by name, configs that refuse floats and bools, what the
bench needs counted before it builds anything, the plot a person reads, and the docs' facts.
(The command-line cases are in ``test_cli_refusals.py``.)"""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import pytest
import torch

from stepgraph.errors import ConfigError, ReplayError

from .guards import time_limit

ROOT = Path(__file__).resolve().parents[1]


# -- 10. the names users need, from the top-level package -------------------------------------


def test_top_level_exports_engine_model_runner_and_presets():
    import stepgraph
    from stepgraph import PRESETS, Engine, ModelRunner, get_preset
    from stepgraph.engine import Engine as EngineHere
    from stepgraph.model import ModelRunner as ModelRunnerHere

    assert Engine is EngineHere and ModelRunner is ModelRunnerHere
    assert {"tiny", "tiny-qwen2", "llama-3.2-1b"} <= set(PRESETS)
    assert get_preset("tiny") is PRESETS["tiny"]
    assert {"Engine", "ModelRunner", "PRESETS", "get_preset"} <= set(stepgraph.__all__)


# -- 11. the model runner against the protocol; batches and configs by type -------------------


def _toy():
    from stepgraph.toy_model import ToyModelRunner

    return ToyModelRunner(num_pages=40, device="cpu", seed=1)


def test_runner_of_an_object_names_every_missing_attribute():
    from stepgraph import CudaGraphRunner

    with pytest.raises(ConfigError) as err:
        CudaGraphRunner(object())
    for name in ("forward()", "device", "dtype", "attn_backend", "max_pages_per_request"):
        assert name in str(err.value), name
    assert "ModelRunnerLike" in str(err.value) and "toy_model.py" in str(err.value)


def test_runner_names_the_missing_attention_hook():
    from stepgraph import CudaGraphRunner, RunnerConfig

    mr = _toy()
    real = mr.attn_backend

    class Backend:  # the toy's backend without its replay hook
        def __getattr__(self, name):
            if name == "init_forward_metadata_replay_cuda_graph":
                raise AttributeError(name)
            return getattr(real, name)

    mr.attn_backend = Backend()
    with pytest.raises(ConfigError, match=r"attn_backend\.init_forward_metadata_replay_cuda_graph"):
        CudaGraphRunner(mr, RunnerConfig(max_bs=2, show_progress=False))


@pytest.mark.parametrize("call", ["replay", "can_run"])
@pytest.mark.parametrize("batch", ["x", None, 3])
def test_replay_of_what_is_no_batch_names_its_type(call, batch):
    from stepgraph import CudaGraphRunner, RunnerConfig

    runner = CudaGraphRunner(_toy(), RunnerConfig(max_bs=2, show_progress=False))
    with pytest.raises(
        ReplayError, match=rf"{call}\(\) takes a ForwardBatch, got {type(batch).__name__}"
    ):
        getattr(runner, call)(batch)
    assert runner.stats.replays == 0
    runner.shutdown()


@pytest.mark.parametrize(
    "field,value",
    [
        ("max_bs", 4.5),
        ("max_bs", True),
        ("max_bs", "4"),
        ("max_bs", 4.0),
        ("warmup_iters", True),
        ("warmup_iters", 2.0),
        ("torch_compile_max_bs", 1.5),
    ],
)
def test_runner_config_ints_refuse_floats_strings_and_bools(field, value):
    from stepgraph import RunnerConfig

    with pytest.raises(ConfigError, match=rf"{field} must be an int, got {re.escape(repr(value))}"):
        RunnerConfig(**{field: value})


def test_runner_config_smallest_ints_are_accepted_and_zero_is_not():
    from stepgraph import RunnerConfig

    assert RunnerConfig(max_bs=1).buckets() == [1]
    assert RunnerConfig(warmup_iters=1).warmup_iters == 1
    with pytest.raises(ConfigError, match="max_bs must be >= 1"):
        RunnerConfig(max_bs=0)
    with pytest.raises(ConfigError, match="warmup_iters must be >= 1"):
        RunnerConfig(warmup_iters=0)


@pytest.mark.parametrize(
    "field", ["enable_torch_compile", "warmup_until_settled", "show_progress", "freeze_gc"]
)
@pytest.mark.parametrize("value", [1, "yes", None])
def test_runner_config_flags_refuse_what_is_not_a_bool(field, value):
    from stepgraph import RunnerConfig

    with pytest.raises(ConfigError, match=rf"{field} must be True or False, got {value!r}"):
        RunnerConfig(**{field: value})


def test_torch_compile_max_bs_zero_compiles_nothing_and_one_below_is_refused():
    from stepgraph import RunnerConfig

    assert RunnerConfig(enable_torch_compile=True, torch_compile_max_bs=0).compile_buckets() == []
    with pytest.raises(ConfigError, match=r"torch_compile_max_bs must be >= 0"):
        RunnerConfig(torch_compile_max_bs=-1)


@pytest.mark.parametrize("sizes", [(True,), (1, True), (False, 2)])
def test_capture_sizes_refuse_bools(sizes):
    from stepgraph import RunnerConfig

    with pytest.raises(ConfigError, match="capture_bs must hold positive ints"):
        RunnerConfig(capture_bs=sizes)


def test_prompt_text_with_booleans_is_refused():
    from stepgraph.prompts import parse_prompt_text

    for text in ("[[1, true]]", "[false]\n", "[[2], [true]]"):
        with pytest.raises(ConfigError, match="not a list of token ids"):
            parse_prompt_text(text)


def test_trace_with_a_bool_is_refused():
    from stepgraph.bucket_plan import read_trace

    with pytest.raises(ConfigError, match=r"\('item 0', True\)"):
        read_trace("[true, 2]")
    assert read_trace("[1, 2]") == {1: 1, 2: 1}


# -- 4. pages freed in O(log n) --------------------------------------------------------------------


def test_releasing_100000_requests_takes_no_minutes():
    from stepgraph.model.kv_cache import PageAllocator

    alloc = PageAllocator(100_001)
    pages = [alloc.allocate(1) for _ in range(100_000)]
    with time_limit(10):  # a sort of every free page per release: minutes
        for p in pages:
            alloc.free(p)
    assert alloc.num_free == 100_000


def test_allocator_still_hands_out_the_lowest_free_pages_first():
    from stepgraph.model.kv_cache import PageAllocator

    alloc = PageAllocator(10)
    assert alloc.allocate(3) == [1, 2, 3] and alloc.allocate(2) == [4, 5]
    alloc.free([5, 2])
    alloc.free([3])
    assert alloc.allocate(4) == [2, 3, 5, 6]
    with pytest.raises(ConfigError, match="not allocated"):
        alloc.free([9])


# -- 4. the bench's memory, counted before it builds -----------------------------------------------


def test_param_count_equals_the_built_model_for_every_preset():
    from stepgraph.bench.workload import param_count
    from stepgraph.model import PRESETS
    from stepgraph.model.llama import LlamaModel

    for name, config in PRESETS.items():
        for tied in (True, False):
            c = dataclasses.replace(config, tie_word_embeddings=tied)
            with torch.device("meta"):
                model = LlamaModel(c, max_positions=16)
            assert param_count(c) == sum(p.numel() for p in model.parameters()), (name, tied)


def test_bench_bytes_counts_the_kv_cache_the_bench_allocates():
    from stepgraph.bench.workload import bench_bytes, build_model_runner

    mr = build_model_runner("tiny", "cpu", torch.float32, max_bs=3, max_context=100)
    parts = bench_bytes(mr.config, torch.float32, 3, 100)
    kv = sum(t.numel() * t.element_size() for t in (*mr.kv_cache.k_caches, *mr.kv_cache.v_caches))
    assert parts["KV cache"] == kv
    assert parts["weights"] == sum(p.numel() * p.element_size() for p in mr.model.parameters())
    assert parts["logits"] == 2 * 3 * mr.config.vocab_size * 4


def test_bench_memory_is_refused_one_byte_past_the_free_memory(monkeypatch):
    from stepgraph.bench.args import check_bench_memory
    from stepgraph.cli_args import UsageError
    from stepgraph.model import kv_cache

    parts = {"KV cache": 3 * 2**30, "weights": 2**30, "logits": 5}
    need = sum(parts.values())
    args = argparse.Namespace(device="cpu")
    monkeypatch.setattr(kv_cache, "free_bytes", lambda device: need)
    check_bench_memory(parts, args)  # exactly what is free: it fits
    monkeypatch.setattr(kv_cache, "free_bytes", lambda device: need - 1)
    with pytest.raises(UsageError, match=r"needs at least 4.00 GiB \(KV cache 3.00 GiB"):
        check_bench_memory(parts, args)
    check_bench_memory(parts, argparse.Namespace(device="cuda"), tp=2)  # a shard per GPU
    with pytest.raises(UsageError, match="lower --batch-sizes or --contexts"):
        check_bench_memory(parts, args, tp=2)  # the CPU's ranks share its memory


# -- 1. the CPU bench's tokens check -------------------------------------------------------------


def test_token_check_prompts_are_never_empty_and_leave_room_for_the_new_tokens():
    from stepgraph.bench.cpu import TOKEN_CHECK_NEW, token_check_prompts
    from stepgraph.model import get_preset

    c = get_preset("tiny")
    assert [len(p) for p in token_check_prompts([1, 2], 1, c)] == [1, 1]
    assert [len(p) for p in token_check_prompts([16, 15, 17], 16, c)] == [1, 1, 1]
    assert [len(p) for p in token_check_prompts([1, 2], 64, c)] == [63, 62]
    longest = c.max_position_embeddings - TOKEN_CHECK_NEW + 1  # the last new token is not fed
    assert [len(p) for p in token_check_prompts([1], 2048, c)] == [longest]
    assert all(0 < t < c.vocab_size for p in token_check_prompts([1, 3], 64, c) for t in p)


# -- 5. stepgraph check's arguments, at their limits ---------------------------------------------


@pytest.mark.parametrize("context,ok", [(23, False), (24, True), (2048, True), (2049, False)])
def test_check_context_limits(context, ok):
    from stepgraph.check import check_args
    from stepgraph.cli_args import UsageError
    from stepgraph.model import get_preset

    args = argparse.Namespace(modes=None, context=context, model="tiny")
    if ok:
        assert check_args(args, "cpu", get_preset("tiny")) == (["eager", "graph", "walk"], context)
    else:
        with pytest.raises(UsageError, match="--context"):
            check_args(args, "cpu", get_preset("tiny"))


# -- 8. stepgraph check: which column the rule is about ------------------------------------------


def test_check_report_says_the_rule_is_about_differing_mixes(capsys):
    from stepgraph.check import ModeResult, report

    logits = [torch.zeros(1, 4)]
    eager = ModeResult(outputs=[[[1, 2]]], first_logits=logits)
    graph = ModeResult(outputs=[[[1, 2]]], first_logits=[torch.full((1, 4), 3.58e-7)])
    assert report({"eager": eager, "graph": graph}, {"graph"}, 1) == 0
    out = capsys.readouterr().out
    (line,) = [x for x in out.splitlines() if x.startswith("graph ") and "0/1" in x]
    assert "3.58e-07" in line and "differ must be 0" in line and "(must be 0)" not in line


# -- 12. the plot a person reads ------------------------------------------------------------------


def _figure(monkeypatch, tmp_path, rows, **kw):
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from stepgraph.bench.report import plot

    saved = []
    real = Figure.savefig
    monkeypatch.setattr(
        Figure, "savefig", lambda fig, *a, **k: (saved.append(fig), real(fig, *a, **k))
    )
    plot(str(tmp_path / "p.png"), rows, **kw)
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
    (fig,) = saved
    return fig


def test_plot_has_linear_axes_labels_and_a_title_naming_device_and_model(monkeypatch, tmp_path):
    from stepgraph.bench.report import FLOOR_LABEL, Row

    modes = (("eager", 5.0), ("graph", 0.8), ("exact", 0.8), ("hf-eager", 15.0))
    contexts = (512, 4096, 32768)
    rows = [Row(m, bs, c, ms, None, None) for m, ms in modes for bs in (1, 8) for c in contexts]
    floor = {(bs, c): 0.6 for bs in (1, 8) for c in (512, 4096, 32768)}
    title = "stepgraph bench: llama-3.2-1b on NVIDIA H200, bfloat16"
    fig = _figure(monkeypatch, tmp_path, rows, title=title, floor_ms=floor)
    assert fig._suptitle.get_text() == title
    axes = [ax for ax in fig.axes]
    assert len(axes) == 2
    for ax in axes:
        assert ax.get_xscale() == "linear" and ax.get_yscale() == "linear"
        assert ax.get_ylim()[0] == 0
        assert [t.get_text() for t in ax.get_xticklabels()] == ["512", "4k", "32k"]
        styles = {line.get_label(): line.get_linestyle() for line in ax.get_lines()}
        assert styles["eager"] == "-" and styles["hf-eager"] == "--" and styles[FLOOR_LABEL] == ":"
    (legend,) = fig.legends
    labels = [t.get_text() for t in legend.get_texts()]
    assert labels == ["eager", "graph", "exact", "hf-eager", FLOOR_LABEL]


def test_cpu_plot_title_says_cpu_tiny_and_stand_in(monkeypatch, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from stepgraph.cli import main

    saved = []
    real = Figure.savefig
    monkeypatch.setattr(
        Figure, "savefig", lambda fig, *a, **k: (saved.append(fig), real(fig, *a, **k))
    )
    before = torch.get_num_threads()
    argv = ["bench", "--device", "cpu", "--batch-sizes", "1", "--contexts", "8,16", "--iters", "1"]
    assert main([*argv, "--plot", str(tmp_path / "cpu.png")]) == 0
    torch.set_num_threads(before)
    title = saved[0]._suptitle.get_text()
    assert "CPU" in title and "tiny" in title and "stand-in" in title
    assert all(ax.get_yscale() == "linear" for ax in saved[0].axes)


# -- docs ----------------------------------------------------------------------------------------


def test_readme_names_every_preset_and_where_the_cpu_torch_comes_from():
    from stepgraph.model import PRESETS

    readme = (ROOT / "README.md").read_text()
    for name in PRESETS:
        assert f"`{name}`" in readme, name
    assert "torch==2.13.0" in readme and "CUDA build" in readme and "cpu" in readme


def test_design_doc_speaks_to_a_reader_and_puts_graph_pool_in_its_module():
    design = (ROOT / "docs" / "design.md").read_text()
    for word in ("seeds/", "seed 00", "issue note", "issue 1"):
        assert word not in design, word
    assert "graph_pool.py" in design and "pymllm" in design and "cuda_graph_config" in design
    assert not re.search(r"backends\.py\s+GraphPool", design)


def test_results_doc_holds_current_figures_agreeing_with_the_readme():
    results = (ROOT / "docs" / "results.md").read_text()
    readme = (ROOT / "README.md").read_text()
    assert len(results.splitlines()) <= 300, "results.md: current figures only"
    assert "## History" not in results and "git log" in results, "the history lives in git"
    assert "4106 MiB" not in results  # a superseded pool size
    for figure in ("0.769", "1.149", "178 MiB"):
        assert figure in results and figure in readme, figure
    for section in re.split(r"^## ", results, flags=re.M)[1:]:
        if "|---" in section:  # every table with its date
            assert re.search(r"\b20\d\d-\d\d-\d\d\b", section), section.splitlines()[0]
