"""Stop tokens: a checkpoint saved with transformers stops where transformers' greedy
``generate`` stops (float32), from config.json alone or from generation_config.json, which wins;
``--stop-ids`` and ``ignore_eos``; a stopped request frees its pages at once."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("stepgraph.runner")

from stepgraph.cli import main  # noqa: E402
from stepgraph.engine import Engine  # noqa: E402
from stepgraph.model import ModelRunner  # noqa: E402

VOCAB, NEW = 256, 10
CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=0,
    tie_word_embeddings=False,
)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(21)
    return [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in (5, 12, 3, 8)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(directory of a random tiny Llama without eos, its full-length greedy continuations)."""
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).float().eval()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in hf.parameters():  # random everywhere, large enough to vary the argmax
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    path = tmp_path_factory.mktemp("llama")
    hf.save_pretrained(path, safe_serialization=True)
    full = [_hf_generate(hf, p) for p in _prompts()]
    assert all(len(f) == NEW for f in full)
    return path, full


def _hf_generate(hf, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False)
    return out[0, len(prompt) :].tolist()


def _pick_eos(full: list[list[int]]) -> int:
    """A token greedy decoding emits mid-way for prompt 0 but never for some other prompt,
    so that one request stops early while another runs its full length."""
    for tok in full[0][1 : NEW - 2]:
        if any(tok not in f for f in full[1:]):
            return tok
    raise AssertionError(f"no usable eos candidate in {full}")


def _cut(out: list[int], stops: set[int]) -> list[int]:
    """``out`` up to and including its first id in ``stops``."""
    for i, tok in enumerate(out):
        if tok in stops:
            return out[: i + 1]
    return out


def _write_eos(path, config_eos, generation_eos=None) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg["eos_token_id"] = config_eos
    (path / "config.json").write_text(json.dumps(cfg))
    gen = path / "generation_config.json"
    if generation_eos is None:
        gen.unlink(missing_ok=True)
    else:
        gen.write_text(json.dumps({"eos_token_id": generation_eos, "pad_token_id": 0}))


@pytest.mark.parametrize("source", ["config.json", "generation_config.json"])
def test_stops_where_transformers_stops(saved, source):
    path, full = saved
    eos = _pick_eos(full)
    if source == "config.json":
        _write_eos(path, eos)
    else:
        # config.json names an id that would stop prompt 1 at once; generation_config wins
        _write_eos(path, full[1][0], [eos, VOCAB - 1])
    hf = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    want = [_hf_generate(hf, p) for p in _prompts()]
    lengths = [len(w) for w in want]
    assert min(lengths) < NEW == max(lengths)  # the test sees both a stop and a full run

    mr = ModelRunner.from_hf_dir(path, "cpu", torch.float32, max_bs=4, max_context_len=64)
    engine = Engine(mr, mode="graph")
    assert engine.generate(_prompts(), NEW) == want
    full_run = engine.generate(_prompts(), NEW, ignore_eos=True)
    assert [len(o) for o in full_run] == [NEW] * 4
    assert all(f[: len(w)] == w for f, w in zip(full_run, want))
    engine.shutdown()


def test_stop_ids_free_pages_at_once(saved):
    path, full = saved
    _write_eos(path, None)  # no eos: only --stop-ids stop
    mr = ModelRunner.from_hf_dir(path, "cpu", torch.float32, max_bs=4, max_context_len=64)
    engine = Engine(mr, mode="graph")
    stop = _pick_eos(full)
    prompts = _prompts()
    rids = [engine.add_request(p, NEW, stop_ids=[stop]) for p in prompts]
    free0 = engine.prefix_cache.num_available
    engine.step()  # admits and prefills all four
    held = free0 - engine.prefix_cache.num_available
    while engine.has_unfinished:
        before = (len(engine.running), engine.prefix_cache.num_available)
        engine.step()
        stopped = before[0] - len(engine.running)
        if stopped:  # freed in this very step
            assert engine.prefix_cache.num_available > before[1]
    assert engine.prefix_cache.num_available == free0 and held > 0
    outs = [engine.finished.pop(r).output for r in rids]
    assert outs == [_cut(f, {stop}) for f in full] and len(outs[0]) < NEW
    assert min(engine.stats.batch_sizes) < 4  # the decode batch shrank after the stop
    engine.shutdown()


def test_cli_stop_ids_and_ignore_eos(saved, capsys):
    path, full = saved
    stop = _pick_eos(full)
    _write_eos(path, stop)
    ids = ";".join(",".join(map(str, p)) for p in _prompts())
    base = ["generate", "--model", str(path), "--prompt-ids", ids, "--device", "cpu"]
    base += ["--max-new-tokens", str(NEW), "--json", "--mode", "eager"]

    def run(*extra):
        assert main([*base, *extra]) == 0
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])["outputs"]

    assert run() == [_cut(f, {stop}) for f in full]
    assert run("--ignore-eos") == full
    other = full[1][2]  # prompt 1's third token, as an extra stop id on top of eos
    assert run("--stop-ids", str(other)) == [_cut(f, {stop, other}) for f in full]
    assert run("--ignore-eos", "--stop-ids", str(other)) == [_cut(f, {other}) for f in full]
