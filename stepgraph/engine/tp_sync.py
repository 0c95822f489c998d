"""One schedule on every tensor-parallel rank: rank 0 decides, the others follow.

Each rank runs its own ``Engine`` over its shard, and every collective of a step needs the same
batch on every rank, or it hangs or mixes requests. The engine's schedule is a pure function of
its requests and their tokens (the sharded logits are all-reduced, so every rank samples the
same ids), except where a rank could see something the others do not: pages that came back
early (``PendingPages``), or a request one rank was given and another was not. So once per step
rank 0 broadcasts its decision, the number of waiting requests to admit, with a signature of
what it decided from (the ids waiting and running, and the tokens it landed last step), over a
CPU (gloo) group, as SGLang and vLLM broadcast their scheduler's output. Every other rank
admits what rank 0 admits, and a rank whose signature differs raises ``StepGraphError`` naming
what differs instead of entering a collective its peers will not.

The prefix cache: which pages match and which are evicted is a pure function of the sequence
of cache operations (``prefix_cache.py``), and every rank makes the same ones in the same order
(inserts when requests end, releases in launch order: ``PendingPages``, every pending page back
before an admission that has requests waiting). The signature includes the cache's counts
(cached, evictable, free pages) too, so a rank whose cache drifted stops before it admits.

Sampling: a request or step without a seed draws from a generator seeded by rank 0 (once, at
the engine's construction), so a sampled token is the same on every rank too.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from ..errors import StepGraphError

_MASK = (1 << 62) - 1


def _signature(ids: Sequence[int]) -> int:
    return hash(tuple(ids)) & _MASK  # ints and tuples hash alike in every process


class ScheduleSync:
    """Rank 0's admission decision and a signature of its state, broadcast once per step."""

    def __init__(self, group=None) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        gloo = dist.get_backend() == "gloo"
        self.group = group if group is not None or gloo else dist.new_group(backend="gloo")
        seed = torch.tensor([int.from_bytes(os.urandom(7), "little") if self.rank == 0 else 0])
        dist.broadcast(seed, src=0, group=self.group)  # os.urandom: no rank's torch RNG moves
        self.seed = int(seed)  # rank 0's: the shared sampling seed
        self.steps = 0

    @classmethod
    def for_model(cls, model_runner) -> ScheduleSync | None:
        """A sync when ``model_runner``'s model is one tensor-parallel shard of several
        (``model.tp_layout``); else None: one process, or ranks that each serve a whole model
        (data parallel), schedule on their own."""
        import torch.distributed as dist

        layout = getattr(getattr(model_runner, "model", None), "tp_layout", None)
        if layout is None or layout.world_size == 1:
            return None
        if not (dist.is_available() and dist.is_initialized()):
            return None  # a shard built without a group (tests): no collective runs anyway
        return cls()

    def admit(
        self,
        count: int,
        waiting: Sequence[int],
        running: Sequence[int],
        landed,
        cache_state: Sequence[int] = (),
    ) -> int:
        """Rank 0's ``count`` of requests to admit this step, on every rank; ``StepGraphError``
        on a rank whose waiting or running request ids, last landed tokens or prefix cache
        state differ from rank 0's (``landed``: the ``(request id, token)`` pairs of its last
        step; ``cache_state``: the cache's page counts)."""
        sig = [_signature(waiting), _signature(running), _signature(landed)]
        mine = torch.tensor([count, *sig, _signature(cache_state)], dtype=torch.long)
        theirs = mine.clone()
        self._dist.broadcast(theirs, src=0, group=self.group)
        self.steps += 1
        if self.rank != 0:
            whats = (
                "waiting requests",
                "running requests",
                "last landed tokens",
                "prefix cache pages (cached, evictable, free)",
            )
            for k, what in enumerate(whats, start=1):
                if int(theirs[k]) != int(mine[k]):
                    raise StepGraphError(
                        f"tensor-parallel rank {self.rank} diverged from rank 0 at step "
                        f"{self.steps}: its {what} differ. Give every rank the same "
                        "requests in the same order, seeds included."
                    )
        return int(theirs[0])

    def request_seed(self, rid: int) -> int:
        """The seed of request ``rid`` when none was given: the same on every rank."""
        return (self.seed * 1_000_003 + rid) % 2**62


__all__ = ["ScheduleSync"]
