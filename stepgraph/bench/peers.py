"""What users would pick instead, on the same weights: Hugging Face transformers' eager
``generate``, and its fast path (static cache, which transformers compiles by itself).

Per-token time is (time for N2 new tokens - time for N1) / (N2 - N1), so prefill and the
one-off compile drop out; the compile cost is reported on its own.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..model.model_runner import ModelRunner
from .workload import Point

PEERS = ("hf-eager", "hf-static-compile")


@dataclass
class PeerResult:
    peer: str
    ms_per_token: dict[Point, float] = field(default_factory=dict)
    compile_seconds: float | None = None
    skipped: dict[Point, str] = field(default_factory=dict)
    error: str | None = None


def to_hf_state_dict(mr: ModelRunner) -> dict[str, torch.Tensor]:
    """Our fused weights -> Hugging Face Llama/Qwen2 names (q/k/v and gate/up split again)."""
    c = mr.config
    out: dict[str, torch.Tensor] = {}
    for name, t in mr.model.state_dict().items():
        if name.startswith("rope_"):
            continue
        if ".qkv_proj." in name:
            q, k, v = t.split([c.q_size, c.kv_size, c.kv_size], dim=0)
            for part, x in zip(("q_proj", "k_proj", "v_proj"), (q, k, v)):
                out["model." + name.replace("qkv_proj", part)] = x
        elif ".gate_up_proj." in name:
            gate, up = t.chunk(2, dim=0)
            out["model." + name.replace("gate_up_proj", "gate_proj")] = gate
            out["model." + name.replace("gate_up_proj", "up_proj")] = up
        elif name.startswith("lm_head"):
            out[name] = t
        else:
            out["model." + name] = t
    return out


def build_hf_model(mr: ModelRunner):
    """A transformers model of the same config, holding a copy of ``mr``'s weights."""
    import transformers

    c = mr.config
    cls_cfg = transformers.Qwen2Config if c.architecture == "qwen2" else transformers.LlamaConfig
    cls_model = (
        transformers.Qwen2ForCausalLM
        if c.architecture == "qwen2"
        else transformers.LlamaForCausalLM
    )
    kw = dict(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta,
        tie_word_embeddings=c.tie_word_embeddings,
        max_position_embeddings=c.max_position_embeddings,
    )
    if c.rope_scaling is not None:
        r = c.rope_scaling
        kw["rope_scaling"] = dict(
            rope_type="llama3",
            factor=r.factor,
            low_freq_factor=r.low_freq_factor,
            high_freq_factor=r.high_freq_factor,
            original_max_position_embeddings=r.original_max_position_embeddings,
        )
    if c.architecture != "qwen2":
        kw["attention_bias"] = c.attention_bias
    with torch.device(mr.device):
        model = cls_model(cls_cfg(**kw)).to(mr.dtype)
    missing, unexpected = model.load_state_dict(to_hf_state_dict(mr), strict=False)
    missing = [m for m in missing if not (c.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(
            f"weight transfer to transformers failed: missing={missing[:4]} "
            f"unexpected={unexpected[:4]}"
        )
    return model.eval()


def _generate_seconds(model, prompt: torch.Tensor, new_tokens: int, **kw) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    model.generate(
        prompt,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
        **kw,
    )
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def run_peer(
    peer: str, mr: ModelRunner, points: list[Point], allowed: set[Point], n1: int = 8, n2: int = 40
) -> PeerResult:
    """Time ``peer`` at each point in ``allowed``; the others are reported as skipped."""
    result = PeerResult(peer)
    try:
        model = build_hf_model(mr)
    except Exception as e:
        result.error = f"{type(e).__name__}: {e}"[:300]
        return result
    kw = {"cache_implementation": "static"} if peer == "hf-static-compile" else {}
    g = torch.Generator().manual_seed(0)
    try:
        for p in points:
            if p not in allowed:
                result.skipped[p] = "outside the peer budget (--peer-points all to run it)"
                continue
            prompt = torch.randint(1, mr.config.vocab_size, (p.bs, p.context - 1), generator=g).to(
                mr.device
            )
            with torch.no_grad():
                first = _generate_seconds(model, prompt, n1, **kw)  # compiles, for the static
                t1 = min(_generate_seconds(model, prompt, n1, **kw) for _ in range(2))
                t2 = min(_generate_seconds(model, prompt, n2, **kw) for _ in range(2))
            if peer == "hf-static-compile" and result.compile_seconds is None:
                result.compile_seconds = first - t1
            result.ms_per_token[p] = (t2 - t1) / (n2 - n1) * 1e3
    except Exception as e:
        result.error = f"{type(e).__name__}: {e}"[:300]
    finally:
        del model
        torch.cuda.empty_cache()
    return result
