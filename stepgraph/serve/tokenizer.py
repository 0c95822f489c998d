"""The tokenizer of a served checkpoint directory, as the server uses it: text prompts in
(``encode``, special tokens added as `stepgraph generate --prompt` adds them), text out
(``decode``, special tokens skipped) and chat messages through the chat template. Local files
only: nothing downloads. A preset, or a directory without tokenizer files, has none."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger("stepgraph.serve")


class ServedTokenizer:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.has_chat_template = bool(getattr(tokenizer, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def apply_template(self, messages: list[dict]) -> list[int]:
        out = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True
        )
        if isinstance(out, Mapping):  # transformers 5 returns a BatchEncoding
            out = out["input_ids"]
        return list(out)


def load_tokenizer(model: str) -> ServedTokenizer | None:
    """The tokenizer in directory ``model``, or None (with a note in the log saying why)."""
    if not Path(model).is_dir():
        return None
    try:
        from transformers import AutoTokenizer

        return ServedTokenizer(AutoTokenizer.from_pretrained(model, local_files_only=True))
    except (ImportError, OSError, ValueError, TypeError, KeyError) as e:
        log.warning(
            "no usable tokenizer in %s (%s: %s); serving token ids only",
            model,
            type(e).__name__,
            " ".join(str(e).split())[:160],
        )
        return None


__all__ = ["ServedTokenizer", "load_tokenizer"]
