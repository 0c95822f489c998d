"""Every global a Triton kernel of the package reads is one the compiler accepts: a module, a
Triton function (jit or builtin) or a ``tl.constexpr``. The interpreter (the CPU tier) reads any
Python global, so a plain ``X = 64`` read inside a kernel passes every CPU test and fails at
the first compile on a GPU ("Cannot access global variable X from within @jit'ed function")."""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import pkgutil
import textwrap
import types

import pytest
import triton.language as tl

import stepgraph


def _jit_functions():
    for info in pkgutil.walk_packages(stepgraph.__path__, "stepgraph."):
        if info.name.startswith("stepgraph.serve") or info.name == "stepgraph.__main__":
            continue  # the server's extra (FastAPI) may be absent, the CLI entry runs; no kernels
        mod = importlib.import_module(info.name)
        for name, obj in vars(mod).items():
            fn = getattr(obj, "fn", None)
            if (
                inspect.isfunction(fn)
                and fn.__module__ == mod.__name__
                and "triton" in str(type(obj).__module__)
            ):
                yield f"{mod.__name__}.{name}", fn


def _bad_globals(fn) -> list[str]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    local = {a.arg for a in ast.walk(tree) if isinstance(a, ast.arg)}
    local |= {
        t.id
        for n in ast.walk(tree)
        for t in ast.walk(n)
        if isinstance(n, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.For, ast.comprehension))
        and isinstance(t, ast.Name)
        and isinstance(t.ctx, ast.Store)
    }
    bad = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Name) or not isinstance(node.ctx, ast.Load):
            continue
        if node.id in local or node.id not in fn.__globals__:
            continue  # a parameter, a local, or a builtin (range, float, ...)
        value = fn.__globals__[node.id]
        ok = (
            isinstance(value, (types.ModuleType, tl.constexpr))
            or hasattr(value, "fn")  # a jit function
            or "triton" in getattr(value, "__module__", "")  # a Triton builtin (gdc_wait)
            or value is getattr(builtins, node.id, None)
        )
        if not ok:
            bad.append(f"{node.id} = {value!r}")
    return bad


KERNELS = sorted(_jit_functions())


def test_the_walk_finds_the_kernels():
    names = {n for n, _ in KERNELS}
    assert "stepgraph.kernels.proj.norm_gemv._norm_gemv_kernel" in names
    assert "stepgraph.kernels.sampling.argmax_parts.parts_argmax" in names
    assert "stepgraph.runner.graph_inputs._fill_inputs_kernel" in names
    assert len(names) > 30


def test_a_plain_global_is_caught():
    src = "LIMIT = 64\ndef k(x):\n    return x + LIMIT + OK\n"
    ns: dict = {"OK": tl.constexpr(1)}
    exec(compile(src, "<k>", "exec"), ns)  # noqa: S102 - a synthetic kernel body
    k = ns["k"]
    k.__globals__.update(ns)
    original = inspect.getsource
    try:
        inspect.getsource = lambda f: src.split("\n", 1)[1]
        assert _bad_globals(k) == ["LIMIT = 64"]
    finally:
        inspect.getsource = original


@pytest.mark.parametrize("name, fn", KERNELS, ids=[n for n, _ in KERNELS])
def test_kernel_globals_are_constexpr(name, fn):
    assert not _bad_globals(fn), f"{name} reads non-constexpr globals: {_bad_globals(fn)}"
