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
    from tests.toy_variants import batch_of, check_kv, post_toy, replay_checked

    x = torch.randn(64, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    state = {"scale": 2.0}
    g, out = capture(lambda: x * state["scale"])
    state["scale"] = 5.0  # the graph does not see this: the scalar was baked into the kernel
    g.replay()
    torch.testing.assert_close(out, x * 2.0)
    # Through a runner: a forward that reads a Python float keeps its capture-time value.
    mr = post_toy(seed=11)
    mr.post = lambda y: y * state["scale"]
    state["scale"] = 2.0
    runner = CudaGraphRunner(mr, RunnerConfig(max_bs=8, show_progress=False))
    batch = batch_of(mr, 5, seed=12)
    frozen, frozen_state = mr.eager_reference(batch)  # what the graph baked in: scale 2
    state["scale"] = 5.0
    live, _ = mr.eager_reference(batch)
    got = runner.replay(batch).clone()
    torch.testing.assert_close(got, frozen, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(got, live, rtol=1e-2, atol=1e-2)  # the update was lost
    check_kv(mr, frozen_state)
    runner.shutdown()
    # The fix: the value lives in a device tensor, written in place; replay follows it.
    scale = torch.tensor(2.0, device="cuda")
    mr.post = lambda y: y * scale
    runner = CudaGraphRunner(mr, RunnerConfig(max_bs=8, show_progress=False))
    scale.fill_(5.0)
    replay_checked(runner, mr, batch_of(mr, 3, seed=13))
    runner.shutdown()


def test_host_side_branches_are_frozen_at_capture():
    from tests.toy_variants import batch_of, check_kv, post_toy, replay_checked

    x = torch.randn(8, device="cuda", generator=torch.Generator("cuda").manual_seed(2))
    flags = {"double": True}
    g, out = capture(lambda: x * 2 if flags["double"] else x * 3)
    flags["double"] = False  # the branch was taken on the host, once, at capture
    g.replay()
    torch.testing.assert_close(out, x * 2)
    # Through a runner: the branch the forward took at capture is the one every replay takes.
    mr = post_toy(seed=21)
    flags["double"] = True
    mr.post = lambda y: y * 2 if flags["double"] else -y
    runner = CudaGraphRunner(mr, RunnerConfig(max_bs=8, show_progress=False))
    batch = batch_of(mr, 7, seed=22)
    taken, taken_state = mr.eager_reference(batch)
    flags["double"] = False
    got = runner.replay(batch).clone()
    torch.testing.assert_close(got, taken, rtol=1e-4, atol=1e-4)
    check_kv(mr, taken_state)
    runner.shutdown()
    # The fix: branch on static shapes only, or keep both paths in the graph and select with a
    # device tensor.
    sign = torch.tensor(2.0, device="cuda")
    mr.post = lambda y: torch.where(sign > 0, y * 2, -y)
    runner = CudaGraphRunner(mr, RunnerConfig(max_bs=8, show_progress=False))
    sign.fill_(-1.0)
    replay_checked(runner, mr, batch_of(mr, 2, seed=23))
    runner.shutdown()


def test_building_device_tensors_from_host_data_fails_capture():
    import pytest

    from stepgraph.errors import CaptureError
    from tests.toy_variants import batch_of, post_toy, replay_checked

    x = torch.randn(8, device="cuda", generator=torch.Generator("cuda").manual_seed(3))
    with pytest.raises(RuntimeError, match="pinned|capture"):
        capture(lambda: x * torch.tensor([3.0], device="cuda"))
    # Through a runner: the capture fails loudly, naming the bucket and the escape hatch.
    mr = post_toy(seed=31)
    mr.post = lambda y: y * torch.tensor([3.0], device=y.device)
    with pytest.raises(CaptureError, match=r"(?s)batch size 8\b.*eagerly"):
        CudaGraphRunner(mr, RunnerConfig(max_bs=8, show_progress=False))
    # The fix: build the tensor once, outside the captured call.
    three = torch.tensor([3.0], device="cuda")
    mr.post = lambda y: y * three
    runner = CudaGraphRunner(mr, RunnerConfig(max_bs=8, show_progress=False))
    for bs, seed in [(8, 32), (3, 33)]:
        replay_checked(runner, mr, batch_of(mr, bs, seed))
    runner.shutdown()


def test_output_is_overwritten_by_the_next_replay():
    from tests.toy_variants import batch_of, post_toy, replay_checked

    gen = torch.Generator("cuda").manual_seed(4)
    x = torch.randn(16, device="cuda", generator=gen)
    g, out = capture(lambda: x + 1)
    g.replay()
    first = out  # not a copy: a view of the graph's static output
    x.copy_(torch.randn(16, device="cuda", generator=gen))
    g.replay()
    torch.testing.assert_close(first, x + 1)
    # Through a runner: the logits of one step are overwritten by the next replay (same bucket
    # or not), so consume them (sample, or clone) first.
    mr = post_toy(seed=41)
    runner = CudaGraphRunner(mr, RunnerConfig(max_bs=8, show_progress=False))
    a = replay_checked(runner, mr, batch_of(mr, 3, seed=42))
    kept = a.clone()
    b_batch = batch_of(mr, 4, seed=43)
    b = replay_checked(runner, mr, b_batch)
    torch.testing.assert_close(a, b[:3])  # a's rows now hold b's logits
    assert not torch.allclose(kept, b[:3])
    runner.shutdown()


def test_inputs_must_be_written_in_place_not_rebound():
    from tests.toy_variants import batch_of, post_toy, replay_checked

    gen = torch.Generator("cuda").manual_seed(5)
    x = torch.randn(16, device="cuda", generator=gen)
    holder = {"x": x}
    g, out = capture(lambda: holder["x"] * 3)
    holder["x"] = torch.randn(16, device="cuda", generator=gen)  # the graph reads old memory
    g.replay()
    torch.testing.assert_close(out, x * 3)
    # Through a runner: every step hands a new batch (new tensors); the runner copies it into
    # its static buffers in place, so each replay follows it.
    mr = post_toy(seed=51)
    runner = CudaGraphRunner(mr, RunnerConfig(max_bs=8, show_progress=False))
    static = {k: v.data_ptr() for k, v in runner.buffers.view(8).device_tensors().items()}
    for bs, seed in [(5, 52), (5, 53), (8, 54), (2, 55)]:
        batch = batch_of(mr, bs, seed)  # fresh tensors: "rebound" from the graph's view
        replay_checked(runner, mr, batch)
        now = {k: v.data_ptr() for k, v in runner.buffers.view(8).device_tensors().items()}
        assert now == static  # written in place, never rebound
    runner.shutdown()


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
        "llama-3.2-1b",
        "cuda",
        torch.bfloat16,
        seed=5,
        num_layers=2,
        max_bs=1,
        max_context_len=4096,
    )
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
