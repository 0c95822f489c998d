"""Every anchor of docs/experiments.md and docs/results.md cited in the tree (code, tests,
benchmarks, docs, the README) names a heading of that file, by GitHub's rule: lowercase, spaces
to ``-``, punctuation other than ``-`` and ``_`` dropped, a repeated heading suffixed ``-1``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CITE = re.compile(r"\b(experiments|results)\.md#([A-Za-z0-9_-]+)")
SOURCES = ("stepgraph", "tests", "benchmarks", "docs", "scripts")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading's text."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(doc: Path) -> set[str]:
    """The anchors of ``doc``'s headings (outside fenced code), repeats numbered as GitHub does."""
    seen: dict[str, int] = {}
    out, fenced = set(), False
    for line in doc.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        if fenced or not (m := re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)):
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def citations() -> list[tuple[str, str, str]]:
    """``(file, doc, anchor)`` for every citation in the tree."""
    files = [ROOT / "README.md"]
    for top in SOURCES:
        files += sorted(p for p in (ROOT / top).rglob("*") if p.suffix in (".py", ".md", ".sh"))
    out = []
    for f in files:
        if f.is_file():
            for m in CITE.finditer(f.read_text(errors="replace")):
                out.append((str(f.relative_to(ROOT)), m.group(1), m.group(2)))
    return out


def test_the_slug_follows_githubs_rule():
    assert slug("PDL placement") == "pdl-placement"
    assert slug("Projection tiles, TMA and cuBLAS") == "projection-tiles-tma-and-cublas"
    assert slug("TMA swap-AB") == "tma-swap-ab"
    assert slug("16 KB before the PDL wait") == "16-kb-before-the-pdl-wait"
    assert slug("Decode step (`stepgraph bench`)") == "decode-step-stepgraph-bench"
    assert slug("The engine thread's GIL switch interval") == (
        "the-engine-threads-gil-switch-interval"
    )


def test_the_tree_cites_some_anchors():
    docs = {doc for _, doc, _ in citations()}
    assert "experiments" in docs  # the check below is not vacuous


@pytest.mark.parametrize("doc", ["experiments", "results"])
def test_every_cited_anchor_is_a_heading(doc):
    have = anchors(ROOT / "docs" / f"{doc}.md")
    missing = sorted(
        {f"{f}: {doc}.md#{a}" for f, d, a in citations() if d == doc and a not in have}
    )
    assert missing == [], "point these at a heading of docs/" + doc + ".md (or add one)"
