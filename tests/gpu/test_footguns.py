"""What silently differs under CUDA-graph replay: a catalogue, as tests (after tinygrad's
test_jit_footguns.py). Each test asserts the footgun really happens, so that the docs stay true,
and where stepgraph guards against it, that the guard works."""

from __future__ import annotations

import torch

from stepgraph.runner import CudaGraphRunner, RunnerConfig
from stepgraph.toy_model import ToyModelRunner


def capture(fn):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    return g, out


def test_python_constants_are_frozen_at_capture():
    x = torch.randn(64, device="cuda")
    state = {"scale": 2.0}
    g, out = capture(lambda: x * state["scale"])
    state["scale"] = 5.0  # the graph does not see this: the scalar was baked into the kernel
    g.replay()
    torch.testing.assert_close(out, x * 2.0)


def test_host_side_branches_are_frozen_at_capture():
    x = torch.randn(8, device="cuda")
    flags = {"double": True}
    g, out = capture(lambda: x * 2 if flags["double"] else x * 3)
    flags["double"] = False  # the branch was taken on the host, once, at capture
    g.replay()
    torch.testing.assert_close(out, x * 2)


def test_building_device_tensors_from_host_data_fails_capture():
    import pytest

    x = torch.randn(8, device="cuda")
    with pytest.raises(RuntimeError, match="pinned|capture"):
        capture(lambda: x * torch.tensor([3.0], device="cuda"))


def test_output_is_overwritten_by_the_next_replay():
    x = torch.randn(16, device="cuda")
    g, out = capture(lambda: x + 1)
    g.replay()
    first = out  # not a copy: a view of the graph's static output
    x.copy_(torch.randn(16, device="cuda"))
    g.replay()
    assert first.data_ptr() == out.data_ptr()
    torch.testing.assert_close(first, x + 1)


def test_inputs_must_be_written_in_place_not_rebound():
    x = torch.randn(16, device="cuda")
    holder = {"x": x}
    g, out = capture(lambda: holder["x"] * 3)
    holder["x"] = torch.randn(16, device="cuda")  # rebinding: the graph still reads old memory
    g.replay()
    torch.testing.assert_close(out, x * 3)


def test_dirty_padding_rows_would_corrupt_live_kv_and_the_runner_prevents_it():
    mr = ToyModelRunner(
        hidden=32,
        num_layers=2,
        num_pages=200,
        page_size=16,
        max_pages_per_request=4,
        device="cuda",
        seed=3,
    )
    runner = CudaGraphRunner(mr, RunnerConfig(capture_bs=(8,), show_progress=False))
    g = torch.Generator().manual_seed(1)
    big = mr.random_batch(8, g)
    runner.replay(big)
    # The footgun: a hand-rolled runner that only copies rows [:bs] leaves rows 5..7 pointing
    # at request slots of the previous batch, so the padded rows write there.
    stale = runner.buffers.out_cache_loc[5:8].clone()
    assert stale.ne(0).all()
    small = mr.random_batch(5, g)
    runner.replay(small)
    assert runner.buffers.out_cache_loc[5:8].eq(0).all()  # re-padded to the scratch slot
    runner.shutdown()
