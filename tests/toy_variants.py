"""Toy model runners for the footgun catalogue: the toy's logits passed through ``post``, a
function the test sets (a Python constant, a host branch, a tensor built from host data...),
and a check of one replay against eager on logits and on the live KV pages."""

from __future__ import annotations

from collections.abc import Callable

import torch

from stepgraph.toy_model import ToyModelRunner


class PostToy(ToyModelRunner):
    """The toy model with ``post(logits)`` applied last (identity until a test sets it)."""

    post: Callable[[torch.Tensor], torch.Tensor] = staticmethod(lambda y: y)

    def forward(self, batch):
        return self.post(super().forward(batch))


def post_toy(device: str = "cuda", seed: int = 3) -> PostToy:
    return PostToy(
        hidden=32,
        num_layers=2,
        num_pages=200,
        page_size=16,
        max_pages_per_request=4,
        device=device,
        seed=seed,
    )


def batch_of(mr: ToyModelRunner, bs: int, seed: int):
    return mr.random_batch(bs, torch.Generator().manual_seed(seed))


def check_kv(mr: ToyModelRunner, want_state: list[torch.Tensor]) -> None:
    """Live pages equal eager's; page 0 is scratch (padded rows write there by design)."""
    for have, ref in zip(mr.kv, want_state):
        torch.testing.assert_close(have[mr.page_size :], ref[mr.page_size :], rtol=1e-4, atol=1e-4)


def replay_checked(runner, mr: ToyModelRunner, batch) -> torch.Tensor:
    """Replay ``batch``; assert logits and KV equal eager's (with ``post`` as it is now)."""
    want, want_state = mr.eager_reference(batch)
    got = runner.replay(batch)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    check_kv(mr, want_state)
    return got
