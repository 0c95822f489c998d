"""``benchmarks/step_timeline.py``'s bookkeeping on the CPU, over made-up traces: the layer's
period found past a different layer 0 and head, the rows keyed by position in the layer from
its attention on, and each kernel's own span, gap and advance (the advances of a layer add up
to the layer's time, overlaps included)."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAYER = ["qkv", "_split_kv_kernel", "comb", "gemv", "gate_up", "gemv"]  # o_proj and down: gemv


def load_timeline():
    path = ROOT / "benchmarks" / "step_timeline.py"
    spec = importlib.util.spec_from_file_location("step_timeline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def trace(layers: int, own: float = 2.0, step: float = 1.5):
    """fill, embed, layer 0 with its own norm kernel, then the layers, then the head: each
    kernel starts ``step`` µs after the one before and runs ``own`` (overlapping by the
    difference), but the attention starts 1 µs after its predecessor's end."""
    names = ["fill", "embed", "norm", *LAYER] + LAYER * (layers - 1) + ["lm_head", "argmax"]
    t, ks = 0.0, []
    for name in names:
        if name == "_split_kv_kernel":
            t = ks[-1][2] + 1.0
        ks.append((name, t, t + own))
        t += step
    return ks


def test_period_and_rows():
    st = load_timeline()
    ks = trace(16)
    per, start = st.layer_period([k[0] for k in ks])
    assert per == len(LAYER) and "split_kv" in ks[start][0]
    rows, span = st.layer_rows([ks, ks], 16)
    assert [r["kernel"] for r in rows] == [
        "0:_split_kv_kernel",
        "1:comb",
        "2:gemv",
        "3:gate_up",
        "4:gemv",
        "5:qkv",
    ]
    attn, comb = rows[0], rows[1]
    assert (attn["own"], attn["gap"], attn["advance"]) == (2.0, 1.0, 3.0)
    assert (comb["own"], comb["gap"], comb["advance"]) == (2.0, -0.5, 1.5)
    # a layer's advances add up to its time: 5 kernels 1.5 µs apart, then the attention's 3
    assert sum(r["advance"] for r in rows) == pytest.approx(5 * 1.5 + 3.0)
    assert span == ks[-1][2] - ks[0][1]


def test_no_period_is_refused():
    st = load_timeline()
    with pytest.raises(RuntimeError, match="no layer period"):
        st.layer_period([f"k{i}" for i in range(40)])
