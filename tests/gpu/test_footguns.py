"""What silently differs under CUDA-graph replay: a catalogue, as tests (after tinygrad's
test_jit_footguns.py). Each test asserts the footgun really happens, so that the docs stay true,
and where stepgraph guards against it, that the guard works.

    footgun                                        severity   stepgraph's guard
    -------------------------------------------------------------------------------------------
    Python constants frozen at capture             wrong      none: pass values as tensors
    host-side branches frozen at capture           wrong      none: branch on static shapes only
    device tensors built from host data            crash      CaptureError names the host sync
    output overwritten by the next replay          wrong      documented: consume before replay
    inputs rebound instead of written in place     wrong      static buffers, copied in place
    dirty padding rows write into live KV          corrupt    padding rows re-padded (scratch)
    stale node edit after re-instantiation         wrong      reinstantiate() invalidates plans

"wrong": silently wrong outputs; "corrupt": another request's state changes; "crash": capture
fails (loudly, which is the good case).
"""

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


def test_stale_node_edit_after_reinstantiation_and_the_runner_reapplies_it():
    """Exact mode edits the exec's attention nodes; a fresh exec from ``instantiate()`` starts
    from the captured split count again. A plan that believed its edits still applied would
    skip the push and replay the wrong geometry; ``runner.reinstantiate()`` invalidates the
    plans so the next replay pushes every edit again, bit-identical to eager."""
    from stepgraph.bench.workload import Point, decode_batch, fill_kv_random
    from stepgraph.model import ModelRunner

    mr = ModelRunner.from_preset(
        "llama-3.2-1b", "cuda", torch.bfloat16, seed=5, num_layers=2, max_bs=1,
        max_context_len=4096,
    )  # fmt: skip
    fill_kv_random(mr, seed=6)
    runner = CudaGraphRunner(mr, RunnerConfig(capture_bs=(1,), mode="exact", show_progress=False))
    batch, pages = decode_batch(mr, Point(bs=1, context=700), seed=7)
    want = mr.forward(batch).clone()
    got = runner.replay(batch).clone()
    first = runner.stats.node_edits
    assert first > 0 and torch.equal(got, want)  # 700 keys: fewer splits than the bucket's
    assert runner.replay(batch) is not None and runner.stats.node_edits == first  # no re-push
    runner.reinstantiate()  # a fresh exec: every edit is gone
    assert all(m.ns is None for m in runner._plans[1].mains)  # ... and the plan knows it
    got = runner.replay(batch).clone()
    assert runner.stats.node_edits == 2 * first  # every node pushed again
    assert torch.equal(got, want)
    for p in pages:
        mr.kv_cache.release(p)
    runner.shutdown()
