"""The prefix-caching workloads of `stepgraph bench --serve` and their checks — pure.

- ``shared-prefix``: SGLang's generated-shared-prefix workload. ``groups`` system prompts of
  ``system_len`` tokens, each followed by ``per_group`` questions of ``question_len`` tokens;
  every request asks for ``output_len`` tokens and all are queued at once, shuffled.
- ``multi-turn``: ``conversations`` chats of ``turns`` turns. A turn's prompt is the previous
  turn's prompt, that turn's output, then a new question of ``turn_len`` tokens; it asks for
  ``answer_len`` tokens (default ``turn_len``) and is submitted when the previous turn of its
  chat has finished. With 256-token answers the run is decode-bound; SGLang's multi_turn_chat
  benchmark draws answers of 4-8 tokens, where the prefill dominates (``--answer-len 8``).

Token ids are seeded random draws from ``[1, vocab)`` (the id 0 is left out, as in the random
workload), so a run is the same every time and caching on and off see the same requests.
"""

from __future__ import annotations

import argparse
import random

from ..errors import ConfigError

WORKLOADS = ("random", "shared-prefix", "multi-turn")
# defaults: SGLang's generated-shared-prefix sizes; 32 chats of 6 turns of 256 tokens (the
# question, and the answer unless answer_len is given)
PREFIX_DEFAULTS = {
    "workload": "random",
    "groups": 16,
    "prompts_per_group": 32,
    "system_prompt_len": 2048,
    "question_len": 128,
    "conversations": 32,
    "turns": 6,
    "turn_len": 256,
    "answer_len": None,  # multi-turn: turn_len
}


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(1, vocab) for _ in range(n)]


def shared_prefix_prompts(
    groups: int, per_group: int, system_len: int, question_len: int, vocab: int, seed: int
) -> list[list[int]]:
    """``groups * per_group`` prompts: a group's system prompt, then a question; shuffled."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(groups):
        system = _tokens(rng, system_len, vocab)
        prompts += [system + _tokens(rng, question_len, vocab) for _ in range(per_group)]
    rng.shuffle(prompts)
    return prompts


def turn_questions(
    conversations: int, turns: int, turn_len: int, vocab: int, seed: int
) -> list[list[list[int]]]:
    """``[conversation][turn]``: the new question of each turn, ``turn_len`` tokens."""
    rng = random.Random(seed)
    return [[_tokens(rng, turn_len, vocab) for _ in range(turns)] for _ in range(conversations)]


def next_prompt(prompt: list[int] | None, output: list[int], question: list[int]) -> list[int]:
    """A turn's prompt: the previous turn's prompt and output, then the new question (the first
    turn: the question alone, ``prompt`` None)."""
    return list(question) if prompt is None else prompt + output + question


def longest_context(args: argparse.Namespace) -> int:
    """The most positions one request of the workload needs (prompt + new tokens - 1)."""
    if args.workload == "shared-prefix":
        return args.system_prompt_len + args.question_len + args.output_len - 1
    # the last turn: every question, every answer before its own, then its own answer
    return args.turns * (args.turn_len + answer_tokens(args)) - 1


def answer_tokens(args: argparse.Namespace) -> int:
    """The tokens each multi-turn turn asks for: ``answer_len``, else ``turn_len``."""
    given = getattr(args, "answer_len", None)
    return args.turn_len if given is None else given


def requests_in_flight(args: argparse.Namespace) -> int:
    """The most requests the workload can have queued or running at once: every prompt
    (shared-prefix, all queued at once), or a turn per chat (multi-turn)."""
    if args.workload == "shared-prefix":
        return args.groups * args.prompts_per_group
    return args.conversations


def check_prefix_workload(args: argparse.Namespace, limit: int, model: str) -> None:
    """The ``--workload`` flags: one-line ``ConfigError`` naming the flag."""
    for key, value in PREFIX_DEFAULTS.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if args.workload not in WORKLOADS:
        raise ConfigError(f"--workload {args.workload}: choose one of {', '.join(WORKLOADS)}.")
    if args.answer_len is None:
        args.answer_len = args.turn_len
    for key in list(PREFIX_DEFAULTS)[1:]:
        value = getattr(args, key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            flag = "--" + key.replace("_", "-")
            raise ConfigError(f"{flag} must be an integer >= 1, got {value}.")
    if args.workload == "random":
        return
    need = longest_context(args)
    if need > limit:
        flags = (
            "--system-prompt-len, --question-len or --output-len"
            if args.workload == "shared-prefix"
            else "--turns, --turn-len or --answer-len"
        )
        raise ConfigError(
            f"--workload {args.workload} needs {need} positions for its longest request, more "
            f"than {model}'s max_position_embeddings={limit}; lower {flags}."
        )


def add_prefix_arguments(p: argparse.ArgumentParser) -> None:
    """The ``--workload`` flags of ``--serve``."""
    d = PREFIX_DEFAULTS
    p.add_argument(
        "--workload",
        default=None,
        help="--serve: random (default), shared-prefix (SGLang's generated-shared-prefix) or "
        "multi-turn; the last two run with prefix caching off, then on, on the same requests",
    )
    sizes = (
        ("--groups", f"shared-prefix: system prompts (default {d['groups']})"),
        (
            "--prompts-per-group",
            f"shared-prefix: prompts a group (default {d['prompts_per_group']})",
        ),
        ("--system-prompt-len", f"shared-prefix: tokens (default {d['system_prompt_len']})"),
        ("--question-len", f"shared-prefix: tokens (default {d['question_len']})"),
        ("--conversations", f"multi-turn: chats (default {d['conversations']})"),
        ("--turns", f"multi-turn: turns a chat (default {d['turns']})"),
        (
            "--turn-len",
            "multi-turn: question tokens a turn, and answer tokens unless --answer-len "
            f"(default {d['turn_len']})",
        ),
        (
            "--answer-len",
            "multi-turn: tokens each turn's answer asks for (default: --turn-len, a "
            "decode-bound run; SGLang's multi_turn_chat draws 4-8, where the prefill dominates)",
        ),
    )
    for flag, text in sizes:
        p.add_argument(flag, type=int, default=None, help=f"--serve --workload {text}")
    p.add_argument(
        "--no-prefix-caching",
        action="store_true",
        default=None,
        help="--serve --workload random: prefill every prompt whole",
    )


__all__ = [
    "PREFIX_DEFAULTS",
    "WORKLOADS",
    "add_prefix_arguments",
    "answer_tokens",
    "check_prefix_workload",
    "longest_context",
    "next_prompt",
    "requests_in_flight",
    "shared_prefix_prompts",
    "turn_questions",
]
