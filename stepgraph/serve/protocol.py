"""The OpenAI API as `stepgraph serve` speaks it: each request body checked field by field
before anything is queued; a refusal is a ``RequestError`` naming the field (``errors.py``
turns it into OpenAI's error object). Pure: no torch, no HTTP; tested on the CPU.

Accepted, besides OpenAI's fields: vLLM's extras that serving benchmarks send (``ignore_eos``,
``min_tokens``, ``return_token_ids``, ``stop_token_ids``, ``top_k``), and vLLM's ``cache_salt``
(a string: the request shares cached prompt pages only with requests of the same salt).
Fields this server cannot honour are refused unless they hold their neutral value (``n=1``,
``top_p=1``, penalties 0, ``logprobs`` null, ...); fields it does not know are ignored, as
vLLM ignores them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import SEED_MAX
from .errors import ModelNotFound, RequestError

DEFAULT_MAX_WAITING = 1024  # requests queued beyond those running before a 503
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions; chat defaults to the context left
# field -> its neutral values: anything else asks for what this server does not do
NEUTRAL = {
    "n": (1,),
    "best_of": (1,),
    "echo": (False,),
    "logprobs": (False,),
    "top_logprobs": (0,),
    "suffix": ("",),
    "top_p": (1,),
    "min_p": (0,),
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "repetition_penalty": (1,),
    "logit_bias": ({},),
    "tools": ([],),
    "response_format": ({"type": "text"},),
}


@dataclass(frozen=True)
class Limits:
    """What a request is checked against: the served model and the engine's sizes."""

    model: str  # the served model name
    vocab_size: int
    max_context: int  # prompt + new tokens of one request: positions and KV cache both
    can_tokenize: bool = False  # a tokenizer: text prompts, text stops, text output
    chat_template: bool = False  # the tokenizer has one: /v1/chat/completions


@dataclass(frozen=True)
class GenParams:
    """One checked request, ready for the engine thread."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop_ids: tuple[int, ...] = ()
    stop_texts: tuple[str, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    return_token_ids: bool = False
    stream: bool = False
    include_usage: bool = False
    chat: bool = False
    cache_salt: str | None = None


# -- field checks: each raises RequestError naming its field ---------------------------------


def field_error(field: str, want: str, got: Any) -> RequestError:
    shown = repr(got) if len(repr(got)) <= 60 else repr(got)[:59] + "…"
    return RequestError(f"'{field}' must be {want}, got {shown}.", param=field)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _int(body: Mapping, field: str, default: Any, lo: int, hi: int | None = None) -> Any:
    x = body.get(field)
    if x is None:
        return default
    if isinstance(x, float) and x.is_integer():
        x = int(x)
    if not _is_int(x) or x < lo or (hi is not None and x > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise field_error(field, f"an integer {rng}", x)
    return x


def _bool(body: Mapping, field: str, default: bool = False) -> bool:
    x = body.get(field)
    if x is None:
        return default
    if not isinstance(x, bool):
        raise field_error(field, "true or false", x)
    return x


def _token_ids(x: Any, field: str, vocab: int) -> list[int]:
    if not isinstance(x, list) or not all(_is_int(t) for t in x):
        raise field_error(field, "a list of integer token ids", x)
    bad = [t for t in x if not 0 <= t < vocab]
    if bad:
        raise RequestError(
            f"'{field}' has token ids outside the vocabulary [0, {vocab}): {bad[:5]}.", param=field
        )
    return list(x)


def check_model(body: Mapping, limits: Limits) -> None:
    model = body.get("model")
    if not isinstance(model, str):
        raise field_error("model", f"a string (this server serves {limits.model!r})", model)
    if model != limits.model:
        raise ModelNotFound(
            f"The model {model!r} does not exist; this server serves {limits.model!r} "
            "(GET /v1/models).",
            param="model",
        )


def _neutral(x: Any, values: tuple) -> bool:
    for v in values:
        if isinstance(v, bool) or isinstance(x, bool):
            if x is v:
                return True
        elif x == v:  # 1 == 1.0; {} == {}
            return True
    return False


def check_unsupported(body: Mapping) -> None:
    for field, neutral in NEUTRAL.items():
        x = body.get(field)
        if x is not None and not _neutral(x, neutral):
            raise RequestError(
                f"'{field}'={x!r} is not supported by stepgraph serve; leave it out (or send "
                f"{neutral[0]!r}).",
                param=field,
                code="unsupported_value",
            )


def _prompt(body: Mapping, limits: Limits, encode: Callable[[str], list[int]] | None) -> list[int]:
    x = body.get("prompt")
    if isinstance(x, list) and len(x) == 1 and isinstance(x[0], (str, list)):
        x = x[0]  # a batch of one prompt
    if isinstance(x, str):
        if encode is None:
            raise RequestError(
                "'prompt' as text needs a tokenizer, and this model has none (a preset, or a "
                'directory without tokenizer files); send token ids, "prompt": [1, 2, 3].',
                param="prompt",
            )
        ids = _token_ids(encode(x), "prompt", limits.vocab_size)  # a tokenizer past the model
    elif isinstance(x, list) and x and all(isinstance(p, (str, list)) for p in x):
        raise RequestError(
            f"'prompt' holds {len(x)} prompts; send one prompt per request.", param="prompt"
        )
    else:
        ids = _token_ids(x, "prompt", limits.vocab_size)
    if not ids:
        raise RequestError("'prompt' is empty; give at least one token.", param="prompt")
    return ids


def _stops(body: Mapping, limits: Limits) -> tuple[tuple[int, ...], tuple[str, ...]]:
    ids: list[int] = []
    texts: tuple[str, ...] = ()
    x = body.get("stop")
    if isinstance(x, str):
        x = [x]
    if x is not None:
        if isinstance(x, list) and x and all(_is_int(t) for t in x):
            ids += _token_ids(x, "stop", limits.vocab_size)
        elif isinstance(x, list) and all(isinstance(t, str) and t for t in x):
            if x and not limits.can_tokenize:
                raise RequestError(
                    "'stop' as text needs a tokenizer, and this model has none; pass stop token "
                    'ids, "stop": [2] (or "stop_token_ids").',
                    param="stop",
                )
            texts = tuple(x)
        else:
            raise field_error(
                "stop", "a non-empty string, a list of them, or a list of token ids", x
            )
    if body.get("stop_token_ids") is not None:
        ids += _token_ids(body["stop_token_ids"], "stop_token_ids", limits.vocab_size)
    return tuple(dict.fromkeys(ids)), texts


def parse_sampling(body: Mapping, limits: Limits, prompt: list[int], chat: bool) -> GenParams:
    """The fields shared by both endpoints; ``prompt`` already tokenized and checked."""
    room = limits.max_context - len(prompt) + 1  # new tokens the context leaves
    if room < 1:
        raise RequestError(
            f"the prompt has {len(prompt)} tokens, more than this server's context of "
            f"{limits.max_context} tokens (--max-context); shorten it.",
            param="messages" if chat else "prompt",
        )
    field = "max_completion_tokens" if chat and body.get("max_tokens") is None else "max_tokens"
    max_tokens = _int(body, field, room if chat else DEFAULT_MAX_TOKENS, 1)
    if max_tokens > room:
        raise RequestError(
            f"'{field}'={max_tokens} with a prompt of {len(prompt)} tokens needs "
            f"{len(prompt) + max_tokens - 1} positions, more than this server's context of "
            f"{limits.max_context} (--max-context); ask for at most {room}.",
            param=field,
        )
    t = body.get("temperature")
    if t is None:
        t = 1.0
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
        raise field_error("temperature", "a finite number >= 0 (0: greedy)", t)
    top_k = _int(body, "top_k", None, -1)
    stop_ids, stop_texts = _stops(body, limits)
    stream = _bool(body, "stream")
    opts = body.get("stream_options")
    usage_flag = opts.get("include_usage", False) if isinstance(opts, dict) else None
    if opts is not None and (not stream or not isinstance(usage_flag, bool)):
        raise field_error(
            "stream_options", '{"include_usage": true|false}, with "stream": true', opts
        )
    min_tokens = _int(body, "min_tokens", 0, 0, max_tokens)
    salt = body.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise field_error("cache_salt", "a string (requests share cached pages by it)", salt)
    return GenParams(
        prompt_ids=prompt,
        max_tokens=max_tokens,
        temperature=float(t),
        top_k=top_k if top_k not in (None, -1, 0) else None,  # vLLM: -1 and 0 turn it off
        seed=_int(body, "seed", None, 0, SEED_MAX),
        stop_ids=stop_ids,
        stop_texts=stop_texts,
        ignore_eos=_bool(body, "ignore_eos"),
        min_tokens=min_tokens,
        return_token_ids=_bool(body, "return_token_ids"),
        stream=stream,
        include_usage=bool(usage_flag),
        chat=chat,
        cache_salt=salt,
    )


def json_object(body: Any) -> Mapping:
    if not isinstance(body, dict):
        raise RequestError(
            f"the request body must be a JSON object, got {type(body).__name__}.", param="body"
        )
    return body


def parse_completion(
    body: Any, limits: Limits, encode: Callable[[str], list[int]] | None = None
) -> GenParams:
    """``POST /v1/completions``: ``body`` (decoded JSON) -> ``GenParams``, else ``ApiError``."""
    body = json_object(body)
    check_model(body, limits)
    check_unsupported(body)
    if "prompt" not in body:
        raise RequestError("'prompt' is required: text or a list of token ids.", param="prompt")
    return parse_sampling(body, limits, _prompt(body, limits, encode), chat=False)


__all__ = [
    "DEFAULT_MAX_TOKENS",
    "DEFAULT_MAX_WAITING",
    "GenParams",
    "Limits",
    "parse_completion",
    "parse_sampling",
]
