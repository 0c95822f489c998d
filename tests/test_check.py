"""`stepgraph check` on the CPU: graph and walk equal eager (exit 0); exact made to differ by
a skewing exec updater, or made to raise, fails the check (exit 1)."""

from __future__ import annotations

import random
import sys

from stepgraph import check
from stepgraph.check import random_mix
from stepgraph.cli import main
from stepgraph.runner import CudaGraphRunner

from .guards import time_limit

ARGS = ["check", "--model", "tiny", "--device", "cpu", "--trials", "4", "--max-bs", "4"]
ARGS += ["--context", "64", "--seed", "3"]


class SkewingUpdater:
    """An exec updater whose 'retune' reverses the vocabulary of the graph's output: the
    argmax moves, as a wrong split count would move it on the GPU."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail

    def plan(self, graph, bs):
        return bs

    def apply(self, plan, graph, t_kv):
        if self.fail:
            raise RuntimeError("updater fault")
        fn = graph._fn  # the CPU stand-in re-runs this callable at replay
        if not getattr(fn, "skewed", False):
            skewed = lambda: fn().flip(-1)
            skewed.skewed = True
            graph._fn = skewed
        return 0

    def invalidate(self, plan):
        pass


def _patch_updater(monkeypatch, updater):
    module = sys.modules[CudaGraphRunner.__module__]
    monkeypatch.setattr(module, "default_exec_updater", lambda model_runner: updater)
    monkeypatch.setattr(check, "CPU_MODES", check.MODES)  # exact runs here, on the fake updater


def test_check_passes_on_the_cpu(capsys):
    with time_limit(60):
        assert main(ARGS) == 0
    out = capsys.readouterr().out
    for mode in ("eager", "graph", "walk"):
        assert any(line.startswith(mode) for line in out.splitlines()), out
    assert "0/4" in out and "exact" in out and out.strip().endswith("OK")


def test_check_exits_1_when_exact_differs(monkeypatch, capsys):
    _patch_updater(monkeypatch, SkewingUpdater())
    with time_limit(60):
        assert main(ARGS + ["--modes", "eager,exact"]) == 1
    out = capsys.readouterr().out
    assert "FAIL: exact differs from eager" in out


def test_check_exits_1_when_a_mode_raises(monkeypatch, capsys):
    _patch_updater(monkeypatch, SkewingUpdater(fail=True))
    with time_limit(60):
        assert main(ARGS + ["--modes", "graph,exact"]) == 1
    out = capsys.readouterr().out
    assert "updater fault" in out and "exact raised" in out


def test_unknown_mode_is_one_line(capsys):
    assert main(ARGS + ["--modes", "eager,fast"]) == 2
    assert "--modes" in capsys.readouterr().err


def test_mixes_cover_joins_sampling_and_lengths():
    rng = random.Random(0)
    mixes = [random_mix(rng, 512, 8, 1000) for _ in range(200)]
    assert any(m.max_running is not None and m.max_running < len(m.prompts) for m in mixes)
    assert any(m.seed is not None and m.temperature > 0 for m in mixes)
    lengths = [len(p) for m in mixes for p in m.prompts]
    assert min(lengths) == 1 and max(lengths) > 500
    assert {m.max_new_tokens for m in mixes} == set(range(1, 25))
    assert {len(m.prompts) for m in mixes} == set(range(1, 9))


def test_about_half_the_mixes_share_prefixes_of_one_to_three_pages():
    rng = random.Random(1)
    mixes = [random_mix(rng, 512, 8, 1000) for _ in range(400)]

    def shared_pages(m):  # the longest common full-page prefix of two of its prompts
        best = 0
        for i, a in enumerate(m.prompts):
            for b in m.prompts[i + 1 :]:
                k = 0
                while k < min(len(a), len(b)) and a[k] == b[k]:
                    k += 1
                best = max(best, k // 16)
        return best

    shared = [shared_pages(m) for m in mixes if len(m.prompts) > 1]
    assert 0.3 < sum(s > 0 for s in shared) / len(shared) < 0.6
    assert {1, 2, 3} <= set(shared)
    assert any(len(set(map(tuple, m.prompts))) < len(m.prompts) for m in mixes)  # repeats
    assert all(1 <= len(p) <= 1000 for m in mixes for p in m.prompts)
    short = [random_mix(rng, 512, 8, 30) for _ in range(100)]  # heads fit short prompts too
    assert all(1 <= len(p) <= 30 for m in short for p in m.prompts)
    assert (
        random_mix(random.Random(0), 512, 4, 1).prompts[0]
        == random_mix(random.Random(0), 512, 4, 1).prompts[0]
    )


def test_the_check_reads_cached_prefixes(capsys):
    with time_limit(60):
        assert main(ARGS) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    modes = ("eager", "graph", "walk")
    cached = {r[0]: r[4] for r in rows if len(r) > 4 and r[0] in modes and "/" in r[1]}
    assert all(v.endswith("%") and v != "0%" for v in cached.values()), cached
