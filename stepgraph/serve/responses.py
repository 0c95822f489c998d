"""What `stepgraph serve` answers: OpenAI's completion and chat objects, their streamed chunks
as server-sent events, and ``TextStream``, the incremental detokenizer that also cuts the text
at a stop string (pure: no torch, no HTTP; tested on the CPU).

A choice carries ``token_ids`` (the generated ids, as vLLM's ``return_token_ids``) when asked.
A model without a tokenizer answers ``text: ""``: its output is the token ids.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence

SSE_DONE = b"data: [DONE]\n\n"


def sse(obj: dict) -> bytes:
    """One server-sent event: ``data: {json}`` and a blank line."""
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; ``cached_tokens``: prompt tokens served from the prefix cache."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


class Shapes:
    """The response objects of one request: ``id``, ``created`` and ``model`` fixed once."""

    def __init__(self, rid: str, created: int, model: str, chat: bool, token_ids: bool) -> None:
        self.rid, self.created, self.model = rid, created, model
        self.chat, self.token_ids = chat, token_ids
        obj = "chat.completion.chunk" if chat else "text_completion"
        head = {"id": rid, "object": obj, "created": created, "model": model}
        self._head = (
            "data: " + json.dumps(head, separators=(",", ":"))[:-1] + ',"choices":[{"index":0,'
        )

    def _wrap(self, obj: str, choices: list, **extra) -> dict:
        return {
            "id": self.rid,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }

    def final(
        self, text: str, ids: Sequence[int], reason: str, prompt_tokens: int, cached: int = 0
    ) -> dict:
        """The whole answer (``stream: false``); ``cached``: prompt tokens from the cache."""
        if self.chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": reason,
            }
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        if self.token_ids:
            choice["token_ids"] = list(ids)
        obj = "chat.completion" if self.chat else "text_completion"
        return self._wrap(obj, [choice], usage=usage(prompt_tokens, len(ids), cached))

    def chunk(
        self, text: str, ids: Sequence[int] | None, reason: str | None = None, first: bool = False
    ) -> dict:
        """One streamed chunk: the new text (and ids), ``finish_reason`` on the last."""
        if self.chat:
            delta = {"role": "assistant", "content": text} if first else {"content": text}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        if self.token_ids and ids is not None:
            choice["token_ids"] = list(ids)
        return self._wrap("chat.completion.chunk" if self.chat else "text_completion", [choice])

    def sse_chunk(
        self, text: str, ids: Sequence[int], reason: str | None = None, first: bool = False
    ) -> bytes:
        """``sse(self.chunk(...))``, built from a prefix made once: a chunk per token and
        request is the server's hottest path (``json.loads`` of it equals ``chunk``)."""
        body = json.dumps(text)
        if self.chat:
            role = '"role":"assistant",' if first else ""
            body = '"delta":{' + role + '"content":' + body + "}"
        else:
            body = '"text":' + body
        tail = ',"logprobs":null,"finish_reason":' + (
            "null" if reason is None else json.dumps(reason)
        )
        if self.token_ids:
            tail += ',"token_ids":[' + ",".join(map(str, ids)) + "]"
        return (self._head + body + tail + "}]}\n\n").encode()

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int, cached: int = 0) -> dict:
        """The last chunk with ``stream_options.include_usage``: no choices, the usage."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return self._wrap(obj, [], usage=usage(prompt_tokens, completion_tokens, cached))


class TextStream:
    """Token ids in, text out, a piece at a time: each ``add`` returns the text that is final
    now. Decoding a window of a few ids (from the one before the last emitted text) keeps the
    spacing a tokenizer puts between tokens, and a trailing U+FFFD (a UTF-8 character split
    across tokens) waits for the next id. With ``stops``, text that may be the start of a stop
    string is held back; once one appears, the text ends before it and ``stopped`` is set."""

    def __init__(self, decode: Callable[[list[int]], str] | None, stops: Sequence[str] = ()):
        self.decode, self.stops = decode, tuple(stops)
        self.ids: list[int] = []
        self.text = ""  # decoded so far (held-back tail included)
        self.sent = 0  # characters of ``text`` returned
        self.stopped = False
        self._prefix = self._read = 0  # window offsets into ids
        self._hold = max((len(s) for s in self.stops), default=1) - 1

    def _decode_new(self) -> str:
        prefix = self.decode(self.ids[self._prefix : self._read])
        full = self.decode(self.ids[self._prefix :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return full[len(prefix) :]

    def add(self, ids: Sequence[int]) -> str:
        if self.decode is None or self.stopped:
            return ""
        self.ids.extend(ids)
        start = max(0, len(self.text) - self._hold)  # a stop may begin in the held tail
        self.text += self._decode_new()
        hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if hits:
            self.text, self.stopped = self.text[: min(hits)], True
            return self._take(len(self.text))
        return self._take(len(self.text) - self._hold)

    def flush(self) -> str:
        """The held-back text, once no more ids come."""
        return self._take(len(self.text))

    def _take(self, upto: int) -> str:
        if upto <= self.sent:
            return ""
        out, self.sent = self.text[self.sent : upto], upto
        return out


__all__ = ["SSE_DONE", "Shapes", "TextStream", "sse", "usage"]
