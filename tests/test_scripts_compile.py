"""Every benchmark and helper script compiles: the GPU-only ones run nowhere in CI, so this is
where a syntax error in them (``model_step.py``'s ``global`` after its first use, which only a
device call found) fails on the CPU instead."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted([*ROOT.glob("benchmarks/*.py"), *ROOT.glob("scripts/*.py")])


def test_there_are_scripts():
    assert len(SCRIPTS) >= 10 and ROOT / "benchmarks" / "model_step.py" in SCRIPTS


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_script_compiles(path):
    try:
        code = compile(path.read_text(), str(path), "exec")
    except SyntaxError as e:
        pytest.fail(f"{path.name} does not compile: {e}")
    assert code.co_filename == str(path) and code.co_consts  # a module's code, not an empty one


def test_a_global_after_its_use_is_refused():
    src = "X = 1\ndef f():\n    print(X)\n    global X\n"
    with pytest.raises(SyntaxError, match="used prior to global declaration"):
        compile(src, "<bad>", "exec")
