"""Tensor parallelism on two GPUs over NCCL: ``tp_worker.py`` under ``torchrun
--nproc-per-node 2`` decodes 32 greedy tokens of 3 requests in float32, unsharded (TP=1) and at
TP=2 eagerly and through the ``CudaGraphRunner`` (modes "graph" and "exact"). The tokens must
be identical everywhere, and every rank must capture the same buckets in the same order
(collectives in a graph pair up across ranks only if they do)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs 2 GPUs (torchrun --nproc-per-node 2)"
)

TOKENS = 32
TIMEOUT_S = 400  # per torchrun launch; a hung collective fails the test instead of the job


def _worker():
    path = Path(__file__).with_name("tp_worker.py")
    spec = importlib.util.spec_from_file_location("tp_worker", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# "tiny": 2 KV heads split one per rank; "kv1": 1 KV head replicated on both ranks.
@pytest.fixture(scope="module", params=[(), ("--kv-heads", "1")], ids=["tiny", "kv1"])
def ranks(request, tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("tp-gpu")
    return _worker().launch(out, "--tokens", str(TOKENS), *request.param, timeout_s=TIMEOUT_S)


def test_no_mode_raised(ranks):
    assert [r["errors"] for r in ranks] == [{}, {}]


@pytest.mark.parametrize("mode", ["eager", "graph", "exact"])
def test_tp2_greedy_tokens_equal_tp1(ranks, mode):
    want = ranks[0]["tp1"]
    assert [len(t) for t in want] == [TOKENS] * 3
    for r in ranks:
        assert mode in r, r["errors"].get(mode)
        assert r["tp1"] == want  # every rank built the same model
        assert r[mode] == want


@pytest.mark.parametrize("mode", ["graph", "exact"])
def test_graph_modes_replayed_every_decode_step(ranks, mode):
    for r in ranks:
        assert r[f"{mode}_graph_steps"] == TOKENS - 1


def test_capture_order_is_identical_across_ranks(ranks):
    first = ranks[0]["capture_order"]
    assert first["graph"] == [4, 2, 1] and first["exact"] == [4, 2, 1]
    assert all(r["capture_order"] == first for r in ranks)
