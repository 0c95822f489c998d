"""``Engine.generate``: run a list of prompts to completion over the engine's step loop, with a
prefill progress bar on stderr once prefill takes ``PREFILL_PROGRESS_DELAY_S``."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch
from tqdm.auto import tqdm

from ..errors import ConfigError, StepGraphError
from .requests import Sampling, check_prompt_ids, check_request

PREFILL_PROGRESS_DELAY_S = 2.0  # generate() shows a prefill bar once prefill takes this long


def run_to_completion(
    engine: Any,  # the Engine (not imported: it imports this module)
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    seed: int | None = None,
    stop_ids: Sequence[int] | None = None,
    ignore_eos: bool = False,
) -> list[list[int]]:
    """New token ids of each prompt, in order (``Engine.generate`` is this function). Every
    prompt is checked before any is queued: one that cannot fit raises ``ConfigError`` naming
    it, and nothing runs."""
    engine._check_thread("generate")
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise ConfigError(
            f"prompts must be a list of prompts, each a list of token ids (ints), got "
            f"{prompts!r:.40}; e.g. generate([[1, 2, 3]], 8). Encode text with a tokenizer first."
        )
    for i, p in enumerate(prompts):
        check_prompt_ids(p, f"prompt {i}")  # before len(): text, a number
        check_request(engine.model_runner, p, max_new_tokens, f"prompt {i} ({len(p)} tokens)")
    generator = None
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
            raise ConfigError(f"seed must be an integer in [0, 2**64), got {seed!r}.")
        generator = torch.Generator(device=engine.model_runner.device).manual_seed(seed)
    sampling = Sampling(temperature, top_k)  # checks them before anything is queued
    stops = dict(stop_ids=stop_ids, ignore_eos=ignore_eos)  # see add_request
    rids = [engine.add_request(p, max_new_tokens, **stops) for p in prompts]
    # a bar on stderr once prefill has taken PREFILL_PROGRESS_DELAY_S (stdout stays clean)
    bar = tqdm(
        total=sum(map(len, prompts)), desc="prefill", unit="tok", file=sys.stderr,
        delay=PREFILL_PROGRESS_DELAY_S, leave=False,
    )  # fmt: skip
    try:
        while any(rid not in engine.finished for rid in rids):
            st = engine.stats
            prefilled, work = st.prefill_tokens, (st.decode_tokens, st.landed_tokens)
            engine.step(sampling, generator)
            prefilled = st.prefill_tokens - prefilled
            if not prefilled and (st.decode_tokens, st.landed_tokens) == work:  # a spin
                raise StepGraphError(
                    f"requests {[r for r in rids if r not in engine.finished]} were dropped "
                    "while generating (abort_all from another caller?); nothing is left "
                    "to run. Call generate again."
                )
            bar.update(min(prefilled, bar.total - bar.n))
    except BaseException:
        engine.abort_all()  # step already did on its own faults; add_request may have run
        for rid in rids:
            engine.finished.pop(rid, None)
        raise
    finally:
        bar.close()
    engine.drain()  # every page back before returning
    return [engine.finished.pop(rid).output for rid in rids]


__all__ = ["PREFILL_PROGRESS_DELAY_S", "run_to_completion"]
