"""The engine's decode path: one decode step of the running requests, replayed by the
``CudaGraphRunner`` (``decode_via="runner"``) or by a ``ConfigGraphRunner`` over the model's
decode walk (``"configs"``), else run eagerly (``mode="eager"``, or a batch no graph holds)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from ..batch import PACKED, unpacked_batch
from ..model.decode.decode_rows import DecodeRows, block_table
from ..model.decode.graph_walks import DECODE_WALK
from ..model.model_runner import ModelRunner
from ..runner.feed import feed_id
from .overlap import InFlight
from .requests import EngineStats, Request

_POS = PACKED.fields.index("positions")
_FEED_IDS = [feed_id(j) for j in range(4096)]  # the ids of feed rows 0, 1, ... in order


class DecodePath:
    def __init__(
        self, model_runner: ModelRunner, mode: str, decode_via: str, runner_config: Any | None
    ) -> None:
        self.model_runner = model_runner
        self.runner = None  # CudaGraphRunner (decode_via="runner")
        self.config_runner = None  # ConfigGraphRunner (decode_via="configs")
        self.walks = None  # its DecodeGraphWalks
        self._table: tuple[tuple[int, ...], object] | None = None  # (request ids, block table)
        self.timer = None  # the engine's PhaseTimer (phase_timer.py), or None
        # the host rows kept across steps (a runner that copies them at replay), and the
        # request ids of their last step: the same ids next step advance the rows in place
        self.rows: DecodeRows | None = None
        self._rows_key: tuple[int, ...] | None = None
        # the last step's feed rows in pinned host memory, stored by its graph (the runner's
        # token mirror), or None: the step's tokens are copied to the host after it
        self.host_tokens: torch.Tensor | None = None
        if mode == "eager":
            return
        from ..runner import CudaGraphRunner
        from ..runner.config import config_for

        # default: RunnerConfig(max_bs=model_runner.max_bs); no bucket above its max_bs
        config = config_for(model_runner, runner_config, show_progress=False)
        if decode_via == "runner":  # input ids of the last step's rows: read from the feed
            self.runner = CudaGraphRunner(
                model_runner, replace(config, mode=mode), feed=model_runner.greedy_tokens
            )
            if self.runner.staged or self.runner.device.type == "cpu":  # rows copied at replay
                self.rows = DecodeRows(
                    self.runner.max_bs,
                    model_runner.max_pages_per_request,
                    model_runner.page_size,
                    packed_too=not self.runner.staged,
                )
        else:
            from ..model.decode.graph_walks import build_decode_graph_runner

            self.walks, self.config_runner = build_decode_graph_runner(
                model_runner,
                capture_batch_sizes=config.buckets(),
                backend=config.backend,
                show_progress=config.show_progress,
            )

    @property
    def runners(self) -> list[Any]:
        return [r for r in (self.runner, self.config_runner) if r is not None]

    def logits(
        self, reqs: Sequence[Request], stats: EngineStats, prev: InFlight | None = None
    ) -> torch.Tensor:  # [bs, vocab] float32
        """One decode step of ``reqs``, each feeding its last token; counts it in ``stats``.
        With ``prev`` (the step before, still in flight) the tokens are read from its device
        output, row by row; else from each request's output on the host."""
        self.host_tokens = None
        fed = self._replay_fed(reqs, stats, prev)
        if fed is not None:
            return fed
        mr = self.model_runner
        if prev is None:
            tokens, source = [r.output[-1] for r in reqs], None
        else:  # every request decoding now sampled a token in the step before
            tokens, source = [prev.row_of[r.rid] for r in reqs], prev.tokens
        batch = self._batch(
            reqs,
            tokens,
            # the graph runner copies only the packed rows: skip building contiguous fields
            contiguous_fields=self.runner is None or not self.runner.config.packed_inputs,
            tokens_from=source,
        )
        if self.runner is not None:
            if self.runner.can_run(batch):
                stats.graph_steps += 1
                return self.runner.replay(batch)  # a static buffer: sampled before next replay
            max_seq_len = batch.max_seq_len
            batch = unpacked_batch(batch.packed, batch.seq_lens_cpu)  # eager needs contiguous
            batch.max_seq_len = max_seq_len
        if self.config_runner is not None:  # replays, or runs eagerly above the largest bucket
            replays = self.config_runner.stats.replays
            logits = self.config_runner.run(DECODE_WALK, self.walks.requests(batch))
            if self.config_runner.stats.replays > replays:
                stats.graph_steps += 1
            else:
                stats.eager_steps += 1
            return logits
        stats.eager_steps += 1
        return mr.forward(batch)

    def _replay_fed(
        self, reqs: Sequence[Request], stats: EngineStats, prev: InFlight | None
    ) -> torch.Tensor | None:
        """The replay of a batch built all on the host: ids of the last step's rows point into
        the runner's feed (``runner/feed.py``), and a staged runner copies the rows inside the
        graph, so the host launches the graph and nothing else. ``None`` where it does not
        apply (no runner, a batch above its buckets, more rows in flight than the feed)."""
        runner = self.runner
        if runner is None or len(reqs) > runner.max_bs:
            return None
        feed = runner.feed
        if prev is not None and prev.tokens.shape[0] > feed.shape[0]:
            return None
        if prev is not None and prev.tokens.data_ptr() != feed.data_ptr():
            # sampled outside the step (else the fused argmax wrote the feed)
            feed[: prev.tokens.shape[0]].copy_(prev.tokens)
        if self.rows is not None:
            batch = self._kept_batch(reqs, prev)  # the engine's own values: no can_run
        else:
            if prev is None:
                tokens = [r.output[-1] for r in reqs]
            else:
                tokens = [feed_id(prev.row_of[r.rid]) for r in reqs]
            how = dict(contiguous_fields=False, device_copy=not runner.staged)
            batch = self._batch(reqs, tokens, **how)
            if not runner.can_run(batch):
                return None
        timer = self.timer
        if timer is not None:
            timer.mark("batch_rows")
        stats.graph_steps += 1
        logits = runner.replay(batch)  # a static buffer: sampled before the next replay
        self.host_tokens = runner.host_feed(len(reqs))
        if timer is not None:
            timer.mark("replay")
        return logits

    def _kept_batch(self, reqs: Sequence[Request], prev: InFlight | None):
        """The batch of ``reqs`` in the rows kept from the step before. The same requests as
        then, each fed from row ``j`` of the step in flight (no prefill rows before them), only
        advance: positions, KV lengths and slots one on, no Python per request. Else every row
        is written."""
        rows, key = self.rows, tuple(r.rid for r in reqs)
        bs = len(reqs)
        first = reqs[0]
        steady = (
            key == self._rows_key
            and prev is not None
            and len(prev.rows) == bs  # row j of the step in flight is reqs[j]
            and int(rows.rows[0, _POS]) + 1 == len(first.prompt) + first.scheduled - 1
        )
        self._rows_key = None  # until the rows hold this step's batch
        if steady:
            batch = rows.advance(bs)
        else:
            if prev is None:
                tokens = [r.output[-1] for r in reqs]
            else:
                row_of = prev.row_of
                tokens = [feed_id(row_of[r.rid]) for r in reqs]
            positions = [len(r.prompt) + r.scheduled - 1 for r in reqs]
            counts = [len(r.pages) for r in reqs]
            batch = rows.fill(tokens, positions, self._block_table(reqs), counts)
        # fed from the feed's rows 0..bs-1 in order: the next step of the same requests only
        # advances (a step fed from host tokens, or from other rows, is written whole)
        if prev is not None and (steady or tokens == _FEED_IDS[:bs]):
            self._rows_key = key
        return batch

    def _batch(self, reqs: Sequence[Request], tokens: list[int], **how):
        """The decode batch of ``reqs`` feeding ``tokens``; values the engine vouches for
        (sampled ids, admitted lengths, its allocator's pages)."""
        return self.model_runner.decode_batch(
            tokens,
            [len(r.prompt) + r.scheduled - 1 for r in reqs],
            [r.pages for r in reqs],
            table=self._block_table(reqs),
            values_checked=True,
            **how,
        )

    def _block_table(self, reqs: Sequence[Request]):
        """The batch's block table, rebuilt only when its requests change (each keeps its
        pages from admission to the end)."""
        key = tuple(r.rid for r in reqs)
        if self._table is None or self._table[0] != key:
            pages = [r.pages for r in reqs]
            self._table = (key, block_table(pages, self.model_runner.max_pages_per_request))
        return self._table[1]

    def shutdown(self) -> None:
        for r in self.runners:
            r.shutdown()


__all__ = ["DecodePath"]
