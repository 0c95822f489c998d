"""What an ``Engine`` serves, and the checks made before anything runs: a ``Request``,
``Sampling`` (greedy, or temperature and top-k through Gumbel-max on the device), the
``EngineStats`` counters, the engine's arguments, each request, and its stop ids."""

from __future__ import annotations

import math
import numbers
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import SEED_MAX, ConfigError

MODES = ("eager", "graph", "exact")
PREFILLS = ("graph", "eager", "unpadded", "piecewise")
DECODE_VIAS = ("runner", "configs")


@dataclass(eq=False)  # a request is itself: the engine's lists find it by identity, without
class Request:  # comparing every field of each request before it (a close at 512 running)
    rid: int
    prompt: list[int]
    max_new_tokens: int
    pages: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    stop_ids: frozenset[int] = frozenset()  # a sampled id in here ends the request (kept)
    prefilled: int = 0  # prompt tokens whose K/V are in the cache (chunked prefill)
    scheduled: int = 0  # tokens sampled, on the host or still in flight (overlap)
    closed: bool = False  # finished or aborted: a later token of it is dropped
    min_tokens: int = 0  # stop ids are not checked before this many tokens (vLLM's min_tokens)
    sampling: Sampling | None = None  # its own sampling (None: the step's, ``sample_rows``)
    generator: torch.Generator | None = None  # its own draws, with ``sampling`` (seeded)
    cache_salt: str | None = None  # shares cached pages only with requests of the same salt
    cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission
    lookup: Any = field(default=None, repr=False, compare=False)  # cache_use.Lookup, kept

    @property
    def kv_tokens(self) -> int:
        """KV slots this request ever needs (the last new token is never fed back)."""
        return len(self.prompt) + self.max_new_tokens - 1

    @property
    def done(self) -> bool:
        n = len(self.output)
        if n >= self.max_new_tokens:
            return True
        return n >= max(self.min_tokens, 1) and self.output[-1] in self.stop_ids


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_k: int | None = None

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ConfigError(
                f"temperature must be a finite number >= 0 (0: greedy), got {t!r}; "
                "pass Sampling(temperature=0) (generate(temperature=0)) for greedy decoding."
            )
        k = self.top_k
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ConfigError(
                f"top_k must be an integer >= 1 or None, got {k!r}; pass top_k=None (every "
                "token) or top_k=1 and up."
            )

    def sample(
        self,
        logits: torch.Tensor,
        generator: torch.Generator | None,
        row_generators: Sequence[torch.Generator | None] | None = None,
    ) -> torch.Tensor:  # logits: [n, vocab] float32 -> [n] int64
        """``row_generators`` (one per row): row i draws its noise, ``[1, k]``, from its own
        generator, as a one-prompt ``generate`` draws it; else ``generator`` draws ``[n, k]``."""
        if self.temperature <= 0:
            return logits.argmax(-1)
        scaled = logits / self.temperature
        idx = None
        if self.top_k is not None and self.top_k < scaled.shape[-1]:
            scaled, idx = scaled.topk(self.top_k, dim=-1)  # [n, k] each
        # Gumbel-max: argmax(logits + Gumbel noise) samples softmax(logits), no host sync.
        if row_generators is None:
            u = torch.rand(scaled.shape, generator=generator, device=scaled.device)
        else:
            row, dev = (1, scaled.shape[-1]), scaled.device
            u = torch.cat([torch.rand(row, generator=g, device=dev) for g in row_generators])
        choice = (scaled - torch.log(-torch.log(u))).argmax(-1)  # [n]
        return choice if idx is None else idx.gather(-1, choice[:, None])[:, 0]


GREEDY = Sampling()


def sample_rows(
    logits: torch.Tensor,  # [n, vocab] float32, row i of request rows[i]
    rows: Sequence[Request],
    sampling: Sampling,
    generator: torch.Generator | None,
) -> torch.Tensor:  # [n] int64
    """``sampling`` with ``generator`` for every row, unless a row's request carries its own
    ``sampling`` (then drawn from its own ``generator``: a seeded request samples the same
    tokens in any batch, and the same as a one-prompt ``generate`` with that seed). Rows of one
    (temperature, top_k) are sampled together; each own generator draws its row's noise. No
    host sync: row indices reach the device through a pinned, non-blocking copy."""
    if all(r.sampling is None for r in rows):
        return sampling.sample(logits, generator)
    out = logits.argmax(-1)  # greedy rows keep theirs
    groups: dict[Sampling, list[int]] = {}
    for i, r in enumerate(rows):
        s = r.sampling or sampling
        if s.temperature > 0:
            groups.setdefault(s, []).append(i)
    cuda = logits.is_cuda
    for s, idx in groups.items():
        at = torch.tensor(idx, pin_memory=cuda).to(logits.device, non_blocking=True)  # [m]
        gens = [rows[i].generator if rows[i].sampling else generator for i in idx]
        out.index_copy_(0, at, s.sample(logits.index_select(0, at), generator, gens))
    return out


@dataclass
class EngineStats:
    graph_steps: int = 0  # decode steps replayed by the graph runner
    eager_steps: int = 0  # decode steps run eagerly (by model_runner.forward)
    prefills: int = 0  # prompts prefilled
    prefill_steps: int = 0  # packed prefill forwards (one per engine step at most)
    prefill_tokens: int = 0  # prompt tokens prefilled
    decode_tokens: int = 0
    landed_tokens: int = 0  # tokens returned to the host (one step after launch, overlapped)
    queried_tokens: int = 0  # prompt tokens of admitted requests (prefix cache queries)
    cached_tokens: int = 0  # of those, the ones served from the prefix cache (its hits)
    warm_requests: int = 0  # requests ``warm.warm_up`` ran (none of them counted above)
    # ``Engine.step`` calls and their wall seconds (host launch, and waiting for the tokens of
    # the step before when overlapped), split by whether the step prefilled: the time between
    # steps is the caller's
    steps: int = 0
    prefill_step_s: float = 0.0  # steps that ran a prefill forward (and maybe a decode)
    decode_step_s: float = 0.0  # steps that decoded only (or ran nothing)
    # decode steps by batch size: the trace `stepgraph buckets --trace` picks buckets from
    batch_sizes: Counter[int] = field(default_factory=Counter)

    @property
    def hit_rate(self) -> float:
        """``cached_tokens / queried_tokens``: the prefix cache's hit rate (0.0 before any)."""
        return self.cached_tokens / self.queried_tokens if self.queried_tokens else 0.0

    def count_step(self, seconds: float, prefill_steps_before: int) -> None:
        """Count an ``Engine.step`` of ``seconds``: under ``prefill_step_s`` if it ran a
        prefill (``prefill_steps`` moved past ``prefill_steps_before``), else
        ``decode_step_s``."""
        self.steps += 1
        if self.prefill_steps != prefill_steps_before:
            self.prefill_step_s += seconds
        else:
            self.decode_step_s += seconds

    @property
    def decode_steps(self) -> int:
        """Decode forwards (graph replays and eager steps)."""
        return self.graph_steps + self.eager_steps

    def write_trace(self, path: str) -> None:
        """Write ``batch_sizes`` as a trace, one batch size per decode step and line."""
        with open(path, "w") as f:
            for bs, steps in sorted(self.batch_sizes.items()):
                f.write(f"{bs}\n" * steps)


def check_seed(seed: object) -> int | None:
    """``seed`` as an int (None stays None), or ``ConfigError`` naming the range: an integer
    (numpy's too), not a bool, in [0, 2**64 - 1]."""
    if seed is None:
        return None
    if (
        isinstance(seed, bool)
        or not isinstance(seed, numbers.Integral)
        or not 0 <= seed <= SEED_MAX
    ):
        raise ConfigError(
            f"seed must be an integer in [0, 2**64 - 1] or None, got {seed!r}; None draws a "
            "random one."
        )
    return int(seed)


def own_sampling(
    sampling: Sampling | None, seed: int | None, device: torch.device
) -> tuple[Sampling | None, torch.Generator | None]:
    """A request's own sampling and its generator, seeded with ``seed`` (None: a random seed);
    ``(None, None)`` for greedy, which the step's batched argmax serves. ``ConfigError`` for a
    seed a generator cannot take (checked for greedy requests too)."""
    seed = check_seed(seed)
    if sampling is None or sampling.temperature <= 0:
        return None, None
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return sampling, generator


def default_mode(model_runner: Any, decode_via: str) -> str:
    """``Engine``'s mode when none is given: the fastest that equals eager token for token.
    "exact" on CUDA (graphs retuned to the live KV length: eager's split geometry), "eager" on
    the CPU (its graph stand-in re-runs the eager step: no faster, and there is no exact mode
    there); "graph" with ``decode_via="configs"``, its only mode."""
    if decode_via == "configs":
        return "graph"
    return "exact" if torch.device(model_runner.device).type == "cuda" else "eager"


def check_engine_args(mode: str, prefill: str, decode_via: str) -> None:
    if mode not in MODES:
        raise ConfigError(f"mode must be one of {MODES}, got {mode!r}.")
    if prefill not in PREFILLS:
        raise ConfigError(f"prefill must be one of {PREFILLS}, got {prefill!r}.")
    if decode_via not in DECODE_VIAS:
        raise ConfigError(f"decode_via must be one of {DECODE_VIAS}, got {decode_via!r}.")
    if decode_via == "configs" and mode != "graph":
        raise ConfigError(
            f"decode_via='configs' replays the captured decode walk as is; it needs "
            f"mode='graph', got mode={mode!r}. Use decode_via='runner' for mode={mode!r}."
        )


def running_limit(model_runner: Any, max_running: int | None) -> int | None:
    """The engine's ``max_running``: as given, or by default the model runner's ``max_bs`` (a
    decode batch holds every running request; None where the model runner has no ``max_bs``).
    ``ConfigError`` above ``max_bs``: no decode batch may outgrow its row buffers."""
    from ..runner.config import model_rows

    rows = model_rows(model_runner)
    if max_running is None:
        return rows
    if isinstance(max_running, bool) or not isinstance(max_running, int) or max_running < 1:
        raise ConfigError(f"max_running must be an integer >= 1 or None, got {max_running!r}.")
    if rows is not None and max_running > rows:
        raise ConfigError(
            f"max_running={max_running} is more than the model runner's max_bs={rows}: a decode "
            f"batch of every running request would not fit its buffers; pass max_running <= "
            f"{rows} (or None: {rows}), or build the model runner with max_bs={max_running}."
        )
    return max_running


def stop_id_set(config: Any, stop_ids: Sequence[int] | None, ignore_eos: bool) -> frozenset[int]:
    """``stop_ids`` (checked against the vocabulary) plus, unless ``ignore_eos``, the config's
    ``eos_token_ids``."""
    vocab = config.vocab_size
    extra = list(stop_ids or ())
    bad = [t for t in extra if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
    if bad:
        raise ConfigError(f"stop ids outside [0, {vocab}): {bad[:5]}; pass vocabulary ids.")
    eos = () if ignore_eos else getattr(config, "eos_token_ids", ())
    return frozenset(eos) | frozenset(extra)


def check_min_tokens(min_tokens: int, max_new_tokens: int) -> None:
    if isinstance(min_tokens, bool) or not isinstance(min_tokens, int):
        raise ConfigError(f"min_tokens must be an integer, got {min_tokens!r}.")
    if not 0 <= min_tokens <= max_new_tokens:
        raise ConfigError(
            f"min_tokens must be in [0, max_new_tokens={max_new_tokens}], got {min_tokens}."
        )


def check_prompt_ids(prompt: Any, name: str) -> None:
    """``ConfigError`` naming ``name`` unless ``prompt`` is a sequence of token ids (ints): text
    must go through a tokenizer first, and floats or nested lists are not ids."""
    if isinstance(prompt, (str, bytes)):
        got = f"it is the text {prompt[:40]!r}"
    elif not isinstance(prompt, Sequence):
        got = f"it is {prompt!r:.40} ({type(prompt).__name__})"
    elif {*map(type, prompt)} <= {int}:  # the common case, at C speed
        return
    else:
        bad = [t for t in prompt if isinstance(t, bool) or not isinstance(t, int)]
        if not bad:
            return
        got = f"it holds {type(bad[0]).__name__} values, e.g. {bad[:3]!r:.60}"
    raise ConfigError(
        f"{name} is not a list of token ids: {got}. A prompt is a list of token ids (ints), "
        "e.g. [1, 2, 3]; encode text with the model's tokenizer first, e.g. transformers' "
        "AutoTokenizer.from_pretrained(model_dir).encode(text)."
    )


def check_request(model_runner: Any, prompt: Sequence[int], max_new_tokens: int, what: str) -> None:
    """``ConfigError`` naming ``what`` unless ``prompt`` (token ids) plus ``max_new_tokens`` can
    be served: ids in the vocabulary, within ``max_position_embeddings`` and the KV cache."""
    vocab = model_runner.config.vocab_size
    if not prompt:
        raise ConfigError(f"{what} is empty; give at least one token id.")
    check_prompt_ids(prompt, what)
    if min(prompt) < 0 or max(prompt) >= vocab:
        bad = [t for t in prompt if not 0 <= t < vocab]
        raise ConfigError(f"{what} has token ids outside [0, {vocab}): {bad[:5]}.")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
        raise ConfigError(f"max_new_tokens must be an integer, got {max_new_tokens!r}.")
    if max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be >= 1, got {max_new_tokens}.")
    limit = model_runner.config.max_position_embeddings
    if len(prompt) + max_new_tokens - 1 > limit:
        raise ConfigError(
            f"{what} plus max_new_tokens={max_new_tokens} needs "
            f"{len(prompt) + max_new_tokens - 1} positions, more than the model's "
            f"max_position_embeddings={limit}; shorten the prompt or max_new_tokens."
        )
    model_runner.kv_cache.check_fits(len(prompt) + max_new_tokens - 1, what)


__all__ = [
    "own_sampling",
    "DECODE_VIAS",
    "GREEDY",
    "MODES",
    "PREFILLS",
    "EngineStats",
    "Request",
    "Sampling",
    "check_engine_args",
    "check_min_tokens",
    "check_prompt_ids",
    "check_request",
    "default_mode",
    "running_limit",
    "sample_rows",
    "stop_id_set",
]
