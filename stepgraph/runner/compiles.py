"""Counting Triton kernel variants: what a workload compiled (or loaded from the disk cache) in
this process, to check that nothing compiles on the serving path once an engine is ready.

    before = kernel_variants()                 # {kernel name: variants in its JIT caches}
    with CompileCounter() as compiled:         # Triton's jit_post_compile_hook while inside
        engine.generate(new_prompts, 8)
    assert not compiled.names and new_variants(before, kernel_variants()) == {}

Two views of one fact: ``CompileCounter`` sees each compile as it happens (Triton calls its hook
after every compile, cache hit on disk included: a new variant in this process), and
``kernel_variants`` counts the entries of every ``JITFunction``'s per-device kernel cache
(``device_caches``), so a compile that bypassed the hook still shows. Under
``TRITON_INTERPRET=1`` nothing compiles and both stay empty.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any


def _registry() -> list[Any]:
    """Every ``JITFunction`` Triton knows of in this process (empty without Triton)."""
    try:
        from triton.runtime.jit import _triton_jit_function_registry
    except ImportError:  # pragma: no cover - Triton is a dependency
        return []
    return list(_triton_jit_function_registry.values())


def kernel_variants(functions: Iterable[Any] | None = None) -> dict[str, int]:
    """``{name: compiled variants}`` over ``functions`` (default: every ``JITFunction``), from
    each one's per-device kernel caches; kernels with none are left out. Reading the caches
    creates nothing (``device_caches`` is only iterated)."""
    counts: dict[str, int] = {}
    for fn in _registry() if functions is None else functions:
        caches = getattr(fn, "device_caches", None)
        if not caches:
            continue
        n = sum(len(entry[0]) for entry in list(caches.values()))
        if n:
            counts[_name(fn)] = counts.get(_name(fn), 0) + n
    return counts


def _name(fn: Any) -> str:
    """``module.qualname`` of a ``JITFunction`` (the name its compile hook reports too)."""
    inner = getattr(fn, "fn", None)
    return f"{getattr(fn, 'module', '?')}.{getattr(inner, '__qualname__', repr(fn))}"


def new_variants(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """The kernels with more variants in ``after`` than in ``before``, and how many more."""
    return {k: n - before.get(k, 0) for k, n in after.items() if n > before.get(k, 0)}


class CompileCounter:
    """While inside, every Triton compile in this process is counted by kernel name (its
    ``jit_post_compile_hook``; one set before is still called, and restored on exit)."""

    def __init__(self, on_compile: Callable[[int], Any] | None = None) -> None:
        self.names: Counter[str] = Counter()
        self._knobs: Any = None
        self._previous: Any = None
        self._on_compile = on_compile  # called with the count after each compile (progress)

    def hook(self, *args: Any, **kwargs: Any) -> Any:
        info = kwargs.get("fn")  # Triton's JitFunctionInfo(module, name, jit_function)
        name = getattr(info, "name", None)
        key = f"{info.module}.{name}" if name else str(kwargs.get("repr", "?"))
        self.names[key] += 1
        if self._on_compile is not None:
            self._on_compile(self.count)
        if self._previous is not None:
            return self._previous(*args, **kwargs)
        return None

    @property
    def count(self) -> int:
        return sum(self.names.values())

    def __enter__(self) -> CompileCounter:
        from triton import knobs

        self._knobs = knobs.runtime
        self._previous = self._knobs.jit_post_compile_hook
        self._knobs.jit_post_compile_hook = self.hook
        return self

    def __exit__(self, *exc: object) -> None:
        self._knobs.jit_post_compile_hook = self._previous


__all__ = ["CompileCounter", "kernel_variants", "new_variants"]
