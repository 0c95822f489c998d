"""ConfigGraphRunner on the CPU stand-in: key selection, padding, chunking, every error path.

The reference is always the model's own eager call on the unpadded live requests."""

from __future__ import annotations

import pytest
import torch

from stepgraph.configs import CU_SEQLENS, BatchedCudaGraphConfig, PackedCudaGraphConfig
from stepgraph.configs.forward_runner import ConfigGraphRunner, GraphKey
from stepgraph.errors import CaptureError, ConfigError, ReplayError

D, VOCAB = 8, 11


class ToyModel(torch.nn.Module):
    """``forward_batched(walk=, inputs=)``: a per-token MLP plus a per-request mean over the
    request's tokens (found through ``cu_seqlens`` without a host sync when packed)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.emb = torch.nn.Parameter(torch.randn(VOCAB, D, generator=g))
        self.w = torch.nn.Parameter(torch.randn(D, D, generator=g) / D**0.5)
        self.calls: list[tuple[str, int]] = []  # (walk, rows) of each call
        self.mode = "ok"

    @torch.no_grad()
    def forward_batched(self, *, walk: str, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        h = inputs["h"] + self.emb[inputs["ids"]]  # [bs, k, D] or [T, D]
        self.calls.append((walk, h.shape[0]))
        if self.mode == "sync":
            _ = float(h.sum())
        if self.mode == "alias":
            return inputs["h"]
        y = torch.tanh(h @ self.w)
        if CU_SEQLENS not in inputs:  # batched: mean over the request's k tokens
            return y + y.mean(dim=1, keepdim=True)
        cu = inputs[CU_SEQLENS]  # [bs + 1] int32
        seg = torch.searchsorted(cu[1:], torch.arange(y.shape[0]), right=True)  # [T]
        sums = torch.zeros(cu.shape[0] - 1, D).index_add_(0, seg, y)
        counts = (cu[1:] - cu[:-1]).clamp(min=1).unsqueeze(1)
        return y + (sums / counts)[seg]


def rand_req(n: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    return {"ids": torch.randint(0, VOCAB, (n,), generator=g), "h": torch.randn(n, D, generator=g)}


def pad_req(n: int) -> dict[str, torch.Tensor]:
    # Huge padding values: any leak into a real request's output would show.
    return {"ids": torch.zeros(n, dtype=torch.int64), "h": torch.full((n, D), 1e4)}


def batched_cfg(**kw) -> BatchedCudaGraphConfig:
    single = {"ids": torch.zeros(2, dtype=torch.int64), "h": torch.full((2, D), 1e4)}
    kw.setdefault("capture_batch_sizes", [1, 2, 4])
    return BatchedCudaGraphConfig("decode", single, total_tokens_multiplier=2, **kw)


def packed_cfg(**kw) -> PackedCudaGraphConfig:
    kw.setdefault("capture_batch_sizes", [1, 2, 4])
    return PackedCudaGraphConfig("prefill", [4, 8, 16], pad_req, **kw)


def eager(model, walk, cfg, reqs):
    return model.forward_batched(walk=walk, inputs=cfg.model_inputs(reqs)).clone()


def poison(runner):
    for graph in runner.graphs.values():
        graph.output.fill_(float("nan"))


@pytest.fixture
def model():
    torch.manual_seed(78)  # some tests draw their inputs from the global generator
    return ToyModel(seed=77)


def make(model, *cfgs, **kw):
    return ConfigGraphRunner(model, list(cfgs), device="cpu", show_progress=False, **kw)


def test_batched_keys_capture_order_and_replay_equals_eager(model):
    cfg = batched_cfg(replay_graph_walks=["verify"])
    runner = make(model, cfg)
    assert runner.keys[0] == [GraphKey("decode", b, 2 * b, None) for b in (1, 2, 4)]
    assert runner.capture_order == [GraphKey("decode", b, 2 * b, None) for b in (4, 2, 1)]
    assert not runner.compile_enabled  # the stand-in skips torch.compile
    g = torch.Generator().manual_seed(0)
    for bs in (1, 2, 3, 4):
        reqs = [rand_req(2, g) for _ in range(bs)]
        want = eager(model, "decode", cfg, reqs)
        poison(runner)
        got = runner.run("decode", reqs)
        assert got.shape == (bs, 2, D) and got.abs().sum() > 0
        torch.testing.assert_close(got, want)
        bucket = {1: 1, 2: 2, 3: 4, 4: 4}[bs]
        assert (
            got.data_ptr()
            == runner.graphs[GraphKey("decode", bucket, 2 * bucket, None)].output.data_ptr()
        )
    # A replay walk replays the same graphs.
    reqs = [rand_req(2, g) for _ in range(3)]
    before = runner.graphs[GraphKey("decode", 4, 8, None)].replays
    torch.testing.assert_close(runner.run("verify", reqs), eager(model, "verify", cfg, reqs))
    assert runner.graphs[GraphKey("decode", 4, 8, None)].replays == before + 1
    assert runner.stats.replays == 5 and runner.stats.eager_calls == 0


def test_packed_key_selection_padding_and_outputs(model):
    cfg = packed_cfg()
    runner = make(model, cfg)
    assert (4, 4) in {(k.bs, k.total_tokens) for k in runner.keys[0]}
    assert all(k.total_tokens >= k.bs for k in runner.keys[0])
    g = torch.Generator().manual_seed(1)
    cases = {  # lengths -> (bs, total) of the smallest key holding them (tokens, then bs)
        (3,): (1, 4),  # the spare slot takes the leftover token
        (4,): (1, 4),
        (4, 4): (2, 8),  # exactly on the bucket edge
        (3, 2): (2, 8),
        (4, 4, 1): (4, 16),  # one token past the 8-bucket
        (1, 1, 1, 1): (4, 4),
        (2, 2, 2, 1): (4, 8),  # the cases: a full bs-4 key with leftover tokens
        (3, 3, 3, 3): (4, 16),
        (5, 2, 1, 1): (4, 16),
        (2, 1, 1): (4, 4),  # a padded request and the spare, both empty
        (5, 6, 2): (4, 16),
    }
    for lens, (kbs, kt) in cases.items():
        reqs = [rand_req(n, g) for n in lens]
        want = eager(model, "prefill", cfg, reqs)
        poison(runner)
        graph = runner.graphs[GraphKey("prefill", kbs, kt, None)]
        n = graph.replays
        got = runner.run("prefill", reqs)
        assert graph.replays == n + 1, f"{lens} did not replay key ({kbs}, {kt})"
        assert got.shape == (sum(lens), D) and not got.isnan().any()
        torch.testing.assert_close(got, want)
    assert runner.stats.eager_calls == 0


def test_batched_above_largest_bucket_runs_eagerly_in_chunks(model):
    cfg = batched_cfg()
    runner = make(model, cfg)
    g = torch.Generator().manual_seed(2)
    reqs = [rand_req(2, g) for _ in range(9)]
    want = eager(model, "decode", cfg, reqs)
    model.calls.clear()
    torch.testing.assert_close(runner.run("decode", reqs), want)
    assert [rows for _, rows in model.calls] == [4, 4, 1]  # chunks no larger than bucket 4
    assert runner.stats.eager_calls == 3 and runner.stats.eager_reasons["too_large"] == 1
    whole = make(model, batched_cfg(caps_eager_batch_size=False))
    model.calls.clear()
    torch.testing.assert_close(whole.run("decode", reqs), want)
    assert [rows for _, rows in model.calls] == [9]


def test_packed_above_token_bucket_chunks_or_runs_whole(model):
    g = torch.Generator().manual_seed(3)
    reqs = [rand_req(n, g) for n in (7, 6, 5, 3)]  # 21 tokens > 16
    cfg = packed_cfg()
    runner = make(model, cfg)
    want = eager(model, "prefill", cfg, reqs)
    model.calls.clear()
    torch.testing.assert_close(runner.run("prefill", reqs), want)
    assert [rows for _, rows in model.calls] == [13, 8]  # <= 16 tokens per chunk
    # caps_eager_batch_size=False: as its docstring says, the batch runs eagerly whole
    whole = make(model, packed_cfg(caps_eager_batch_size=False))
    model.calls.clear()
    torch.testing.assert_close(whole.run("prefill", reqs), want)
    assert [rows for _, rows in model.calls] == [21]
    assert whole.stats.eager_calls == 1 and whole.stats.eager_reasons["too_large"] == 1
    ok = [rand_req(n, g) for n in (2, 3)]
    torch.testing.assert_close(whole.run("prefill", ok), eager(model, "prefill", cfg, ok))
    assert whole.stats.replays == 1


def test_bad_requests_raise_before_copy_and_runner_stays_usable(model):
    cfg = packed_cfg()
    runner = make(model, cfg, batched_cfg())
    g = torch.Generator().manual_seed(4)
    good = [rand_req(3, g), rand_req(2, g)]
    with pytest.raises(ConfigError, match=r"walk 'nope'.*known walks: \['decode', 'prefill'\]"):
        runner.run("nope", good)
    bad = [good[0], {"ids": good[1]["ids"], "x": good[1]["h"]}]
    with pytest.raises(ReplayError, match=r"request 1 has inputs \['ids', 'x'\]"):
        runner.run("prefill", bad)
    bad = [good[0], {"ids": good[1]["ids"], "h": torch.randn(2, D + 1)}]
    with pytest.raises(
        ReplayError, match=rf"'h' of request 1 has shape \(2, {D + 1}\).*\[n, {D}\]"
    ):
        runner.run("prefill", bad)
    bad = [{"ids": torch.zeros(2, dtype=torch.int64), "h": torch.randn(3, D)}]
    with pytest.raises(ReplayError, match="'ids' of request 0"):
        runner.run("prefill", bad)
    bad = [{"ids": torch.zeros(2, dtype=torch.int64), "h": torch.randn(2, D).double()}]
    with pytest.raises(ReplayError, match="float64"):
        runner.run("prefill", bad)
    d = [{"ids": torch.zeros(3, dtype=torch.int64), "h": torch.randn(3, D)}]
    with pytest.raises(ReplayError, match=r"'ids' of request 0 has shape \(3,\).*\[2\]"):
        runner.run("decode", d)
    with pytest.raises(ReplayError, match="empty batch"):
        runner.run("decode", [])
    torch.testing.assert_close(runner.run("prefill", good), eager(model, "prefill", cfg, good))


def test_capture_errors_are_clear_and_leave_nothing_behind(model):
    model.mode = "sync"
    runner = make(model, batched_cfg(), capture=False)
    with pytest.raises(CaptureError, match=r"decode.*host") as info:
        runner.capture()
    assert "_local_scalar_dense" in str(info.value.__cause__)
    assert runner.graphs == {}
    model.mode = "alias"
    with pytest.raises(CaptureError, match="static inputs.*clone"):
        runner.capture()
    assert runner.graphs == {}
    model.mode = "ok"  # fixed: the same runner captures and runs
    runner.capture()
    reqs = [rand_req(2, torch.Generator().manual_seed(5))]
    torch.testing.assert_close(
        runner.run("decode", reqs), eager(model, "decode", batched_cfg(), reqs)
    )


def test_config_conflicts_and_shutdown(model):
    with pytest.raises(ConfigError, match="served by two configs"):
        make(model, batched_cfg(), batched_cfg(), capture=False)
    make(model, batched_cfg(), batched_cfg(additional_key_info="lora"), capture=False)
    with pytest.raises(ConfigError, match="no method 'forward_packed'"):
        make(model, batched_cfg(capture_forward_method="forward_packed"))
    with pytest.raises(ConfigError, match="no graph"):
        make(model, PackedCudaGraphConfig("p", [2], pad_req, capture_batch_sizes=[4]))
    runner = make(model, batched_cfg())
    runner.shutdown()
    assert runner.graphs == {}
    with pytest.raises(ReplayError, match="after shutdown"):
        runner.run("decode", [rand_req(2, torch.Generator())])
