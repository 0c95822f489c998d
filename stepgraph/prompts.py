"""Token-id prompts and stop ids as the CLI takes them: ``"1,2,3;4,5"`` on the command line, or
a file (``--prompt-file``) for prompt lists too long for one (the OS caps a command line at a few
hundred KiB: about 40 prompts of 2,500 ids each fail with "Argument list too long")."""

from __future__ import annotations

import json
import sys
from typing import TextIO

from .cli_args import UsageError
from .errors import ConfigError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


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


def parse_stop_ids(text: str, vocab: int | None = None) -> list[int]:
    """``"2,7"`` -> ``[2, 7]``; with ``vocab``, each id within ``[0, vocab)``."""
    try:
        ids = [int(t) for t in text.split(",") if t.strip()]
    except ValueError as e:
        raise UsageError(
            f"argument --stop-ids: {text!r}: {e}; give ints split by ',': \"2,7\""
        ) from e
    bad = [t for t in ids if vocab is not None and not 0 <= t < vocab]
    if bad:
        raise UsageError(
            f"argument --stop-ids: ids outside the vocabulary [0, {vocab}): {bad[:5]}; pass "
            "token ids of the model"
        )
    return ids


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


def text_tokenizer(model: str, required: bool):
    """The tokenizer of the checkpoint directory ``model`` (local files only), or None.
    ``required`` (``--prompt`` text): a one-line error when there is none (a preset, or a
    directory without one). Otherwise it is loaded where the directory has tokenizer files, to
    print the outputs as text, and a note says so when they cannot be read."""
    from pathlib import Path

    if not Path(model).is_dir():
        if required:
            raise UsageError(
                "argument --prompt: text needs a tokenizer; pass --model DIR of a local HF "
                "checkpoint, or use --prompt-ids"
            )
        return None
    if not required and not any((Path(model) / f).is_file() for f in TOKENIZER_FILES):
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model, local_files_only=True)
    except (ImportError, OSError, ValueError, TypeError, KeyError) as e:
        said = " ".join(str(e).split())
        said = said if len(said) <= 160 else said[:159] + "…"
        if not required:
            print(
                f"stepgraph: note: no usable tokenizer in {model} ({type(e).__name__}: "
                f"{said}); printing token ids only",
                file=sys.stderr,
            )
            return None
        raise UsageError(
            f"argument --prompt: no usable tokenizer in {model} ({type(e).__name__}: {said}); "
            "copy the checkpoint's tokenizer files (tokenizer.json, tokenizer_config.json) "
            "into it, or pass token ids with --prompt-ids"
        ) from e


def decode_outputs(tokenizer, outputs: list[list[int]]) -> list[str] | None:
    """Each output's text (special tokens skipped), or None without a tokenizer."""
    if tokenizer is None:
        return None
    return [tokenizer.decode(out, skip_special_tokens=True) for out in outputs]


__all__ = [
    "TOKENIZER_FILES",
    "decode_outputs",
    "parse_prompt_ids",
    "parse_prompt_text",
    "parse_stop_ids",
    "read_prompt_file",
    "text_tokenizer",
]
