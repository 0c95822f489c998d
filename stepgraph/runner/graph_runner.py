"""``CudaGraphRunner``: one graph per batch-size bucket, replayed for every decode step.

    runner = CudaGraphRunner(model_runner, RunnerConfig(max_bs=64))   # captures every bucket
    for step in decode_loop:
        if runner.can_run(batch):
            logits = runner.replay(batch)          # view into a static buffer
        else:
            logits = model_runner.forward(batch)   # eager fallback

Capture runs largest bucket first on one side stream into one shared pool; replay pads the live
batch to its bucket (``input_buffers.py``), lets the attention backend refresh its metadata,
retunes attention nodes in mode "exact", replays, and returns the first ``bs`` output rows.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from threading import current_thread

import numpy as np
import torch

from ..backends import CapturedGraph, CudaGraphBackend, canonical_device
from ..batch import ForwardBatch, ForwardMode, ModelRunnerLike, check_model_runner
from ..buckets import pad_to_bucket
from ..errors import ReplayError
from ..graph_pool import GraphPool
from ..graph_update.exec_updater import ExecUpdater, default_exec_updater
from .base import GraphRunnerBase, lend_graph_buckets
from .capture import capture_loop, capture_step, logger
from .config import RunnerConfig, config_for
from .feed import check_feed
from .graph_inputs import captured_inputs
from .input_buffers import GraphInputBuffers
from .input_checks import SEQ_COL, InputLimits, batch_problem, check_rows_fast, check_values
from .shared_output import SharedOutput, takes_out
from .staging import PinnedStaging
from .stats import BucketStats, CaptureStats, RunnerStats
from .token_mirror import TokenMirror

__all__ = ["CudaGraphRunner", "RunnerConfig", "logger"]

_DECODE = ForwardMode.DECODE
_U64 = np.uint64
_I64 = torch.int64


class CudaGraphRunner(GraphRunnerBase):
    """Captures and replays CUDA graphs for decode-step forward passes (seed: pymllm)."""

    EAGER_HINT = "run the batch eagerly with model_runner.forward"

    def __init__(
        self,
        model_runner: ModelRunnerLike,
        config: RunnerConfig | None = None,
        *,
        exec_updater: ExecUpdater | None = None,
        capture: bool = True,
        pool: GraphPool | None = None,
        feed: torch.Tensor | None = None,
    ) -> None:
        """``config``: default ``RunnerConfig(max_bs=model_runner.max_bs)``; no bucket above that
        max_bs. ``pool``: the graph memory pool to capture into; default: the process-wide pool
        (``set_global_graph_memory_pool``), shared by every runner. ``feed``: ``[F]`` int64 on
        the device, at a fixed address: a batch row of input id ``-1 - j`` replays with
        ``feed[j]``, gathered inside the graph (``runner/feed.py``: the overlapped loop's
        input, with no host round trip)."""
        check_model_runner(model_runner, type(self).__name__)  # names what is missing
        self.model_runner = model_runner
        self.config = config = config_for(model_runner, config)  # default: its max_bs
        self.device = canonical_device(model_runner.device)
        self.capture_bs = config.buckets()
        self.max_bs = self.capture_bs[-1]
        self.enable_torch_compile = config.enable_torch_compile
        self.torch_compile_max_bs = config.torch_compile_max_bs
        self.compile_bs = config.compile_buckets()
        self.seq_len_fill_value = model_runner.attn_backend.get_cuda_graph_seq_len_fill_value()
        self.buffers = GraphInputBuffers.allocate(
            self.max_bs, model_runner.max_pages_per_request, self.device, self.seq_len_fill_value
        )
        self._init_graphs(self.device, config.backend, pool)
        tuning = getattr(model_runner, "tuning", None)  # a DecodeTuning, or none (a toy)
        self._staging = (  # pinned host rows, copied to the device inside each graph
            PinnedStaging(
                self.buffers.packed_pad,
                self.max_bs,
                self.device,
                getattr(tuning, "staging_copy", False),
            )
            if config.stages(isinstance(self._backend, CudaGraphBackend))
            else None
        )
        self.feed = check_feed(feed, self.device)  # device ids that batch ids -1 - j read
        self._mirror = (  # the feed after each replay, stored to pinned host memory in-graph
            TokenMirror(self.max_bs, self.device)
            if getattr(tuning, "token_mirror", False)
            and self._staging is not None
            and self.feed is not None
            else None
        )
        self.graphs: dict[int, CapturedGraph]
        self.output_buffers: dict[int, torch.Tensor] = {}
        self.stats = RunnerStats()
        self._static: dict[int, ForwardBatch] = {}
        self._updater = exec_updater
        if config.mode == "exact" and exec_updater is None:
            self._updater = default_exec_updater(model_runner)
        self._plans: dict[int, object] = {}
        self._shared = SharedOutput(self.max_bs)  # [max_bs, ...]: every bucket's output
        self._forward_takes_out = takes_out(model_runner.forward)  # logits straight into it
        self._out_rows: dict[int, torch.Tensor] = {}  # bs -> rows [:bs] of the shared output
        self._max_context: int | None = getattr(model_runner, "max_context_len", None)
        self._limits = InputLimits.of(model_runner)
        if self.feed is not None:
            self._limits = replace(self._limits, feed_size=self.feed.shape[0])
        self._bucket_of: dict[int, int] = {}  # bs -> its bucket (pad_to_bucket, cached)
        self._width = self.buffers.packed.shape[1]  # a packed row's columns, at most
        self._full_checks = config.check_inputs == "full"  # the general path's device copies
        self._checks_off = config.check_inputs == "off"
        self._rows: tuple = (0, 0, None, None)  # ``_host_rows``' last tensor, its views
        self._states: dict[int, tuple] = {}  # bucket -> ``_replay_state``
        self._compiled: Callable[[ForwardBatch], torch.Tensor] | None = None
        lend_graph_buckets(model_runner.attn_backend, self.capture_bs)
        if capture:
            self.capture()

    # ---------------------------------------------------------------------------------------
    # capture

    def capture(self) -> CaptureStats:
        """Capture one graph per bucket, largest first (smaller ones reuse its pool blocks).
        On failure nothing half-captured is kept: every graph and the pool are released."""
        self._check_alive("capture")
        self._release_graphs()
        self.model_runner.attn_backend.init_cuda_graph_state(self.max_bs)
        try:
            stats = capture_loop(
                reversed(self.capture_bs),
                self._capture_one,
                show_progress=self.config.show_progress,
                backend=self._backend,
                freeze=self.config.freeze_gc,
            )
        except BaseException:
            self._release_graphs()
            raise
        self.stats.capture = stats
        if self._staging is not None:
            self._staging.reset()
        return stats

    def _capture_one(self, bs: int) -> BucketStats:
        static = self._static[bs] = self.buffers.view(bs)
        forward = self._forward_for(bs)
        self.model_runner.attn_backend.init_forward_metadata_capture_cuda_graph(bs, static)
        unpack = self.config.packed_inputs
        direct = self._forward_takes_out and bs not in self.compile_bs

        kernel = unpack and self.device.type == "cuda"  # graph_inputs.py: one launch

        def step() -> torch.Tensor:  # reads only static buffers
            captured_inputs(self.buffers, bs, self._staging, self.feed, unpack, kernel)
            dst = self._shared.rows(bs) if direct else None
            if dst is not None:
                forward(static, out=dst)  # no [bs, vocab] temporary in the pool
            else:
                dst = self._shared.copy_in(forward(static), bs)  # shared_output.py says why
            if self._mirror is not None:  # last: after the step wrote the feed
                self._mirror.store(self.feed, self._staging.copies, bs)
            return dst

        graph, stats = capture_step(
            self._backend,
            step,
            key=bs,
            bs=bs,
            what=f"the decode step for batch size {bs}",
            warmup_iters=self.config.warmup_iters,
            # torch.compile's kernels are not in the count: its buckets take every run
            until_settled=self.config.warmup_until_settled and bs not in self.compile_bs,
        )
        self.graphs[bs] = graph
        self.output_buffers[bs] = graph.output
        if self._updater is not None:
            t0 = time.perf_counter()
            self._plans[bs] = self._updater.plan(graph, bs)
            plan = time.perf_counter() - t0  # host work: reads the graph's nodes
            stats = replace(stats, seconds=stats.seconds + plan, plan_seconds=plan)
        return stats

    def _forward_for(self, bs: int) -> Callable[[ForwardBatch], torch.Tensor]:
        if bs not in self.compile_bs:
            return self.model_runner.forward
        if self._compiled is None:
            self._compiled = torch.compile(
                self.model_runner.forward, mode=self.config.torch_compile_mode, dynamic=False
            )
        return self._compiled

    # ---------------------------------------------------------------------------------------
    # replay

    def can_run(self, batch: ForwardBatch) -> bool:
        """``True`` if ``batch`` can be replayed; otherwise count the reason in ``stats``."""
        self._check_batch(batch, "can_run")  # not a fallback: a caller's bug, named
        reason = self._refusal(batch)
        if reason is not None:
            self.stats.fallbacks[reason] += 1
        return reason is None

    def _refusal(self, batch: ForwardBatch) -> str | None:
        if self._shut_down:
            return "shut_down"
        if batch.mode is not ForwardMode.DECODE:
            return "not_decode"
        bs = batch.batch_size
        if bs == 0:
            return "empty"
        if bs > self.max_bs:
            return "too_large"
        if self._input_problem(batch) is not None:
            return "bad_input"
        return None

    def _input_problem(self, batch: ForwardBatch, bs: int | None = None) -> str | None:
        staged, packed = self._staging is not None, self.config.packed_inputs
        return batch_problem(batch, self.buffers, self.device, packed, staged, bs)

    @property
    def staged(self) -> bool:
        """Whether replays stage host rows in pinned memory (``RunnerConfig.pinned_staging``):
        a batch whose ``packed_cpu`` holds its rows then needs nothing on the device."""
        return self._staging is not None

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        """Replay the graph of the smallest bucket holding ``batch``; return its ``[bs, ...]``
        output rows. The result is a view into a static buffer: the next replay overwrites it,
        so copy or consume it (e.g. sample) before the next step. Device inputs (the last step's
        ids as ``input_ids``, or in ``PACKED.column(batch.packed, "input_ids")``) are copied on
        the device in stream order, with no host sync; with a ``feed``, ids ``-1 - j`` read
        ``feed[j]`` inside the graph, so the rows can be all host data: the overlapped loop."""
        if self._shut_down or (self.check_same_thread and current_thread() is not self._owner):
            self._check_alive("replay")  # raises, naming which
        if type(batch) is not ForwardBatch:
            self._check_batch(batch, "replay")  # before any attribute of it is read
        if batch.mode is not _DECODE:
            raise ReplayError(
                f"replay serves decode batches, got {batch.mode.value}; run it "
                "eagerly with model_runner.forward."
            )
        try:
            bs = batch.input_ids.shape[0]
        except IndexError:  # a 0-d tensor (free in the fast path: no test of its own)
            raise ReplayError(
                "cannot replay this batch: input_ids has shape (), expected [bs]."
            ) from None
        bucket = self._bucket_of.get(bs)
        if bucket is None:
            bucket = self._bucket_of[bs] = pad_to_bucket(bs, self.capture_bs)
        staging = self._staging
        rows = None if staging is None else self._host_rows(batch)
        if rows is None or rows[2].shape[0] != bs:  # the general checks and copies
            t_kv = self._check_replay(batch, bs)  # raises before anything is copied
            self._copy_inputs(batch, bucket)
        else:  # host rows into the pinned slot: numpy only, no torch call
            values = rows[2]
            t_kv = batch.max_seq_len
            if self._checks_off or batch.values_checked:
                if t_kv is None and (self._updater is not None or self._max_context is not None):
                    t_kv = int(values[:, SEQ_COL].max())  # for the context check, or exact
            else:  # one compare of every value; t_kv is needed in exact mode only
                check_rows_fast(values, rows[3], self._limits)
                if t_kv is None and self._updater is not None:
                    t_kv = int(values[:, SEQ_COL].max())
            if t_kv is not None and self._max_context is not None and t_kv > self._max_context:
                self._too_long(t_kv)  # raises before anything is copied
            staging.stage_rows(values, bucket)
            self.buffers.stage_host_lens(values, bucket)
        hook, static, graph, launch, plan = self._states.get(bucket) or self._replay_state(bucket)
        hook(bucket, static)  # the attention backend's replay hook
        if plan is not None:
            self.stats.node_edits += self._updater.apply(plan, graph, t_kv)
        launch()
        if staging is not None:
            staging.replayed()
        self.stats.replays += 1
        out = self._out_rows.get(bs)  # one view per bs: slicing costs host time
        if out is None:  # every bucket's output is rows of one shared buffer
            out = self._out_rows[bs] = self.output_buffers[bucket][:bs]
        return out

    def host_feed(self, bs: int) -> torch.Tensor | None:
        """The feed's rows ``[:bs]`` as the last replay left them, in pinned host memory,
        stored by the graph itself (``DecodeTuning.token_mirror``, a staged runner with a
        feed): read them once an event recorded after that replay has completed. None without
        the mirror. Where the step writes its sampled ids into the feed (the engine's fused
        step), these are the step's tokens with no D2H copy (``token_mirror.py``)."""
        mirror = self._mirror
        return None if mirror is None else mirror.rows(self._staging.count, bs)

    def _host_rows(self, batch: ForwardBatch) -> tuple | None:
        """``(packed_cpu, its version, its numpy rows, their uint64 view)`` when a staged
        replay can take the batch's host rows as they are (int64 on the host, 2-D, no wider
        than the static rows; value checks "host" or "off"); else None (the general path, which
        names what is wrong). A staged replay reads the KV lengths from the rows' column, so
        ``seq_lens_cpu`` is not read. The views of the last rows tensor are kept while its
        version holds (an engine passes the same rows every step, written through numpy; any
        torch write, resize or re-point bumps the version and they are taken anew)."""
        src = batch.packed_cpu
        rows = self._rows
        if src is rows[0] and src._version == rows[1]:
            return rows
        if src is None or self._full_checks or src.dtype is not _I64:
            return None
        try:
            values = src.numpy()  # refuses a tensor off the host, or one that requires grad
        except (TypeError, RuntimeError):
            return None
        if values.ndim != 2 or values.shape[1] > self._width:
            return None
        rows = self._rows = (src, src._version, values, values.view(_U64))
        return rows

    def _replay_state(self, bucket: int) -> tuple:
        """What a replay of ``bucket`` touches, looked up once: the backend's replay hook, the
        static batch, the graph, its launch and its exact-mode plan (None in mode graph)."""
        state = self._states.get(bucket)
        if state is None:
            graph = self.graphs[bucket]
            launch = graph.launcher()
            hook = self.model_runner.attn_backend.init_forward_metadata_replay_cuda_graph
            plan = self._plans[bucket] if self._updater is not None else None
            state = self._states[bucket] = (hook, self._static[bucket], graph, launch, plan)
        return state

    def _check_replay(self, batch: ForwardBatch, bs: int) -> int | None:
        """The longest KV length of ``batch`` of ``bs`` rows (``None`` when nothing needs it);
        ``ReplayError`` naming the problem and the fix when it cannot be replayed."""
        problem = self._input_problem(batch, bs)
        if problem is not None:
            raise ReplayError(
                f"cannot replay this batch: {problem}. Build the batch with "
                "these dtypes on the model's device, or run it eagerly."
            )
        longest = check_values(batch, self._limits, self.config.check_inputs)  # before copies
        t_kv = batch.max_seq_len if batch.max_seq_len is not None else longest
        if self._max_context is None and self._updater is None:
            return t_kv
        if t_kv is None:
            t_kv = int(batch.seq_lens_cpu.numpy().max())  # numpy: a few us less than torch
        if self._max_context is not None and t_kv > self._max_context:
            self._too_long(t_kv)
        return t_kv

    def _too_long(self, t_kv: int) -> None:
        raise ReplayError(
            f"a request of {t_kv} tokens is longer than the {self._max_context} the "
            "graphs were captured for (model_runner.max_context_len); finish or "
            "truncate it, or build the model runner with a larger max_context_len."
        )

    def _copy_inputs(self, batch: ForwardBatch, bucket: int) -> None:
        if self._staging is not None:
            self.buffers.copy_host_lens(batch, bucket, self._staging.stage(batch, bucket))
        elif not self.config.packed_inputs:
            self.buffers.copy_from(batch, bucket)
        elif not self.buffers.copy_packed_from(batch, bucket):
            self.stats.packed_here += 1

    # ---------------------------------------------------------------------------------------
    # lifetime

    def reinstantiate(self) -> None:
        """Rebuild every exec from its template graph; exact-mode edits are re-applied at the
        next replay (they live in the exec, which this replaces)."""
        self._check_alive("reinstantiate")
        for bs, graph in self.graphs.items():
            graph.reinstantiate()
            if self._updater is not None:
                self._updater.invalidate(self._plans[bs])

    def shutdown(self) -> None:
        """Release graphs, static buffers and the pool. Any later call raises ``ReplayError``."""
        self._release_graphs()
        self._shut_down = True
        lend_graph_buckets(self.model_runner.attn_backend, None, self.capture_bs)
        self.buffers = None  # type: ignore[assignment]
        self._staging = None  # its pinned slots and device rows
        self._mirror = None  # its pinned rows

    def _forget_graphs(self) -> None:
        self.output_buffers.clear()
        self._static.clear()  # views of the static buffers: they would keep them alive
        self._shared.release()
        self._out_rows.clear()
        self._plans.clear()
        self._bucket_of.clear()
        self._states.clear()
        self._rows = (0, 0, None, None)  # the last host rows: a caller's tensor, let go
