"""``POST /v1/chat/completions`` as `stepgraph serve` checks it: ``messages`` (text, or text
parts) through the tokenizer's chat template, then the sampling fields as completions check
them (``protocol.py``); a model without a chat template is a clear 400 (pure; CPU-tested)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .errors import RequestError
from .protocol import (
    GenParams,
    Limits,
    check_model,
    check_unsupported,
    field_error,
    json_object,
    parse_sampling,
)


def parse_chat(
    body: Any, limits: Limits, apply_template: Callable[[list[dict]], list[int]] | None = None
) -> GenParams:
    """``POST /v1/chat/completions``: ``messages`` through the tokenizer's chat template."""
    body = json_object(body)
    check_model(body, limits)
    if apply_template is None or not limits.chat_template:
        raise RequestError(
            "chat completions need a tokenizer with a chat template, and this model has none; "
            "use POST /v1/completions with a prompt, or serve a checkpoint directory with a "
            "chat template: a chat_template.jinja file, or a chat_template in "
            "tokenizer_config.json.",
            param="messages",
            code="chat_template_missing",
        )
    check_unsupported(body)
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise field_error("messages", "a non-empty list of {role, content} objects", msgs)
    clean = []
    for i, m in enumerate(msgs):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):  # OpenAI's content parts: text only
            if not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                for p in content
            ):
                raise field_error(
                    f"messages[{i}].content", "text, or a list of text parts", content
                )
            content = "".join(p["text"] for p in content)
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("system", "developer", "user", "assistant") or not isinstance(content, str):
            raise field_error(
                f"messages[{i}]", '{"role": "system|user|assistant", "content": str}', m
            )
        clean.append({"role": role, "content": content})
    prompt = apply_template(clean)
    bad = [t for t in prompt if not 0 <= t < limits.vocab_size]
    if not prompt or bad:
        raise RequestError("the chat template gave no usable token ids.", param="messages")
    return parse_sampling(body, limits, prompt, chat=True)


__all__ = ["parse_chat"]
