"""Piecewise outputs share one buffer per name (views per shape), and padding rows are
re-written only when a larger batch left them live, even across runners sharing storage."""

from __future__ import annotations

import pytest
import torch

from stepgraph.configs import PiecewisePackedConfig, PiecewiseRunner
from stepgraph.configs.shared_outputs import PadTracker

D = 4


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(37)  # the tests below draw their inputs from the global generator


def _runner(static: torch.Tensor | None = None) -> PiecewiseRunner:
    w = torch.randn(D, D, generator=torch.Generator().manual_seed(0))

    def region(ci):
        x = ci.static_inputs["x"]  # [T, D]
        return {"y": torch.tanh(x @ w)}  # [T, D]: one row per token

    def make(shape):
        if static is not None:
            return {"x": static[: shape.total_tokens]}
        return {"x": torch.zeros(shape.total_tokens, D)}

    cfg = PiecewisePackedConfig(capture_fn=region, make_static_inputs=make, total_tokens=[16, 64])
    return PiecewiseRunner(cfg, device="cpu", batch_sizes=[1, 2])


def test_outputs_of_every_shape_are_views_of_one_buffer():
    runner = _runner()
    bases = {t.data_ptr() for out in runner.outputs.values() for t in [out["y"]]}
    assert len(bases) == 1  # one buffer for "y", rows [:T] per shape
    big = runner.outputs[(2, 64)]["y"]
    assert all(out["y"]._base is big._base for out in runner.outputs.values())
    assert runner._shared.buffers[("y", "tok")].shape == (64, D)
    x = torch.randn(20, D)
    got = runner.replay({"x": x}, [12, 8])
    assert got["y"].data_ptr() == big.data_ptr()
    ref = torch.tanh(x @ _weights())  # the region, eagerly, on the live rows
    torch.testing.assert_close(got["y"], ref)


def _weights() -> torch.Tensor:
    return torch.randn(D, D, generator=torch.Generator().manual_seed(0))


def test_padding_is_rewritten_only_when_dirty_across_views_of_one_storage():
    store = torch.full((64, D), 7.0)  # garbage at first: every row counts as dirty
    pads = PadTracker()
    small, big = store[:16], store[:64]
    small[:5] = 1.0
    pads.repad(small, 5, 0)  # rows [5:64] may be dirty: the view pads its own [5:16]
    assert (store[5:16] == 0).all() and (store[16:] == 7).all()
    big[:40] = 1.0
    pads.repad(big, 40, 0)  # the whole storage: pads [40:64], dirty becomes 40
    assert (store[40:] == 0).all()
    small[:3] = 2.0
    pads.repad(small, 3, 0)  # pads [3:16]; rows [16:40] stay dirty for the big view
    assert (store[3:16] == 0).all() and (store[16:40] == 1).all()
    big[:10] = 3.0
    pads.repad(big, 10, 0)
    assert (store[10:] == 0).all()
    store[10:] = 5.0  # a sentinel: a steady size re-pads nothing
    pads.repad(big, 10, 0)
    assert (store[10:] == 5).all()
