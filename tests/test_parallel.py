"""Tensor-parallel sharding on the CPU.

In-process (no collectives run while building a rank's model): layouts, the slices each rank
holds, KV-head replication and its log line, loading slices from a Hugging Face directory.
Over gloo in two spawned processes: prefill plus decode steps of the model sharded two ways give
the unsharded model's logits within 1e-5; a rank that raises is reported, never a hang.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import os
import sys
import tempfile
import time
import traceback
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from stepgraph.errors import ConfigError
from stepgraph.model.config import ModelConfig, get_preset
from stepgraph.model.distributed import init_distributed
from stepgraph.model.llama import LlamaModel, build_model, init_random
from stepgraph.model.model_runner import ModelRunner
from stepgraph.model.parallel import load_hf_shard, shard_model, tp_layout

TOL = 1e-5
WORLD = 2
MAX_CTX = 64
DECODE_STEPS = 4
SPAWN_TIMEOUT_S = 150  # a hung collective fails the test instead of CI
TINY = get_preset("tiny")
CASES: dict[str, ModelConfig] = {
    "tiny": TINY,  # GQA 4/2, tied head, llama3 rope
    "tiny-kv1": replace(TINY, num_kv_heads=1),  # 1 KV head < 2 ranks: replicated
    "tiny-qwen2": get_preset("tiny-qwen2"),  # qkv bias
    "untied-odd-vocab": replace(TINY, tie_word_embeddings=False, vocab_size=509),  # padded
}


def _model(config: ModelConfig, seed: int = 1) -> LlamaModel:
    return init_random(build_model(config, "cpu", torch.float32, max_positions=MAX_CTX), seed)


def _runner(model: LlamaModel) -> ModelRunner:
    return ModelRunner.from_model(
        model, device="cpu", dtype=torch.float32, max_bs=2, max_context_len=MAX_CTX
    )


# -- layouts and slices (in-process) -----------------------------------------------------------


def test_layout_splits_heads_intermediate_and_vocab():
    a, b = (tp_layout(TINY, r, WORLD) for r in range(WORLD))
    assert (a.q_heads, b.q_heads) == ((0, 2), (2, 4))
    assert (a.kv_heads, b.kv_heads) == ((0, 1), (1, 2))
    assert (a.inter, b.inter) == ((0, 64), (64, 128))
    assert (a.vocab, b.vocab) == ((0, 256), (256, 512))
    assert not a.replicated_kv
    odd = tp_layout(replace(TINY, vocab_size=509), 1, WORLD)
    assert odd.vocab == (255, 510)  # padded to 510: one zero row on the last rank


def test_layout_replicates_the_kv_head_each_rank_reads():
    cfg = replace(TINY, num_heads=8, num_kv_heads=2, head_dim=8)  # 4 query heads per KV head
    layouts = [tp_layout(cfg, r, 4) for r in range(4)]
    assert [lay.q_heads for lay in layouts] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert [lay.kv_heads for lay in layouts] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert all(lay.replicated_kv for lay in layouts)


@pytest.mark.parametrize(
    "cfg, world, what",
    [
        (TINY, 3, "num_heads=4"),
        (replace(TINY, intermediate_size=130), 4, "intermediate_size=130"),
        (replace(TINY, num_heads=6, num_kv_heads=3), 2, "num_kv_heads=3"),
        (TINY, 0, "rank"),
    ],
)
def test_layout_rejects_uneven_splits(cfg, world, what):
    with pytest.raises(ConfigError, match=what):
        tp_layout(cfg, 0, world)


@pytest.mark.parametrize("name", ["tiny", "tiny-qwen2"])
def test_each_rank_holds_its_rows_of_each_fused_part(name):
    cfg = CASES[name]
    full = _model(cfg)
    q, kv, inter, hd = cfg.q_size, cfg.kv_size, cfg.intermediate_size, cfg.head_dim
    for rank in range(WORLD):
        lay = tp_layout(cfg, rank, WORLD)
        tp = shard_model(full, rank, WORLD)
        qs, ks = slice(*(h * hd for h in lay.q_heads)), slice(*(h * hd for h in lay.kv_heads))
        fs, ts = full.layers[1], tp.layers[1]
        qkv = fs.self_attn.qkv_proj.weight
        want = torch.cat([qkv[:q][qs], qkv[q : q + kv][ks], qkv[q + kv :][ks]])
        assert torch.equal(ts.self_attn.qkv_proj.weight, want)
        if cfg.attention_bias:
            bias = fs.self_attn.qkv_proj.bias
            want = torch.cat([bias[:q][qs], bias[q : q + kv][ks], bias[q + kv :][ks]])
            assert torch.equal(ts.self_attn.qkv_proj.bias, want)
        gu, i0 = fs.mlp.gate_up_proj.weight, slice(*lay.inter)
        assert torch.equal(ts.mlp.gate_up_proj.weight, torch.cat([gu[:inter][i0], gu[inter:][i0]]))
        assert torch.equal(ts.self_attn.o_proj.weight, fs.self_attn.o_proj.weight[:, qs])
        assert torch.equal(ts.mlp.down_proj.weight, fs.mlp.down_proj.weight[:, i0])
        vs = slice(*lay.vocab)
        assert torch.equal(tp.embed_tokens.weight, full.embed_tokens.weight[vs])
        assert tp.lm_head.weight is tp.embed_tokens.weight  # tied: the head's slice is the same


def test_untied_odd_vocab_pads_the_last_rank_with_zero_rows():
    cfg = CASES["untied-odd-vocab"]
    full = _model(cfg)
    tp = shard_model(full, 1, WORLD)
    assert torch.equal(tp.lm_head.weight[:-1], full.lm_head.weight[255:])
    assert torch.equal(tp.lm_head.weight[-1], torch.zeros(cfg.hidden_size))
    assert tp.lm_head.weight is not tp.embed_tokens.weight


def test_kv_replication_is_logged_once(caplog):
    with caplog.at_level(logging.INFO, logger="stepgraph"):
        tp = shard_model(_model(CASES["tiny-kv1"]), 1, WORLD)
    lines = [r.getMessage() for r in caplog.records if "replicated" in r.getMessage()]
    assert len(lines) == 1 and "rank 1 keeps KV head 0" in lines[0]
    assert tp.config.num_kv_heads == 1 and tp.config.num_heads == 2


def test_world_size_one_is_the_unsharded_model():
    full = _model(TINY)
    ref, one = _runner(full), _runner(shard_model(full, 0, 1))
    prompt = [[5, 9, 3, 7, 1]]
    got = one.prefill(prompt, [one.kv_cache.reserve(8)])
    torch.testing.assert_close(got, ref.prefill(prompt, [ref.kv_cache.reserve(8)]))


def test_init_distributed_names_torchrun_when_env_is_missing(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ConfigError, match="torchrun"):
        init_distributed("gloo")


# -- a Hugging Face directory, written by hand -------------------------------------------------


def _save_hf(model: LlamaModel, path: Path) -> None:
    """``model`` as a two-file Qwen2 safetensors checkpoint (q/k/v, gate/up unfused)."""
    from safetensors.torch import save_file

    cfg = model.config
    q, kv, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    sizes = {"qkv_proj": [q, kv, kv], "gate_up_proj": [inter, inter]}
    names = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    tensors = {}
    for name, t in model.named_parameters():
        fused = next((f for f in names if f in name), None)
        parts = t.split(sizes[fused]) if fused else [t]
        for part, x in zip(names[fused] if fused else [None], parts):
            tensors["model." + (name.replace(fused, part) if fused else name)] = x.clone()
    keys = sorted(tensors)
    files = {"part-1.safetensors": keys[::2], "part-2.safetensors": keys[1::2]}
    for fname, ks in files.items():
        save_file({k: tensors[k] for k in ks}, str(path / fname))
    weight_map = {k: f for f, ks in files.items() for k in ks}
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    hf = dict(
        architectures=["Qwen2ForCausalLM"],
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta,
        tie_word_embeddings=cfg.tie_word_embeddings,
        max_position_embeddings=cfg.max_position_embeddings,
    )
    (path / "config.json").write_text(json.dumps(hf))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tp-hf")
    _save_hf(_model(CASES["tiny-qwen2"], seed=4), path)
    return path


def test_load_hf_shard_equals_shard_model(hf_dir):
    full = _model(CASES["tiny-qwen2"], seed=4)
    for rank in range(WORLD):
        got = dict(load_hf_shard(hf_dir, rank, WORLD, "cpu", torch.float32).named_parameters())
        want = dict(shard_model(full, rank, WORLD).named_parameters())
        assert got.keys() == want.keys()
        for name in want:
            assert torch.equal(got[name], want[name]), name


# -- two ranks over gloo -----------------------------------------------------------------------


def _rank_main(rank: int, rendezvous: str, err_dir: str, fn_name: str, *args) -> None:
    """Entry point of a spawned rank: join the group, run ``fn_name(rank, *args)``. An exception
    is written to ``err_dir/rank{rank}.err`` before it propagates, so the test reads each rank's
    own error whichever rank's death ``join`` happens to see first."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=rendezvous,
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=60),
    )
    try:
        if ":" in fn_name:  # "module:function", e.g. another test file's rank body
            module, _, name = fn_name.partition(":")
            fn = getattr(importlib.import_module(module), name)
        else:
            fn = globals()[fn_name]
        fn(rank, *args)
    except BaseException:
        Path(err_dir, f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()
    # Done: exit now. At interpreter exit gloo's threads sometimes abort the process (SIGABRT,
    # "terminate called without an active exception"; stepgraph.model.launch.exit_after_group).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_ranks(fn_name: str, *args, err_dir: str | None = None) -> None:
    """Run ``fn_name`` on ``WORLD`` spawned ranks. A rank's exception is re-raised here
    (``ProcessRaisedException``, its traceback included) and the other ranks are killed; past
    ``SPAWN_TIMEOUT_S`` every rank is killed and the test fails. The ranks meet through a file
    store in a fresh directory (no port to pick, so no check-then-use race with other jobs);
    each failing rank leaves its traceback in ``err_dir/rank{r}.err``."""
    with tempfile.TemporaryDirectory(prefix="stepgraph-tp-") as tmp:
        rendezvous = f"file://{Path(tmp, 'store')}"
        args = (rendezvous, err_dir or tmp, fn_name, *args)
        ctx = mp.spawn(_rank_main, args=args, nprocs=WORLD, join=False)
        deadline = time.monotonic() + SPAWN_TIMEOUT_S
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                pytest.fail(f"ranks still running after {SPAWN_TIMEOUT_S} s: a collective hung")


def _max_diff(ref: ModelRunner, tp: ModelRunner, vocab: int) -> float:
    """Prefill two random prompts, then greedy decode steps (tokens from ``ref`` fed to
    both): the largest |logit difference| over every step."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(vocab, (n,), generator=g).tolist() for n in (11, 6)]
    pages = {m: [m.kv_cache.reserve(len(p) + DECODE_STEPS) for p in prompts] for m in (ref, tp)}
    want, got = ref.prefill(prompts, pages[ref]), tp.prefill(prompts, pages[tp])
    diff = (want - got).abs().max().item()
    positions = [len(p) for p in prompts]
    for _ in range(DECODE_STEPS):
        tokens = want.argmax(-1).tolist()
        want, got = (m.forward(m.decode_batch(tokens, positions, pages[m])) for m in (ref, tp))
        diff = max(diff, (want - got).abs().max().item())
        positions = [p + 1 for p in positions]
    return diff


def _parity(rank: int, out: str, hf_dir: str) -> None:
    diffs = {}
    for name, cfg in CASES.items():
        full = _model(cfg)
        tp = _runner(shard_model(full, rank, WORLD))
        diffs[name] = _max_diff(_runner(full), tp, cfg.vocab_size)
    ref = ModelRunner.from_hf_dir(hf_dir, max_context_len=MAX_CTX, max_bs=2)
    tp = _runner(load_hf_shard(hf_dir, rank, WORLD, "cpu", torch.float32, max_positions=MAX_CTX))
    diffs["hf-dir"] = _max_diff(ref, tp, ref.config.vocab_size)
    Path(out, f"rank{rank}.json").write_text(json.dumps(diffs))


@pytest.fixture(scope="module")
def tp2_diffs(tmp_path_factory, hf_dir) -> dict[str, list[float]]:
    out = tmp_path_factory.mktemp("tp-out")
    spawn_ranks("_parity", str(out), str(hf_dir))
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    return {name: [d[name] for d in ranks] for name in ranks[0]}


@pytest.mark.parametrize("case", [*CASES, "hf-dir"])
def test_tp2_logits_equal_unsharded(tp2_diffs, case):
    assert max(tp2_diffs[case]) <= TOL, tp2_diffs[case]


def _fail_on_rank_1(rank: int) -> None:
    if rank == 1:
        raise RuntimeError("rank 1 fails on purpose")
    tp = _runner(shard_model(_model(TINY), rank, WORLD))
    tp.prefill([[1, 2, 3]], [tp.kv_cache.reserve(3)])  # blocks in the embedding's all_reduce


def test_a_failing_rank_is_reported_not_hung(tmp_path):
    start = time.monotonic()
    # join reports whichever rank's death it polls first: rank 1's planted error, or rank 0's
    # "connection closed" once rank 1 is gone; rank 1's own error is read from its file.
    with pytest.raises((mp.ProcessRaisedException, mp.ProcessExitedException)):
        spawn_ranks("_fail_on_rank_1", err_dir=str(tmp_path))
    assert time.monotonic() - start < SPAWN_TIMEOUT_S
    assert "RuntimeError: rank 1 fails on purpose" in (tmp_path / "rank1.err").read_text()


# -- the GPU tier's torchrun worker, smoke-run on the CPU ---------------------------------------


def test_tp_worker_runs_under_torchrun_on_the_cpu(tmp_path):
    """``tests/gpu/tp_worker.py`` with gloo and the CPU graph stand-in: TP=2 greedy tokens,
    eager and through the ``CudaGraphRunner``, equal TP=1's, with one capture order."""
    path = Path(__file__).parent / "gpu" / "tp_worker.py"
    spec = importlib.util.spec_from_file_location("tp_worker", path)
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    ranks = worker.launch(tmp_path, "--device", "cpu", "--tokens", "6", timeout_s=SPAWN_TIMEOUT_S)
    want = ranks[0]["tp1"]
    for r in ranks:
        assert r["errors"] == {}
        assert r["tp1"] == r["eager"] == r["graph"] == want
        assert r["capture_order"] == {"graph": [4, 2, 1]}
        assert r["graph_graph_steps"] == 5
