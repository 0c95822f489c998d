from __future__ import annotations

import torch

from stepgraph.batch import PACKED, pack_batch, unpacked_batch
from stepgraph.toy_model import ToyModelRunner


def test_pack_then_unpack_round_trips_every_field():
    mr = ToyModelRunner(num_pages=64)
    batch = mr.random_batch(5, torch.Generator().manual_seed(3))
    packed = pack_batch(batch)
    assert packed.dtype is torch.int64
    assert packed.shape == (5, PACKED.width(mr.max_pages_per_request))
    for copy in (True, False):
        back = unpacked_batch(packed, batch.seq_lens_cpu, copy=copy)
        for name, t in batch.device_tensors().items():
            got = getattr(back, name)
            assert got.dtype is t.dtype, name
            assert torch.equal(got, t), (name, copy)
        assert back.packed is packed
