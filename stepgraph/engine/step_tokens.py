"""``StepTokens``: the tokens of a launched step, on the device, and the start of their copy to
the host (the engine's sampling phase). Greedy rows of a fused decode step take the argmax the
step already wrote (no sampling work at all); a batch with no request of its own sampling is
sampled in one call; only a batch with such requests goes row group by row group
(``requests.sample_rows``). The pinned host rows and events are reused (``HostRing``) and the
fused tokens are looked up once per batch size."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch

from .overlap import HostRing, InFlight
from .requests import Request, Sampling, sample_rows

_OWN_SAMPLING = operator.attrgetter("sampling")  # a request's own sampling, or None


class StepTokens:
    def __init__(self, model_runner: Any) -> None:
        self.model_runner = model_runner
        cuda = torch.device(model_runner.device).type == "cuda"
        self.ring = HostRing(max(model_runner.max_bs, 1)) if cuda else None
        self._fused_of: dict[tuple[int, Any], torch.Tensor | None] = {}

    def fused(self, bs: int) -> torch.Tensor | None:
        """``model_runner.fused_tokens(bs)`` (a pure function of ``bs`` and the set-up),
        looked up once per (bs, kernels)."""
        mr = self.model_runner
        key = (bs, getattr(mr, "kernels", None))
        if key not in self._fused_of:
            self._fused_of[key] = mr.fused_tokens(bs)
        return self._fused_of[key]

    def launch(
        self,
        logits: list[torch.Tensor],
        rows: Sequence[Request],
        decoding: int,
        sampling: Sampling,
        generator: torch.Generator | None,
        host: torch.Tensor | None = None,
    ) -> InFlight:
        """Sample ``rows`` (``logits``: the prefill's rows, then the ``decoding`` decode rows)
        and start the copy of their tokens to the host; nothing here waits for the device.
        ``host``: where the replay itself stores the feed on the host (the runner's token
        mirror), taken for the fused step's greedy tokens instead of a copy."""
        own = any(map(_OWN_SAMPLING, rows))  # one pass in C: no Python frame per row
        greedy = sampling.temperature <= 0 and not own
        fused = self.fused(decoding) if greedy and len(rows) == decoding else None
        if fused is not None:  # a static buffer: the next step reads it before its replay
            tokens = fused  # with ``host``, the graph stored them there already: no copy
        else:
            host = None  # sampled here: copied
            both = logits[0] if len(logits) == 1 else torch.cat(logits)
            if own:
                tokens = sample_rows(both, rows, sampling, generator)  # [n] int64, no sync
            else:
                tokens = sampling.sample(both, generator)  # the step's sampling, every row
        return InFlight.launch(rows, tokens, self.ring, host)


__all__ = ["StepTokens"]
