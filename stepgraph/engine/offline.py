"""The pieces of ``Engine.generate`` that need no engine: the checks of its prompts and seed, and
the prefill progress bar on stderr, shown once prefill takes ``PREFILL_PROGRESS_DELAY_S``."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch
from tqdm.auto import tqdm

from ..errors import ConfigError
from .requests import check_prompt_ids, check_request, check_seed

PREFILL_PROGRESS_DELAY_S = 2.0  # generate() shows a prefill bar once prefill takes this long


def check_prompts(model_runner: Any, prompts: Any, max_new_tokens: int) -> None:
    """``ConfigError`` naming the first prompt that is not token ids or could never fit."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise ConfigError(
            f"prompts must be a list of prompts, each a list of token ids (ints), got "
            f"{prompts!r:.40}; e.g. generate([[1, 2, 3]], 8). Encode text with a tokenizer first."
        )
    for i, p in enumerate(prompts):
        check_prompt_ids(p, f"prompt {i}")  # before len(): text, a number
        check_request(model_runner, p, max_new_tokens, f"prompt {i} ({len(p)} tokens)")


def seeded_generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    """A generator on ``device`` seeded with ``seed`` (checked), or None for no seed."""
    seed = check_seed(seed)
    return None if seed is None else torch.Generator(device=device).manual_seed(seed)


def prefill_bar(total: int) -> tqdm:
    """A bar of ``total`` prompt tokens on stderr (stdout stays clean), shown only once
    prefill has taken ``PREFILL_PROGRESS_DELAY_S``."""
    return tqdm(
        total=total,
        desc="prefill",
        unit="tok",
        file=sys.stderr,
        delay=PREFILL_PROGRESS_DELAY_S,
        leave=False,
    )


__all__ = ["PREFILL_PROGRESS_DELAY_S", "check_prompts", "prefill_bar", "seeded_generator"]
