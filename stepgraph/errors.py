"""One small exception hierarchy. Every message names the problem, the fix, and where there is
one, the escape hatch (run the batch eagerly, use ``mode="graph"``, ...)."""

from __future__ import annotations


class StepGraphError(Exception):
    """Base of every error stepgraph raises on purpose."""


class ConfigError(StepGraphError, ValueError):
    """A configuration or an input that cannot be served as given (shapes, dtypes, buckets)."""


class CaptureError(StepGraphError, RuntimeError):
    """A step could not be captured into a graph. Nothing half-captured is left behind."""


class ReplayError(StepGraphError, RuntimeError):
    """A batch cannot be replayed (too large, wrong dtype/device, runner shut down)."""


class GraphUpdateError(StepGraphError, RuntimeError):
    """A driver call failed, or a kernel node is not where the update plan expects it."""


SEED_MAX = 2**64 - 1
"""The largest seed: ``torch.Generator.manual_seed`` takes 64 unsigned bits. The engine, the CLI
and the server refuse a seed outside ``[0, SEED_MAX]`` with this one limit."""


def check_flags(**flags: object) -> None:
    """``ConfigError`` naming the first of ``flags`` that is not ``True`` or ``False``."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise ConfigError(f"{name} must be True or False, got {value!r}.")


__all__ = [
    "check_flags",
    "StepGraphError",
    "ConfigError",
    "CaptureError",
    "ReplayError",
    "GraphUpdateError",
]
