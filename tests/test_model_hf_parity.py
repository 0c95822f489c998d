"""The reference model against transformers: tiny random Llama (llama3 rope scaling, GQA,
untied head) and Qwen2 (qkv bias, tied head) checkpoints saved as safetensors, loaded by
stepgraph in float32. Prefill and decode logits within 1e-4, greedy tokens identical."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from stepgraph.engine import Engine  # noqa: E402
from stepgraph.errors import ConfigError  # noqa: E402
from stepgraph.model import ModelConfig, ModelRunner  # noqa: E402
from stepgraph.model.hf_loader import load_hf_config  # noqa: E402

ATOL = 1e-4
COMMON = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=0,
)


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Every parameter random (biases too: transformers zero-initialises them, which would
    hide a bias bug); norm weights around 1."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g) * 0.05
            p.copy_(noise + 1.0 if "norm" in name else noise)


def _hf_llama():
    cfg = transformers.LlamaConfig(
        **COMMON,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
    )
    return transformers.LlamaForCausalLM(cfg)


def _hf_qwen2():
    cfg = transformers.Qwen2Config(
        **COMMON, rope_theta=1e6, tie_word_embeddings=True, rms_norm_eps=1e-6
    )
    return transformers.Qwen2ForCausalLM(cfg)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def checkpoint(request, tmp_path_factory):
    """(hf model in float32, saved directory)."""
    torch.manual_seed(0)
    hf = _hf_llama() if request.param == "llama" else _hf_qwen2()
    _randomize(hf, seed=1 if request.param == "llama" else 2)
    hf = hf.float().eval()
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path, safe_serialization=True)
    return hf, path


def _prompts(seed: int, lengths: list[int], vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]


def test_config_translation(checkpoint):
    hf, path = checkpoint
    cfg = load_hf_config(path)
    assert cfg.num_kv_heads == 2 and cfg.num_heads == 4 and cfg.head_dim == 16
    if hf.config.model_type == "llama":
        assert cfg.rope_scaling is not None and cfg.rope_scaling.factor == 8.0
        assert not cfg.tie_word_embeddings and not cfg.attention_bias
        assert cfg.rope_theta == 500000.0
    else:
        assert cfg.rope_scaling is None and cfg.tie_word_embeddings and cfg.attention_bias
        assert cfg.rope_theta == 1e6


def test_prefill_and_decode_logits_match(checkpoint):
    hf, path = checkpoint
    mr = ModelRunner.from_hf_dir(path, "cpu", torch.float32, max_bs=4, max_context_len=128)
    prompt = _prompts(3, [23], COMMON["vocab_size"])[0]
    steps = 6
    pages = mr.kv_cache.reserve(len(prompt) + steps)
    ours = mr.prefill([prompt], [pages])[0]  # [vocab]
    seq = list(prompt)
    with torch.no_grad():
        for step in range(steps + 1):
            ref = hf(torch.tensor([seq])).logits[0, -1]  # [vocab]
            assert ours.shape == ref.shape
            assert torch.allclose(ours, ref, atol=ATOL, rtol=0), (
                f"step {step}: max |diff| {(ours - ref).abs().max():.2e}"
            )
            assert ref.std() > 0.1  # the comparison is not between near-constant logits
            if step == steps:
                break
            # feed a random token (not the argmax): decode must follow any input
            nxt = int(torch.randint(1, COMMON["vocab_size"], (1,)))
            batch = mr.decode_batch([nxt], [len(seq)], [pages])
            seq.append(nxt)
            ours = mr.forward(batch)[0]


def test_batched_decode_matches_single(checkpoint):
    """Three requests of different lengths in one decode batch == each on its own in HF."""
    hf, path = checkpoint
    mr = ModelRunner.from_hf_dir(path, "cpu", torch.float32, max_bs=4, max_context_len=128)
    prompts = _prompts(4, [5, 17, 33], COMMON["vocab_size"])
    pages = [mr.kv_cache.reserve(len(p) + 1) for p in prompts]
    mr.prefill(prompts, pages)
    nxt = [7, 100, 250]
    logits = mr.forward(mr.decode_batch(nxt, [len(p) for p in prompts], pages))
    with torch.no_grad():
        for i, (p, t) in enumerate(zip(prompts, nxt)):
            ref = hf(torch.tensor([p + [t]])).logits[0, -1]
            assert torch.allclose(logits[i], ref, atol=ATOL, rtol=0), f"request {i}"


def test_greedy_tokens_match_generate(checkpoint):
    hf, path = checkpoint
    mr = ModelRunner.from_hf_dir(path, "cpu", torch.float32, max_bs=4, max_context_len=128)
    prompts = _prompts(5, [4, 19, 41], COMMON["vocab_size"])
    new = 16
    ours = Engine(mr, mode="eager").generate(prompts, max_new_tokens=new)
    for p, got in zip(prompts, ours):
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([p]), max_new_tokens=new, min_new_tokens=new, do_sample=False
            )
        assert got == out[0, len(p) :].tolist()
    assert len({tuple(t) for t in ours}) == 3  # different prompts, different continuations


def test_missing_config_and_weights(tmp_path):
    with pytest.raises(ConfigError, match="config.json"):
        ModelRunner.from_hf_dir(tmp_path)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON))
    hf.save_pretrained(tmp_path, safe_serialization=True)
    for f in tmp_path.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(ConfigError, match="safetensors"):
        ModelRunner.from_hf_dir(tmp_path)


def test_missing_shard_named(tmp_path):
    hf = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**COMMON))
    hf.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="100KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    (tmp_path / shards[-1]).unlink()
    with pytest.raises(ConfigError, match=shards[-1]):
        ModelRunner.from_hf_dir(tmp_path)


def test_sharded_checkpoint_loads(tmp_path):
    torch.manual_seed(1)
    hf = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**COMMON))
    _randomize(hf, seed=9)
    hf.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="100KB")
    mr = ModelRunner.from_hf_dir(tmp_path, max_context_len=64)
    prompt = _prompts(6, [9], COMMON["vocab_size"])[0]
    ours = mr.prefill([prompt], [mr.kv_cache.reserve(len(prompt))])[0]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0, -1]
    assert torch.allclose(ours, ref, atol=ATOL, rtol=0)


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["MistralForCausalLM"], "model_type": "mistral"})
    )
    with pytest.raises(ConfigError, match="MistralForCausalLM"):
        ModelRunner.from_hf_dir(tmp_path)
    with pytest.raises(ConfigError, match="rope type"):
        ModelConfig.from_hf_config(
            {
                **{k: v for k, v in COMMON.items() if v is not None},
                "architectures": ["LlamaForCausalLM"],
                "num_hidden_layers": 1,
                "rope_scaling": {"rope_type": "yarn", "factor": 4.0},
            }
        )
