"""Token-id prompts and stop ids as the CLI takes them: ``"1,2,3;4,5"`` on the command line, or
a file (``--prompt-file``) for prompt lists too long for one (the OS caps a command line at a few
hundred KiB: about 40 prompts of 2,500 ids each fail with "Argument list too long")."""

from __future__ import annotations

import json
import sys
from typing import TextIO

from .errors import ConfigError


def parse_prompt_ids(text: str) -> list[list[int]]:
    """``"1,2,3;4,5"`` -> ``[[1, 2, 3], [4, 5]]`` (prompts split by ``;``, ids by ``,``). An
    empty item is an error, not skipped: ``"1,,2"`` is more likely a lost id than ``"1,2"``."""
    prompts = []
    for i, part in enumerate(text.split(";")):
        ids = []
        for j, item in enumerate(part.split(",")):
            try:
                ids.append(int(item))
            except ValueError:
                what = "empty" if not item.strip() else f"{item.strip()!r}, not an integer"
                raise ConfigError(
                    f"--prompt-ids: prompt {i}, item {j} is {what}; give ints, ids split by ',' "
                    "and prompts by ';': \"1,2,3;4,5\"."
                ) from None
        prompts.append(ids)
    return prompts


def parse_stop_ids(text: str) -> list[int]:
    """``"2,7"`` -> ``[2, 7]``."""
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError as e:
        raise ConfigError(f"--stop-ids {text!r}: {e}; give ints split by ',': \"2,7\".") from e


def read_prompt_file(path: str, stdin: TextIO | None = None) -> list[list[int]]:
    """Prompts from ``path`` (``"-"``: stdin): a JSON list of token-id lists, or JSON Lines with
    one token-id list per line."""
    if path == "-":
        text, where = (stdin or sys.stdin).read(), "stdin"
    else:
        try:
            with open(path) as f:
                text, where = f.read(), path
        except OSError as e:
            raise ConfigError(f"--prompt-file {path}: {e.strerror}; check the path.") from e
    return parse_prompt_text(text, where)


def parse_prompt_text(text: str, where: str = "prompt file") -> list[list[int]]:
    """The prompts of a prompt file's text (see ``read_prompt_file``)."""
    try:
        whole = json.loads(text)
    except json.JSONDecodeError:
        whole = None  # not one JSON document: read it as JSON Lines
    if isinstance(whole, list) and all(isinstance(p, list) for p in whole):
        prompts, places = whole, [f"prompt {i}" for i in range(len(whole))]
    else:
        prompts, places = [], []
        for no, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                prompts.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ConfigError(
                    f"{where} line {no} is not JSON ({e.msg}); give a JSON list of token-id "
                    "lists, or one JSON list of ids per line (JSON Lines)."
                ) from e
            places.append(f"line {no}")
    if not prompts:
        raise ConfigError(f"{where} holds no prompts; give at least one list of token ids.")
    for place, p in zip(places, prompts):
        if not isinstance(p, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in p
        ):
            raise ConfigError(
                f"{where} {place} is {str(p)[:60]}, not a list of token ids (ints), e.g. [1, 2, 3]."
            )
    return prompts


__all__ = ["parse_prompt_ids", "parse_prompt_text", "parse_stop_ids", "read_prompt_file"]
