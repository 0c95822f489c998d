"""`stepgraph bench --serve` on the CPU: the metric math on hand-made timestamps with known
answers, the workload and arrival schedule (seeded, at the asked rate), the whole run through
``main`` (every metric in the JSON, the token counts, and tokens equal to ``Engine.generate``
of each prompt alone in a fresh engine), peers that fail reported as skipped, and every bad
flag refused by name, exit 2, before any work."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("matplotlib")

from stepgraph.bench import serve_metrics as sm  # noqa: E402
from stepgraph.bench import serve_peers, workload  # noqa: E402
from stepgraph.bench.serve_metrics import RequestTiming, StepRecord  # noqa: E402
from stepgraph.cli import main  # noqa: E402
from stepgraph.engine import Engine  # noqa: E402

SERVE = ["bench", "--serve", "--device", "cpu"]
SMALL = ["--num-requests", "8", "--input-len", "24", "--output-len", "6"]
STATS = ("mean", "std", "median", "p90", "p99")


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


# -- pure metrics ---------------------------------------------------------------------------


def test_percentile_interpolates_linearly_as_numpy():
    xs = [4.0, 1.0, 3.0, 2.0]  # unsorted on purpose
    assert sm.percentile(xs, 0) == 1.0 and sm.percentile(xs, 100) == 4.0
    assert sm.percentile(xs, 50) == 2.5
    assert sm.percentile(xs, 99) == pytest.approx(3.97)  # 1 + 3 * 0.99 = position 2.97
    assert sm.percentile(xs, 90) == pytest.approx(3.7)
    assert sm.percentile([7.0], 99) == 7.0
    assert sm.percentile([], 50) is None


def test_request_timing_ttft_tpot_itl_e2e():
    r = RequestTiming(arrival=1.0, input_len=10, token_times=[1.5, 1.7, 2.0, 2.6])
    assert r.ttft == pytest.approx(0.5)
    assert r.e2e == pytest.approx(1.6)
    assert r.tpot == pytest.approx((1.6 - 0.5) / 3)  # (latency - TTFT) / (tokens - 1)
    assert r.itls == pytest.approx([0.2, 0.3, 0.6])
    assert r.tpot == pytest.approx(sum(r.itls) / len(r.itls))


def test_one_token_request_has_no_tpot_and_is_left_out_of_it():
    one = RequestTiming(0.0, 4, [0.25])
    assert one.tpot is None and one.itls == []
    two = RequestTiming(0.0, 6, [0.1, 0.3])  # TPOT 0.2 s
    m = sm.serving_metrics([one, two], duration_s=0.5)
    assert m["mean_tpot_ms"] == pytest.approx(200.0) and m["p99_tpot_ms"] == pytest.approx(200.0)
    assert m["mean_ttft_ms"] == pytest.approx(175.0)  # TTFT counts both requests
    assert m["mean_itl_ms"] == pytest.approx(200.0)  # one gap in all
    alone = sm.serving_metrics([one], duration_s=0.25)
    assert all(alone[f"{s}_tpot_ms"] is None for s in STATS)  # none, not "0 ms"
    assert all(alone[f"{s}_itl_ms"] is None for s in STATS)


def test_serving_metrics_on_hand_made_requests():
    reqs = [
        RequestTiming(0.0, 100, [0.10, 0.12, 0.14, 0.16]),  # TTFT 100 ms, TPOT 20 ms
        RequestTiming(0.5, 300, [0.70, 0.74, 0.78, 0.82]),  # TTFT 200 ms, TPOT 40 ms
    ]
    m = sm.serving_metrics(reqs, duration_s=0.82)
    assert m["completed"] == 2 and m["duration"] == 0.82
    assert m["total_input_tokens"] == 400 and m["total_output_tokens"] == 8
    assert m["request_throughput"] == pytest.approx(2 / 0.82)
    assert m["output_throughput"] == pytest.approx(8 / 0.82)
    assert m["total_token_throughput"] == pytest.approx(408 / 0.82)
    assert m["mean_ttft_ms"] == pytest.approx(150) and m["median_ttft_ms"] == pytest.approx(150)
    assert m["std_ttft_ms"] == pytest.approx(50)
    assert m["p99_ttft_ms"] == pytest.approx(199)
    assert m["mean_tpot_ms"] == pytest.approx(30)
    assert m["median_itl_ms"] == pytest.approx(30)  # three gaps of 20 ms, three of 40 ms
    assert m["mean_e2el_ms"] == pytest.approx((160 + 320) / 2)


def test_batch_sizes_used_and_decode_step_time():
    steps = [
        StepRecord(0.1, 0.100, first_tokens=4, decode_tokens=0, decode_only=False),
        StepRecord(0.2, 0.002, 0, 4, True),
        StepRecord(0.3, 0.004, 0, 4, True),
        StepRecord(0.4, 0.050, 1, 4, False),  # a prefill finished here: not steady decode
        StepRecord(0.5, 0.003, 0, 5, True),
        StepRecord(0.6, 0.001, 0, 2, True),
    ]
    assert sm.used_batch_sizes(steps) == [2, 4, 5]  # smallest, lower median, largest
    assert sm.decode_step_ms(steps, 4) == (pytest.approx(3.0), 2)
    assert sm.decode_step_ms(steps, 3) == (None, 0)
    assert sm.used_batch_sizes(steps[:1]) == []


# -- workload and arrivals ------------------------------------------------------------------


def test_default_lengths_are_the_headline_workload():
    assert sm.length_bounds(576, 7 / 9) == (128, 1024)  # prompts 128-1024
    assert sm.length_bounds(1024, 0.0) == (1024, 1024)
    assert sm.length_bounds(10, 0.5) == (5, 15)
    prompts = sm.random_prompts(64, 576, 7 / 9, vocab_size=1000, seed=3)
    assert all(128 <= len(p) <= 1024 for p in prompts)
    assert all(0 <= t < 1000 for p in prompts for t in p)
    assert prompts == sm.random_prompts(64, 576, 7 / 9, 1000, seed=3)
    assert prompts != sm.random_prompts(64, 576, 7 / 9, 1000, seed=4)
    assert len({len(p) for p in prompts}) > 30  # lengths spread, not one value


def test_arrivals_seeded_and_at_the_asked_rate():
    assert sm.arrival_times(5, float("inf"), seed=0) == [0.0] * 5
    a = sm.arrival_times(200, 50.0, seed=1)
    assert a == sm.arrival_times(200, 50.0, seed=1)
    assert a != sm.arrival_times(200, 50.0, seed=2)
    assert all(x <= y for x, y in zip(a, a[1:])) and a[0] > 0
    assert a[-1] == pytest.approx(200 / 50.0)  # rescaled: exactly n / rate
    gaps = [y - x for x, y in zip([0.0, *a], a)]
    cv = (sum((g - 0.02) ** 2 for g in gaps) / len(gaps)) ** 0.5 / 0.02
    assert 0.7 < cv < 1.3  # exponential gaps: standard deviation ~ mean
    assert sm.arrival_times(200, 100.0, seed=1)[-1] == pytest.approx(2.0)


# -- the whole run --------------------------------------------------------------------------


def _fresh_engine_outputs(prompts, output_len, quantization=None):
    mr = workload.build_model_runner("tiny", "cpu", torch.float32, 1, 64, quantization=quantization)
    engine = Engine(mr, mode="eager")
    try:
        return [engine.generate([p], output_len, ignore_eos=True)[0] for p in prompts]
    finally:
        engine.shutdown()


def test_serve_end_to_end_json_tokens_and_plot(tmp_path, capsys):
    out, png = tmp_path / "serve.json", tmp_path / "serve.png"
    argv = [*SERVE, *SMALL, "--latency", "--json", str(out), "--plot", str(png)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    for word in ("TTFT", "TPOT", "ITL", "E2E", "requests in", "latency case", "graph replay"):
        assert word in text, word
    data = json.loads(out.read_text())
    m = data["metrics"]
    for key in (
        "completed",
        "duration",
        "request_throughput",
        "output_throughput",
        "total_token_throughput",
    ):
        assert m[key] > 0, key
    for name in ("ttft", "tpot", "itl", "e2el"):
        assert all(m[f"{s}_{name}_ms"] is not None for s in STATS), name
    assert m["median_ttft_ms"] <= m["p99_ttft_ms"] <= m["mean_e2el_ms"] * 2
    assert m["completed"] == 8 and m["total_output_tokens"] == 8 * 6
    reqs = data["requests"]
    prompts = sm.random_prompts(8, 24, 7 / 9, 512, seed=0)  # tiny's vocabulary, --seed 0
    assert [r["input_len"] for r in reqs] == [len(p) for p in prompts]
    assert m["total_input_tokens"] == sum(map(len, prompts))
    assert all(r["output_len"] == 6 and len(r["tokens"]) == 6 for r in reqs)
    assert [r["tokens"] for r in reqs] == _fresh_engine_outputs(prompts, 6)  # real work
    assert len({t for r in reqs for t in r["tokens"]}) > 8  # not one token over and over
    steps = data["steps"]
    assert steps["steps"] >= 6 and steps["decode_only"] >= 1
    assert steps["engine_stats"]["decode_tokens"] == 8 * 5  # every token after the first
    decode = data["decode"]
    assert {d["source"] for d in decode} == {"workload", "latency case"}
    assert all(d["step_ms"] > 0 and d["how"] == "graph replay" for d in decode)
    assert any(d["e2e_ms"] and d["e2e_over_step"] > 0 for d in decode)
    lat = data["latency"]
    assert (lat["input_len"], lat["output_len"]) == (512, 256)
    assert lat["tpot_ms"] > 0 and lat["ms_per_output_token"] > 0
    assert data["peers"] == {} and data["workload"]["request_rate"] == "inf"
    assert data["meta"]["warmup_seconds"] > 0 and "untimed warm-up" in text
    assert data["meta"]["max_prefill_tokens_with_decode"] == 2048  # the engine's default
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000


def test_fp8_weights_serve_the_same_requests_beside_the_model_dtype(tmp_path, capsys, monkeypatch):
    """``--quantization fp8``: the workload on the model dtype, then on the same weights in FP8
    (a second model, quantized on load), each run's tokens those of a fresh engine over that
    model; one line compares them."""
    built = []
    build = workload.build_model_runner

    def recorded(*a, **k):
        built.append(k.get("quantization"))
        return build(*a, **k)

    monkeypatch.setattr(workload, "build_model_runner", recorded)
    out = tmp_path / "serve.json"
    assert main([*SERVE, *SMALL, "--quantization", "fp8", "--json", str(out)]) == 0
    captured = capsys.readouterr()
    text = captured.out
    assert built == [None, "fp8"]
    assert "(float32, FP8 weights, cpu)" in text and "FP8 weights: " in text.splitlines()[-2]
    # progress on stderr while each engine builds: the FP8 pass's cold compiles can take a minute
    assert captured.err.count("engine ready in ") == 2
    data = json.loads(out.read_text())
    q = data["quantized"]
    assert q["meta"]["weights"] == "fp8" and "weights" not in data["meta"]
    assert q["metrics"]["completed"] == 8 and q["metrics"]["total_output_tokens"] == 8 * 6
    prompts = sm.random_prompts(8, 24, 7 / 9, 512, seed=0)
    monkeypatch.setattr(workload, "build_model_runner", build)
    want8 = _fresh_engine_outputs(prompts, 6, "fp8")
    assert [r["tokens"] for r in q["requests"]] == want8
    assert [r["tokens"] for r in data["requests"]] == _fresh_engine_outputs(prompts, 6)
    assert [r["tokens"] for r in data["requests"]] != want8  # FP8 rounding moved some tokens


def test_poisson_arrivals_follow_the_schedule(tmp_path, capsys):
    out = tmp_path / "serve.json"
    argv = [*SERVE, *SMALL, "--request-rate", "200", "--seed", "5", "--modes", "eager"]
    assert main([*argv, "--max-running", "3", "--json", str(out)]) == 0
    assert "Poisson arrivals at 200 req/s" in capsys.readouterr().out
    data = json.loads(out.read_text())
    arrivals = [r["arrival_s"] for r in data["requests"]]
    assert arrivals == pytest.approx(sm.arrival_times(8, 200.0, seed=5), abs=1e-9)
    assert all(r["ttft_ms"] > 0 and r["output_len"] == 6 for r in data["requests"])
    assert data["metrics"]["duration"] >= arrivals[-1]  # the last one came at 8 / 200 s
    assert data["meta"]["engine_mode"] == "eager" and data["meta"]["max_running"] == 3


def test_engine_prefill_graph_serves_the_same_tokens(tmp_path):
    runs = {}
    for prefill in ("eager", "graph"):
        out = tmp_path / f"{prefill}.json"
        argv = [*SERVE, *SMALL, "--modes", "graph", "--engine-prefill", prefill]
        assert main([*argv, "--json", str(out)]) == 0
        runs[prefill] = json.loads(out.read_text())
        assert runs[prefill]["meta"]["engine_prefill"] == prefill
    want = [r["tokens"] for r in runs["eager"]["requests"]]
    assert [r["tokens"] for r in runs["graph"]["requests"]] == want  # float32 on the CPU
    assert all(len(t) == 6 for t in want)


def _fake_cb_model(prompts_seen):
    def generate_batch(prompts, config, record_timestamps=False, progress_bar=True):
        prompts_seen.append(list(prompts))
        n, t = config.max_new_tokens, 100.0
        return {
            f"req_{i}": SimpleNamespace(
                generated_tokens=[1] * n,
                error=None,
                created_time=t,
                timestamps=[t + 0.01 * (k + 1) for k in range(n)] if record_timestamps else None,
            )
            for i in range(len(prompts))
        }

    return SimpleNamespace(generate_batch=generate_batch)


def test_peer_hf_cb_figures_from_its_timestamps(tmp_path, capsys, monkeypatch):
    seen: list = []
    monkeypatch.setattr(serve_peers, "build_hf_model", lambda mr: _fake_cb_model(seen))
    out = tmp_path / "serve.json"
    assert main([*SERVE, *SMALL, "--peers", "hf-cb", "--json", str(out)]) == 0
    assert "peer hf-cb (generate_batch" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert len(seen) == 2 and len(seen[1]) == 8  # a warm-up call, then the same 8 prompts
    assert [len(p) for p in seen[1]] == [r["input_len"] for r in data["requests"]]
    p = data["peers"]["hf-cb"]
    assert p["seconds"] > 0 and p["speedup_wall"] > 0 and p["tokens_equal_ours"] >= 0
    assert p["serving_seconds"] == pytest.approx(0.06)  # 6 tokens 10 ms apart
    assert p["metrics"]["median_ttft_ms"] == pytest.approx(10.0)
    assert p["metrics"]["median_tpot_ms"] == pytest.approx(10.0)
    assert data["latency"] is not None  # a peer ran: the latency case ran too


def test_a_failing_peer_is_reported_skipped_not_fatal(tmp_path, capsys, monkeypatch):
    def broken(mr):
        raise RuntimeError("weights went missing")

    monkeypatch.setattr(serve_peers, "build_hf_model", broken)
    out = tmp_path / "serve.json"
    argv = [*SERVE, *SMALL, "--peers", "hf-cb", "--json", str(out)]
    assert main(argv) == 0
    assert "peer hf-cb: skipped (RuntimeError: weights went missing)" in capsys.readouterr().out
    assert json.loads(out.read_text())["peers"]["hf-cb"] == {
        "skipped": "RuntimeError: weights went missing"
    }


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--num-requests", "0"], "--num-requests"),
        (["--range-ratio", "1.5"], "--range-ratio"),
        (["--range-ratio", "-0.1"], "--range-ratio"),
        (["--request-rate", "-1"], "--request-rate"),
        (["--request-rate", "0"], "--request-rate"),
        (["--input-len", "0"], "--input-len"),
        (["--output-len", "0"], "--output-len"),
        (["--input-len", "1500"], "--input-len"),  # up to 2667 + 128 > tiny's 2048 positions
        (["--output-len", "3000"], "--output-len"),
        (["--max-running", "0"], "--max-running"),
        (["--max-prefill-tokens-with-decode", "-1"], "--max-prefill-tokens-with-decode"),
        (["--peers", "vllm"], "--peers"),
        (["--peers", "hf-static-compile"], "--peers"),  # CUDA syncs: not on the CPU
        (["--modes", "exact"], "--modes"),
        (["--batch-sizes", "1,2"], "--batch-sizes"),
        (["--prefill"], "--prefill"),
        (["--engine-prefill", "cuda"], "--engine-prefill"),
        (["--quantization", "fp8", "--workload", "multi-turn"], "--quantization"),
        (["--quantization", "int4"], "--quantization"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag_before_any_work(flags, named, capsys, monkeypatch):
    def no_work(*a, **k):
        raise AssertionError("a model was built before the flags were checked")

    monkeypatch.setattr(workload, "build_model_runner", no_work)
    assert main([*SERVE, *flags]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.startswith("stepgraph: error: ") and named in err and "\n" not in err, err
    assert captured.out == ""
