"""Refusals on the command line, every case through ``main([...])``. A bad argument is refused
before any work, as one line on stderr, ``stepgraph: error: ...``, naming the flag, with exit
status 2; limits are tested at the limit and one past it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from stepgraph.cli import main
from stepgraph.model import kv_cache

from .guards import time_limit

pytest.importorskip("matplotlib")

REPO = Path(__file__).resolve().parents[1]

BENCH = ["bench", "--device", "cpu"]
GEN = ["generate", "--model", "tiny", "--device", "cpu", "--max-new-tokens", "2"]
CHECK = ["check", "--model", "tiny", "--device", "cpu"]


def _assert_fails(capsys, argv, *needles, absent=()):
    """``main(argv)`` exits 2 with one ``stepgraph: error:`` line on stderr and nothing on
    stdout (nothing ran), naming every needle; returns the line."""
    with time_limit(30):
        assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("stepgraph: error: "), lines[0]
    assert captured.out == "", captured.out
    for n in needles:
        assert n in lines[0], (n, lines[0])
    for n in absent:
        assert n not in lines[0], (n, lines[0])
    return lines[0]


@pytest.fixture
def one_thread(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    yield
    torch.set_num_threads(before)


# -- the tokens check of the CPU bench never has an empty prompt -----------------------------------


@pytest.mark.parametrize("sizes,contexts", [("16", "16"), ("1,2", "1")])
def test_cpu_bench_runs_where_a_prompt_was_empty(tmp_path, capsys, one_thread, sizes, contexts):
    out = tmp_path / "rows.json"
    argv = [*BENCH, "--batch-sizes", sizes, "--contexts", contexts, "--iters", "1"]
    with time_limit(60):
        assert main([*argv, "--json", str(out)]) == 0
    assert "graph tokens identical to eager: True" in capsys.readouterr().out
    assert json.loads(out.read_text())["meta"]["tokens_match"] is True


# -- --tp without torchrun -------------------------------------------------------------------------


@pytest.mark.parametrize("argv", [[*BENCH, "--tp", "2"], [*GEN, "--prompt-ids", "1", "--tp", "2"]])
def test_tp_without_torchrun_says_how_to_launch(capsys, monkeypatch, argv):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    _assert_fails(
        capsys, argv, "--tp", "torchrun --nproc-per-node 2 -m stepgraph", f"{argv[0]} --tp 2"
    )


def test_tp_under_a_torchrun_of_another_size(capsys, monkeypatch):
    env = {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    for k, v in {**env, "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(k, v)
    _assert_fails(capsys, [*BENCH, "--tp", "2"], "--tp", "started 4 processes", "--tp 4")


def test_cpu_bench_under_torchrun_prints_once_with_the_all_reduce(tmp_path):
    out = tmp_path / "tp.json"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "stepgraph",
        *BENCH,
        "--tp",
        "2",
        "--batch-sizes",
        "1,2",
        "--contexts",
        "16",
        "--iters",
        "2",
        "--json",
        str(out),
    ]
    run = subprocess.run(
        cmd, env=env, capture_output=True, text=True, timeout=240, cwd=REPO, start_new_session=True
    )
    # Known, not ours: about one torchrun-on-the-CPU exit in ten aborts in C++ teardown after
    # destroy_process_group ("terminate called without an active exception"; tests/
    # test_cli_tp.py's generate shows it too, at HEAD). Everything below is checked either way.
    teardown = "terminate called without an active exception" in run.stderr
    assert run.returncode == 0 or teardown, run.stdout[-3000:] + run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert sum(line.startswith("mode ") for line in lines) == 1  # one table: rank 0's
    rows = [line.split()[:3] for line in lines if line.split()[:1] in (["eager"], ["graph"])]
    rows = [r for r in rows if r[1].isdigit()]  # table rows, not the EXPLAIN line
    assert sorted(rows) == [[m, bs, "16"] for m in ("eager", "graph") for bs in ("1", "2")]
    assert sum("all-reduce time per step" in line for line in lines) == 1
    meta = json.loads(out.read_text())["meta"]
    assert meta["tp"] == 2 and set(meta["allreduce_us_per_step"]) == {"1", "2"}
    assert meta["tokens_match"] is True


# -- one line, never a traceback -------------------------------------------------------------------


def test_prompt_text_with_a_directory_without_tokenizer(capsys, tmp_path):
    pytest.importorskip("transformers")
    from stepgraph.model.config import get_preset

    c = get_preset("tiny")
    hf = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "vocab_size": c.vocab_size,
        "max_position_embeddings": 256,
    }
    (tmp_path / "config.json").write_text(json.dumps(hf))
    argv = ["generate", "--device", "cpu", "--model", str(tmp_path), "--prompt", "hello"]
    _assert_fails(capsys, argv, "--prompt", "tokenizer", str(tmp_path), "--prompt-ids")


@pytest.mark.parametrize("threads", ["0", "-1"])
def test_bench_threads_below_one(capsys, threads):
    _assert_fails(capsys, [*BENCH, "--threads", threads], "--threads", ">= 1")


@pytest.mark.parametrize("iters", ["0", "-3"])
def test_bench_iters_below_one(capsys, iters):
    _assert_fails(capsys, [*BENCH, "--iters", iters], "--iters", ">= 1")


@pytest.mark.parametrize("context", ["2049", "1000000000"])
def test_bench_context_past_the_model_positions(capsys, context):
    _assert_fails(
        capsys, [*BENCH, "--contexts", context], "--contexts", "max_position_embeddings=2048"
    )


def test_bench_context_at_the_model_positions_runs(capsys, one_thread):
    argv = [*BENCH, "--batch-sizes", "1", "--contexts", "2048", "--iters", "1"]
    with time_limit(60):
        assert main(argv) == 0  # both modes: the tokens check's prompt leaves room for 8 tokens
    assert "graph tokens identical to eager: True" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["out.txt", "out", "out.json"])
def test_bench_plot_that_is_no_image_is_refused_before_the_run(capsys, tmp_path, name):
    _assert_fails(capsys, [*BENCH, "--plot", str(tmp_path / name)], "--plot", ".png")


@pytest.mark.parametrize("seed", [str(2**64), str(2**70), "1180591620717411303424", "-1"])
def test_generate_seed_outside_64_bits(capsys, seed):
    _assert_fails(
        capsys, [*GEN, "--prompt-ids", "1,2", "--seed", seed, "--temperature", "1"], "--seed"
    )


def test_generate_largest_seed_runs(capsys):
    argv = [*GEN, "--prompt-ids", "1,2", "--seed", str(2**64 - 1), "--temperature", "1", "--json"]
    assert main([*argv, "--mode", "eager"]) == 0
    assert len(json.loads(capsys.readouterr().out)["outputs"][0]) == 2


def test_check_seed_outside_64_bits(capsys):
    _assert_fails(capsys, [*CHECK, "--seed", str(2**64)], "--seed")


# -- what cannot fit is refused up front, with the memory it needs ---------------------------------


def test_bench_batch_that_cannot_fit_names_the_memory(capsys):
    huge = ["--model", "llama-3.1-8b", "--batch-sizes", "256", "--contexts", "100000"]  # TiBs
    line = _assert_fails(capsys, [*BENCH, *huge], "--batch-sizes", "GiB")
    assert "KV cache" in line and "free on cpu" in line


def test_bench_memory_is_checked_against_free_memory(capsys, monkeypatch):
    monkeypatch.setattr(kv_cache, "free_bytes", lambda device: 2**16)  # 64 KiB free
    _assert_fails(
        capsys, [*BENCH, "--batch-sizes", "1,2"], "--batch-sizes", "0.00 GiB is free on cpu"
    )


def test_cpu_bench_says_how_long_a_slow_point_takes(capsys, monkeypatch, one_thread):
    from stepgraph.bench import cpu

    monkeypatch.setattr(cpu, "SLOW_STEP_S", 0.0)  # every step is "slow"
    argv = [*BENCH, "--batch-sizes", "1", "--contexts", "8", "--modes", "eager", "--iters", "3"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "eager bs=1 ctx=8:" in captured.err and "4 more steps for this point" in captured.err
    assert "s a step" not in captured.out  # the table on stdout stays the table


def test_cpu_bench_fast_points_are_quiet(capsys, one_thread):
    argv = [*BENCH, "--batch-sizes", "1", "--contexts", "8", "--modes", "eager", "--iters", "1"]
    assert main(argv) == 0
    assert capsys.readouterr().err == ""


# -- every argument checked before any work --------------------------------------------------------


@pytest.mark.parametrize("flag", ["--json", "--plot"])
def test_bench_output_that_is_a_directory(capsys, tmp_path, flag):
    _assert_fails(capsys, [*BENCH, flag, str(tmp_path)], flag, "is a directory")


def test_check_exact_on_the_cpu_is_refused_before_it_runs(capsys):
    _assert_fails(capsys, [*CHECK, "--modes", "exact"], "--modes", "exact", "eager,graph,walk")


@pytest.mark.parametrize("context", ["1", "23"])
def test_check_context_too_short_for_any_mix(capsys, context):
    _assert_fails(capsys, [*CHECK, "--context", context], "--context", "24 or more")


@pytest.mark.parametrize("context", ["2049", "10000000"])
def test_check_context_past_the_model_positions(capsys, context):
    _assert_fails(
        capsys, [*CHECK, "--context", context], "--context", "max_position_embeddings=2048"
    )


def test_check_shortest_context_runs(capsys):
    with time_limit(60):
        assert main([*CHECK, "--context", "24", "--trials", "2", "--max-bs", "2"]) == 0
    out = capsys.readouterr().out
    assert "error" not in out and out.strip().endswith("OK")


# -- each message names the problem it is about ----------------------------------------------------


@pytest.mark.parametrize(
    "modes,needles", [("foo", ["unknown foo"]), ("", ["names no mode"]), (",", ["names no mode"])]
)
@pytest.mark.parametrize("command", [BENCH, CHECK])
def test_unknown_or_empty_modes_are_not_called_a_cuda_problem(capsys, command, modes, needles):
    _assert_fails(capsys, [*command, f"--modes={modes}"], "--modes", *needles, absent=("CUDA",))


@pytest.mark.parametrize("flag", ["--prompt-ids", "--stop-ids"])
def test_negative_ids_reach_the_id_check(capsys, flag):
    argv = [*GEN, "--prompt-ids", "1,2"] if flag == "--stop-ids" else [*GEN]
    _assert_fails(capsys, [*argv, flag, "-1,2"], "[-1]", absent=("expected one argument",))


def _hf_config(tmp_path, **changes):
    from stepgraph.model.config import get_preset

    c = get_preset("tiny")
    hf = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "vocab_size": c.vocab_size,
        "max_position_embeddings": 256,
    }
    hf.update(changes)
    hf = {k: v for k, v in hf.items() if v is not None}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    return [*GEN, "--prompt-ids", "1", "--model", str(tmp_path)]


HINT = "is it the checkpoint's own config.json"


def test_unsupported_architecture_is_not_blamed_on_the_file(capsys, tmp_path):
    argv = _hf_config(tmp_path, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    _assert_fails(capsys, argv, "config.json", "unsupported architecture", "GPT2", absent=(HINT,))


def test_unsupported_rope_is_not_blamed_on_the_file(capsys, tmp_path):
    argv = _hf_config(tmp_path, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    _assert_fails(capsys, argv, "config.json", "'yarn' is not supported", absent=(HINT,))


def test_missing_field_still_asks_about_the_file(capsys, tmp_path):
    _assert_fails(capsys, _hf_config(tmp_path, hidden_size=None), "'hidden_size'", HINT)


# -- stepgraph buckets: the sizes seen, and padding as a percentage over ---------------------------


def test_buckets_say_the_sizes_seen_and_padding_over(capsys, tmp_path):
    trace = tmp_path / "trace.txt"
    trace.write_text("7\n10\n12\n7\n7\n")
    assert main(["buckets", "--trace", str(trace), "--max-graphs", "3"]) == 0
    out = capsys.readouterr().out
    assert "1..12" not in out and "batch sizes seen: 7, 10, 12" in out
    assert "padding waste: 0.0% extra rows" in out and "1.000 (" not in out
    assert main(["buckets", "--trace", str(trace), "--max-graphs", "2"]) == 0
    # buckets 7, 12: the 10 pads to 12, 2 rows over 10 + 7 * 3 + 12 = 43 real ones
    assert f"padding waste: {2 / 43 * 100:.1f}% extra rows" in capsys.readouterr().out


def test_buckets_trace_with_a_bool_is_refused(capsys, tmp_path):
    trace = tmp_path / "trace.json"
    trace.write_text("[1, true, 3]")
    _assert_fails(capsys, ["buckets", "--trace", str(trace), "--max-graphs", "2"], "item 1", "True")


# -- --kernels fused on the CPU says what runs there -----------------------------------------------


def test_generate_kernels_fused_on_the_cpu_says_reference(capsys):
    assert main([*GEN, "--prompt-ids", "1,2", "--kernels", "fused", "--json"]) == 0
    captured = capsys.readouterr()
    assert "reference kernels" in captured.err and "stepgraph: note:" in captured.err
    assert json.loads(captured.out)["outputs"]  # stdout stays the JSON


def test_bench_kernels_fused_on_the_cpu_says_reference(capsys, one_thread):
    argv = [*BENCH, "--kernels", "fused", "--batch-sizes", "1", "--contexts", "8"]
    assert main([*argv, "--modes", "eager", "--iters", "1"]) == 0
    assert "reference kernels" in capsys.readouterr().out


# -- a prompt file with true/false -----------------------------------------------------------------


@pytest.mark.parametrize("text", ["[[1, true, 3]]", "[1, false]\n", "[[true]]"])
def test_prompt_file_with_booleans_is_refused(capsys, tmp_path, text):
    path = tmp_path / "prompts.json"
    path.write_text(text)
    _assert_fails(capsys, [*GEN, "--prompt-file", str(path)], str(path), "not a list of token ids")


# -- docs: --help says the defaults ----------------------------------------------------------------


@pytest.mark.parametrize(
    "command,needles",
    [
        (
            "bench",
            ["(default: 10)", "(default: small)", "(default: cuda when a GPU", "(default: 1)"],
        ),
        ("generate", ["(default: 16)", "(default: tiny)", "(default: graph)", "(default: 0.0)"]),
        ("check", ["(default: 20)", "(default: 8)", "(default: 0)"]),
    ],
)
def test_help_shows_the_defaults(capsys, command, needles):
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for n in needles:
        assert n in out, n
    assert "(default: None)" not in out and "(default: False)" not in out
