"""The capture ledger (seconds and MiB per bucket) and the shared output rows, on the CPU."""

from __future__ import annotations

import torch

from stepgraph.backends import CpuGraphBackend
from stepgraph.model.model_runner import ModelRunner
from stepgraph.runner import CudaGraphRunner, RunnerConfig
from stepgraph.runner.shared_output import takes_out
from stepgraph.toy_model import ToyModelRunner


class FakeAllocatorBackend(CpuGraphBackend):
    """The CPU stand-in with a scripted allocator: each capture grows the pool by its bucket's
    bytes, the first warm-up leaves ``outside`` bytes live outside it."""

    def __init__(self, device, pool, per_row: int, outside: int) -> None:
        super().__init__(device, pool)
        self.reserved = 1000  # bytes held before capture, by someone else
        self.pool_total = 0
        self.per_row, self.outside = per_row, outside
        self._warm = False

    def warmup(self, fn, iters):
        super().warmup(fn, iters)
        if not self._warm:
            self._warm, self.reserved = True, self.reserved + self.outside

    def pool_mark(self) -> int:
        return self.reserved

    def held_bytes(self) -> int:
        return self.reserved

    def pool_held_bytes(self) -> int:
        return self.pool_total

    def capture(self, fn, *, key):
        graph = super().capture(fn, key=key)
        grow = self.per_row * key if not self.capture_order[:-1] else self.per_row  # largest first
        self.reserved += grow
        self.pool_total += grow
        return graph


def test_ledger_sums_to_the_pool_total():
    mr = ToyModelRunner(num_pages=160, seed=3)
    runner = CudaGraphRunner(mr, RunnerConfig(max_bs=16, show_progress=False), capture=False)
    fake = FakeAllocatorBackend(runner.device, runner.pool, per_row=2**20, outside=5 * 2**20)
    runner._backend = fake
    stats = runner.capture()
    rows = stats.ledger()
    assert [r["bs"] for r in rows] == [16, 8, 4, 2, 1]
    assert sum(b.pool_bytes for b in stats.buckets) == stats.pool_bytes == fake.pool_total
    assert stats.pool_held_bytes == stats.pool_bytes
    assert rows[0]["pool_mib"] == 16 and all(r["pool_mib"] == 1 for r in rows[1:])
    assert stats.outside_bytes == 5 * 2**20 and rows[0]["outside_mib"] == 5
    assert all(r["seconds"] >= 0 for r in rows)
    table = stats.ledger_table()
    assert table.splitlines()[-1].split()[0] == "total" and len(table.splitlines()) == 7


def test_model_runner_writes_logits_into_one_shared_buffer():
    mr = ModelRunner.from_preset("tiny", "cpu", torch.float32, seed=5, max_bs=8, max_context_len=64)
    assert takes_out(mr.forward) and not takes_out(ToyModelRunner(num_pages=8).forward)
    runner = CudaGraphRunner(mr, RunnerConfig(max_bs=8, show_progress=False))
    base = runner.output_buffers[8]
    for bs, out in runner.output_buffers.items():
        assert out.shape == (bs, mr.config.vocab_size) and out.dtype == torch.float32
        assert out.data_ptr() == base.data_ptr()  # views of one buffer
        assert out._base is base._base and base._base is not None
    pages = [mr.kv_cache.reserve(8) for _ in range(3)]
    batch = mr.decode_batch([5, 6, 7], [3, 4, 5], pages)
    want = mr.forward(batch).clone()  # eager: a fresh tensor
    got = runner.replay(batch)
    assert got.data_ptr() == base.data_ptr()
    torch.testing.assert_close(got, want)


def test_runners_sharing_a_pool_share_one_capture_stream(monkeypatch):
    """The allocator reuses a freed block only on its own stream: every capture into one pool
    must run on one stream, whichever runner (and GraphPool object) it comes from."""
    from stepgraph import graph_pool

    made = []

    class FakeStream:
        def __init__(self, device):
            made.append(device)

    monkeypatch.setattr(graph_pool.torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(graph_pool, "_CAPTURE_STREAMS", {})
    cpu = torch.device("cpu")
    first = graph_pool.GraphPool()
    same = graph_pool.GraphPool(first.get_or_create(cpu))  # another runner, the same handle
    other = graph_pool.GraphPool()
    assert first.capture_stream(cpu) is same.capture_stream(cpu)
    assert other.capture_stream(cpu) is not first.capture_stream(cpu)
    assert len(made) == 2


def test_ledger_counts_a_first_use_compile_in_the_warm_up_of_its_bucket():
    """A step whose first call is slow (a kernel compiled on first use) shows in the warm-up
    seconds of the first bucket captured, and nowhere else: a capture's seconds split into what
    compiles and what captures."""
    import time

    mr = ToyModelRunner(num_pages=160, seed=3)
    forward, calls = mr.forward, []

    def compiling_forward(batch):
        if not calls:
            time.sleep(0.2)  # the first use compiles
        calls.append(1)
        return forward(batch)

    mr.forward = compiling_forward
    stats = CudaGraphRunner(mr, RunnerConfig(max_bs=4, show_progress=False)).stats.capture
    first, *rest = stats.buckets
    assert first.bs == 4 and 0.2 <= first.warmup_seconds <= first.seconds
    assert all(b.warmup_seconds < 0.2 for b in rest)
    assert stats.warmup_seconds == sum(b.warmup_seconds for b in stats.buckets)
    assert stats.ledger()[0]["warmup_seconds"] >= 0.2
    assert "warm-up" in stats.ledger_table().splitlines()[0]


def test_ledger_splits_a_capture_into_its_phases():
    """Each bucket's seconds split into the first eager run, the later ones, the recording and
    the rest; a slow first run (0.3 s), a slow second run (0.1 s) and a slow captured run
    (0.2 s) land in their own phase, and the phases add up to the capture's seconds."""
    import time

    mr = ToyModelRunner(num_pages=160, seed=3)
    forward, calls = mr.forward, []
    naps = {0: 0.3, 1: 0.1, 2: 0.2}  # the largest bucket's two warm-ups, then its capture

    def slow_forward(batch):
        time.sleep(naps.get(len(calls), 0.0))
        calls.append(1)
        return forward(batch)

    mr.forward = slow_forward
    cfg = RunnerConfig(max_bs=4, show_progress=False, warmup_until_settled=False)
    stats = CudaGraphRunner(mr, cfg).stats.capture
    first, *rest = stats.buckets
    assert first.bs == 4
    assert 0.3 <= first.first_warmup_seconds < 0.5
    assert 0.1 <= first.warmup_seconds - first.first_warmup_seconds < 0.3
    assert 0.2 <= first.record_seconds < first.seconds - first.warmup_seconds + 1e-9
    assert first.plan_seconds == 0.0  # mode graph: no plan
    assert all(b.first_warmup_seconds < 0.1 and b.record_seconds < 0.1 for b in rest)
    phases = stats.phases()
    assert abs(sum(phases.values()) - stats.seconds) < 1e-9
    assert phases["first_warmup"] >= 0.3 and phases["later_warmups"] >= 0.1
    assert phases["record"] >= 0.2 and phases["other"] >= 0.0
    row = stats.ledger()[0]
    assert row["first_warmup_seconds"] >= 0.3 and row["record_seconds"] >= 0.2


def test_kernel_variants_first_used_in_the_capture_show_while_it_runs(capsys):
    """A compile during the warm-ups (Triton's post-compile hook, as a cold first bucket fires
    it for each variant) shows in the progress bar as it happens and is counted in the stats;
    the hook set before the capture is called too, and restored after it."""
    from types import SimpleNamespace

    from triton import knobs

    seen = []

    def previous(**kwargs):  # a hook of the caller's, set before the capture
        seen.append(kwargs["fn"].name)

    knobs.runtime.jit_post_compile_hook, before = previous, knobs.runtime.jit_post_compile_hook
    try:
        mr = ToyModelRunner(num_pages=160, seed=3)
        forward, calls = mr.forward, []

        def compiling_forward(batch):
            if len(calls) < 2:  # two variants on first use, in the first bucket's warm-up
                info = SimpleNamespace(module="toy", name=f"kernel{len(calls)}", jit_function=None)
                knobs.runtime.jit_post_compile_hook(fn=info)
            calls.append(1)
            return forward(batch)

        mr.forward = compiling_forward
        runner = CudaGraphRunner(mr, RunnerConfig(max_bs=4, show_progress=True))
        assert knobs.runtime.jit_post_compile_hook is previous  # restored
    finally:
        knobs.runtime.jit_post_compile_hook = before
    stats = runner.stats.capture
    assert stats.kernel_variants == 2 and seen == ["kernel0", "kernel1"]
    assert stats.summary().endswith(", 2 kernel variants first used")
    err = capsys.readouterr().err
    assert "kernels=1" in err and "kernels=2" in err
    again = CudaGraphRunner(mr, RunnerConfig(max_bs=4, show_progress=False)).stats.capture
    assert again.kernel_variants == 0 and "kernel variant" not in again.summary()
