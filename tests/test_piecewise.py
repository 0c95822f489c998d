"""PiecewiseRunner on the CPU stand-in: a region that reads the declared step, padding that never
reaches a real output, leasing, kwargs, and every error path.

The reference is an eager per-request loop over the live, unpadded inputs."""

from __future__ import annotations

import pytest
import torch

from stepgraph.configs import (
    PiecewiseBatchedConfig,
    PiecewiseCallInputs,
    PiecewiseCaptureShape,
    PiecewisePackedConfig,
    PiecewiseRunner,
)
from stepgraph.errors import CaptureError, ConfigError, ReplayError

D = 6


class Region:
    """An MLP per token plus a per-request sum whose segments come from the declared step's
    ``lens`` [bs] int32 (no host sync: searchsorted + index_add). ``mode`` breaks it on purpose."""

    def __init__(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.w = torch.randn(D, D, generator=g) / D**0.5
        self.mode = "ok"
        self.kwargs_seen: list[dict] = []

    def __call__(self, ci: PiecewiseCallInputs) -> dict[str, torch.Tensor]:
        self.kwargs_seen.append(ci.kwargs)
        x = ci.static_inputs["x"]
        if self.mode == "non_tensor":
            return {"y": 3.0}
        if self.mode == "alias":
            return {"y": x}
        if self.mode == "weight":
            return {"y": self.w}
        scale = ci.kwargs["scale"]
        lens = ci.resources["lens"]  # [bs] int32, written in place by declare_step
        if x.dim() == 3:  # batched [bs, seq_len, D]: mask positions >= len
            y = torch.tanh(x @ self.w) * scale
            mask = torch.arange(x.shape[1]) < lens.unsqueeze(1)  # [bs, seq_len]
            return {"y": y, "pooled": (y * mask.unsqueeze(2)).sum(1)}
        y = torch.tanh(x @ self.w) * scale  # packed [T, D]
        seg = torch.searchsorted(lens.cumsum(0), torch.arange(x.shape[0]), right=True)
        return {"y": y, "pooled": torch.zeros(lens.shape[0], D).index_add_(0, seg, y)}

    def reference(self, x: torch.Tensor, lens: list[int], scale: float, batched: bool):
        y = torch.tanh(x @ self.w) * scale
        if batched:
            return y, torch.stack([y[b, :n].sum(0) for b, n in enumerate(lens)])
        parts = torch.split(y, lens)
        return y, torch.stack([p.sum(0) for p in parts])


class Steps:
    """declare_step backed by persistent per-bs buffers, or (leased) by the static 'lens' input."""

    def __init__(self) -> None:
        self.bufs: dict[int, torch.Tensor] = {}
        self.runner: PiecewiseRunner | None = None
        self.declared: list[tuple[list[str], list[int]]] = []

    def own(self, names: list[str], seq_lens: list[int]) -> dict[str, torch.Tensor]:
        self.declared.append((names, seq_lens))
        buf = self.bufs.setdefault(len(seq_lens), torch.zeros(len(seq_lens), dtype=torch.int32))
        buf.copy_(torch.tensor(seq_lens, dtype=torch.int32))
        return {"lens": buf}

    def leased(self, names: list[str], seq_lens: list[int]) -> dict[str, torch.Tensor]:
        self.declared.append((names, seq_lens))
        lens = self.runner.active_lease.buffers["lens"]
        lens.copy_(torch.tensor(seq_lens, dtype=torch.int32))
        return {"lens": lens}


def packed_static(shape: PiecewiseCaptureShape) -> dict[str, torch.Tensor]:
    return {"x": torch.zeros(shape.total_tokens, D)}


def leased_static(shape: PiecewiseCaptureShape) -> dict[str, torch.Tensor]:
    return {
        "x": torch.zeros(shape.total_tokens, D),
        "lens": torch.zeros(shape.num_requests, dtype=torch.int32),  # bs + the spare slot
    }


@pytest.fixture
def region():
    return Region(seed=94)


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(95)  # the tests below draw their inputs from the global generator


def packed_runner(region, steps, *, lease=False, **kw):
    cfg = PiecewisePackedConfig(
        capture_fn=region,
        make_static_inputs=leased_static if lease else packed_static,
        declare_step=steps.leased if lease else steps.own,
        lease_before_step=lease,
        forward_kwargs={"scale": 0.5},
        total_tokens=[4, 8, 16],
    )
    runner = PiecewiseRunner(cfg, device="cpu", batch_sizes=[1, 2, 4], capture=False, **kw)
    steps.runner = runner
    runner.capture()
    return runner


def poison(runner):
    for out in runner.outputs.values():
        for t in out.values():
            t.fill_(float("nan"))


@pytest.mark.parametrize("lease", [False, True])
def test_packed_replay_equals_eager_with_padding(region, lease):
    steps = Steps()
    runner = packed_runner(region, steps, lease=lease)
    assert runner.capture_order[0] == (4, 16)  # largest first
    assert (4, 4) in runner.graphs and (8, 4) not in runner.graphs  # total < bs is skipped
    g = torch.Generator().manual_seed(0)
    cases = {  # lengths -> the smallest (bs, total) holding them: tokens first, then bs
        (3,): (1, 4),
        (4, 4): (2, 8),
        (3, 2): (2, 8),
        (4, 4, 1): (4, 16),
        (7, 1, 5): (4, 16),
        (1, 1, 1, 1): (4, 4),
        (2, 2, 2, 1): (4, 8),
        (5, 2, 1, 1): (4, 16),
    }
    for lens, key in cases.items():
        x = torch.randn(sum(lens), D, generator=g)
        want_y, want_pooled = region.reference(x, list(lens), 0.5, batched=False)
        poison(runner)
        replays = runner.graphs[key].replays
        out = runner.replay({"x": x}, list(lens))
        assert runner.graphs[key].replays == replays + 1, f"{lens} should replay {key}"
        assert out["y"].shape == (sum(lens), D) and out["pooled"].shape == (len(lens), D)
        assert out["pooled"].abs().sum() > 0
        torch.testing.assert_close(out["y"], want_y)
        torch.testing.assert_close(out["pooled"], want_pooled)
        # The declared step carries the padded lengths: real ones, then padded requests and the
        # spare slot, which together fill the shape's tokens.
        names, declared = steps.declared[-1]
        assert declared[: len(lens)] == list(lens) and sum(declared) == key[1]
        assert runner.last_call.resources["lens"].tolist() == declared
        runner.outputs[key]["y"].fill_(7.0)  # what is returned is a view of the static output
        assert out["y"].eq(7.0).all()
    assert steps.declared[-1][1] == [5, 2, 1, 1, 7]  # the last case: 4 real + the spare
    assert runner._leases == {}  # every lease released
    assert all(kw == {"scale": 0.5} for kw in region.kwargs_seen)


def test_batched_replay_masks_by_declared_lengths(region):
    steps = Steps()
    cfg = PiecewiseBatchedConfig(
        capture_fn=region,
        make_static_inputs=lambda s: {"x": torch.zeros(s.bs, 5, D)},
        declare_step=steps.own,
        forward_kwargs={"scale": 2.0},
        capture_batch_sizes=[1, 4],
        seq_len=5,
    )
    runner = PiecewiseRunner(cfg, device="cpu")
    assert sorted(runner.graphs) == [(1, 5), (4, 20)]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 5, D, generator=g)
    want_y, want_pooled = region.reference(x, [2, 5, 1], 2.0, batched=True)
    poison(runner)
    out = runner.replay({"x": x}, [2, 5, 1])
    assert steps.declared[-1][1] == [2, 5, 1, 1]  # padded row declares length 1
    assert runner.static_inputs[(4, 20)]["x"][3].eq(0).all()  # padding rows zeroed
    torch.testing.assert_close(out["y"], want_y)
    torch.testing.assert_close(out["pooled"], want_pooled)
    out = runner.replay({"x": x[:1]})  # lengths default to seq_len
    torch.testing.assert_close(out["pooled"], region.reference(x[:1], [5], 2.0, True)[1])


def test_lease_blocks_a_second_lease_until_released(region):
    steps = Steps()
    runner = packed_runner(region, steps, lease=True)
    shape = next(s for s in runner.shapes if (s.bs, s.total_tokens) == (2, 8))
    lease = runner.lease(shape)
    assert lease.buffers["x"] is runner.static_inputs[(2, 8)]["x"]
    with pytest.raises(ReplayError, match=r"bs=2, total=8.*already leased.*release"):
        runner.lease(shape)
    x = torch.randn(8, D)
    with pytest.raises(ReplayError, match="already leased"):
        runner.replay({"x": x}, [4, 4])
    lease.release()
    out = runner.replay({"x": x}, [4, 4])
    torch.testing.assert_close(out["pooled"], region.reference(x, [4, 4], 0.5, False)[1])


def test_bad_live_inputs_raise_and_runner_stays_usable(region):
    runner = packed_runner(region, Steps())
    x = torch.randn(5, D)
    with pytest.raises(ReplayError, match=r"inputs \['z'\].*static inputs are \['x'\]"):
        runner.replay({"z": x}, [5])
    with pytest.raises(
        ReplayError, match=rf"'x' of the live batch has shape \(5, {D + 1}\).*\(16, {D}\)"
    ):
        runner.replay({"x": torch.randn(5, D + 1)}, [5])
    with pytest.raises(ReplayError, match="float64"):
        runner.replay({"x": x.double()}, [5])
    with pytest.raises(ReplayError, match="seq_lens summing to the 5"):
        runner.replay({"x": x}, [4])
    with pytest.raises(ReplayError, match="no captured shape holds 4 requests of 17"):
        runner.replay({"x": torch.randn(17, D)}, [5, 5, 5, 2])
    out = runner.replay({"x": x}, [2, 3])
    torch.testing.assert_close(out["pooled"], region.reference(x, [2, 3], 0.5, False)[1])


@pytest.mark.parametrize(
    "mode,match",
    [
        ("non_tensor", "output 'y' is a float"),
        ("alias", "'y' was not allocated by the captured call"),
        ("weight", "'y' was not allocated by the captured call"),
    ],
)
def test_bad_region_outputs_fail_capture_cleanly(region, mode, match):
    steps = Steps()
    region.mode = mode
    with pytest.raises(CaptureError, match=match):
        packed_runner(region, steps)
    region.mode = "ok"  # fixed: a new capture on a fresh runner works
    runner = packed_runner(region, steps)
    x = torch.randn(3, D)
    torch.testing.assert_close(
        runner.replay({"x": x}, [3])["y"], region.reference(x, [3], 0.5, 0)[0]
    )


def test_failed_capture_releases_and_recaptures(region):
    steps = Steps()
    runner = packed_runner(region, steps)
    region.mode = "alias"
    with pytest.raises(CaptureError):
        runner.capture()
    assert runner.graphs == {} and runner.outputs == {}
    region.mode = "ok"
    runner.capture()
    x = torch.randn(6, D)
    torch.testing.assert_close(
        runner.replay({"x": x}, [6])["y"], region.reference(x, [6], 0.5, 0)[0]
    )


def test_moved_step_resources_are_refused(region):
    steps = Steps()
    runner = packed_runner(region, steps)
    steps.bufs.clear()  # declare_step now returns new tensors: the graph would not see them
    with pytest.raises(ReplayError, match="same tensors, in place"):
        runner.replay({"x": torch.randn(3, D)}, [3])


def test_config_and_lifetime_errors(region):
    cfg = PiecewisePackedConfig(
        capture_fn=region, make_static_inputs=lambda s: {"x": 1}, total_tokens=[4]
    )
    with pytest.raises(ConfigError, match="make_static_inputs must return"):
        PiecewiseRunner(cfg, device="cpu")
    runner = packed_runner(region, Steps())
    runner.shutdown()
    with pytest.raises(ReplayError, match="after shutdown"):
        runner.replay({"x": torch.randn(2, D)}, [2])
