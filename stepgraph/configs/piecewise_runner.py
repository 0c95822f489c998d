"""``PiecewiseRunner``: one sub-region of a submodule's forward, captured per shape.

    runner = PiecewiseRunner(PiecewisePackedConfig(capture_fn=region, make_static_inputs=mk,
                                                   total_tokens=[64, 256]), device="cuda")
    out = runner.replay({"x": x}, seq_lens=[5, 3])    # {"y": [8, D]}: views of static outputs

Per ``PiecewiseCaptureShape`` the runner builds the static inputs with ``make_static_inputs``,
declares the capture-time step, and captures ``capture_fn(PiecewiseCallInputs(...))``; the
tensors it returns (allocated by the call) are copied into rows of one buffer per output name,
shared by every shape (``shared_outputs.py``): those views are the shape's static outputs. At
replay it picks the smallest shape that holds the batch, pads the lengths
(``config.replay_seq_lens``), leases the shape's buffers when ``lease_before_step`` is set,
declares the step, copies the live inputs into the first rows (padding rows are zeroed where a
larger batch left them live), replays, and returns views of the real rows.

Declared steps: ``declare_step(names, seq_lens)`` gets the names of the shape's static inputs
and the padded per-request lengths; what it returns is ``PiecewiseCallInputs.resources``. A graph
reads only the memory it captured, so every tensor in the resources must be the same tensor
(address and shape) at replay as at capture: write new values into it in place. The runner checks
this. ``engine_inputs`` is handed to the region as ``None`` at capture; at replay it is recorded
in ``runner.last_call`` only, since a graph cannot see new Python objects.
"""

from __future__ import annotations

from typing import Any

import torch

from ..backends import CapturedGraph, CpuGraphBackend, canonical_device
from ..errors import CaptureError, ConfigError, ReplayError
from ..graph_pool import GraphPool
from ..runner.base import GraphRunnerBase
from ..runner.capture import capture_loop, capture_step, storage_ptrs
from ..runner.stats import BucketStats, CaptureStats
from .fit import check_inputs, smallest_fit
from .piecewise import (
    PiecewiseCallInputs,
    PiecewiseCaptureShape,
    PiecewiseCudaGraphConfig,
    PiecewisePackedConfig,
)
from .region_outputs import BufferLease, DictRegion, Key, key_of, resource_layout
from .shared_outputs import PadTracker, SharedRegionOutputs

DEFAULT_BATCH_SIZES = [1, 2, 4, 8]  # used when neither the config nor the runner gives sizes
PAD_VALUE = 0  # what padding rows of the static inputs hold at replay


class PiecewiseRunner(GraphRunnerBase):
    """Captures ``config.capture_fn`` once per capture shape; ``replay`` serves live batches."""

    EAGER_HINT = "run the region eagerly"

    def __init__(
        self,
        config: PiecewiseCudaGraphConfig,
        *,
        device: str | torch.device,
        backend: str = "auto",
        batch_sizes: list[int] | None = None,
        show_progress: bool = False,
        capture: bool = True,
        pool: GraphPool | None = None,
    ) -> None:
        """``pool``: the graph memory pool to capture into; default: the process-wide pool
        (``set_global_graph_memory_pool``), shared by every runner. Runners sharing a pool
        replay one after another on the same stream (e.g. the regions of one forward)."""
        self.config = config
        self.device = canonical_device(device)
        self.show_progress = show_progress
        sizes = config.capture_batch_sizes or batch_sizes or DEFAULT_BATCH_SIZES
        # Ascending (total_tokens, bs): the first shape that holds a batch is the smallest.
        self.shapes = sorted(config.get_capture_shapes(list(sizes)), key=key_of)
        if not self.shapes:
            raise ConfigError("the config yields no capture shape; check its sizes.")
        self.packed = isinstance(config, PiecewisePackedConfig)
        self._init_graphs(self.device, backend, pool)
        self.compile_enabled = config.compile and not isinstance(self._backend, CpuGraphBackend)
        self.static_inputs: dict[Key, dict[str, torch.Tensor]] = {}
        self.outputs: dict[Key, dict[str, torch.Tensor]] = {}
        self.graphs: dict[Key, CapturedGraph]
        self._step_layout: dict[Key, dict[str, tuple[int, tuple[int, ...]]]] = {}
        self._leases: dict[Key, BufferLease] = {}
        self.active_lease: BufferLease | None = None  # the lease of the step being declared
        self.last_call: PiecewiseCallInputs | None = None
        self.stats = CaptureStats()
        self.replays = 0
        self._shared = SharedRegionOutputs(self.shapes)  # outputs: one buffer per name
        self._pads = PadTracker()  # padding rows re-written only when dirty
        if capture:
            self.capture()

    # ---------------------------------------------------------------------------------------
    # capture

    def capture(self) -> CaptureStats:
        """Capture every shape, largest first (smaller ones reuse its pool blocks)."""
        self._check_alive("capture")
        self._release_graphs()
        items = list(reversed(self.shapes))
        self.stats = capture_loop(
            items, self._capture_one, show_progress=self.show_progress, backend=self._backend
        )
        return self.stats

    def _capture_one(self, shape: PiecewiseCaptureShape) -> BucketStats:
        key, what = key_of(shape), f"piecewise shape (bs={shape.bs}, total={shape.total_tokens})"
        try:
            static = self._make_static(shape, what)
            step = self._declare(shape, static, shape.seq_lens)  # leased as at replay
            call = PiecewiseCallInputs(static, None, self.config.forward_kwargs, step)
            resources = call.resources
            self._step_layout[key] = resource_layout(resources)
            fn = self.config.capture_fn
            if self.compile_enabled:
                fn = torch.compile(fn, dynamic=False)
            region = DictRegion(lambda: fn(call), what)
            views: dict[str, torch.Tensor] = {}

            def step() -> torch.Tensor:  # the region, then its outputs into the shared rows
                region()
                raw = region.outputs if region.outputs is not None else region.calls[-1]
                views.update(self._shared.copy_in(raw, shape))
                return next(iter(views.values()))

            graph, stats = capture_step(
                self._backend,
                step,
                key=key,
                bs=shape.bs,
                what=what,
                until_settled=not self.compile_enabled,  # torch.compile's kernels: not counted
            )
            earlier = [t for out in self.outputs.values() for t in out.values()]
            known = [*static.values(), *resources.values(), *call.kwargs.values(), *earlier]
            outputs = region.seal(storage_ptrs(known))
            for name, t in outputs.items():
                if t.dim() == 0 or t.shape[0] not in (shape.num_requests, shape.total_tokens):
                    raise CaptureError(
                        f"{what}: output {name!r} has shape {tuple(t.shape)}; its first dim "
                        f"must be one row per request slot ({shape.num_requests}) or per token "
                        f"({shape.total_tokens}) so the real rows can be handed back."
                    )
            outputs = dict(views)  # shared rows; the region's own outputs are pool temporaries
        except BaseException:
            self._release_graphs()
            raise
        self.static_inputs[key], self.outputs[key], self.graphs[key] = static, outputs, graph
        return stats

    def _make_static(self, shape: PiecewiseCaptureShape, what: str) -> dict[str, torch.Tensor]:
        static = self.config.make_static_inputs(shape)
        if not isinstance(static, dict) or not all(
            isinstance(t, torch.Tensor) and t.device == self.device for t in static.values()
        ):
            raise ConfigError(
                f"{what}: make_static_inputs must return a dict[str, Tensor] on {self.device}."
            )
        return static

    def _declare(self, shape, static, seq_lens: list[int]) -> Any:
        """Declare the step; with ``lease_before_step`` the shape's buffers are leased first and
        visible as ``self.active_lease`` while ``declare_step`` runs."""
        lease = self._lease(shape, static) if self.config.lease_before_step else None
        self.active_lease = lease
        try:
            if self.config.declare_step is None:
                return None
            return self.config.declare_step(list(static), list(seq_lens))
        finally:
            self.active_lease = None
            if lease is not None:
                lease.release()

    # ---------------------------------------------------------------------------------------
    # lease

    def lease(self, shape: PiecewiseCaptureShape) -> BufferLease:
        """Mark ``shape``'s static inputs as in use and hand them over. A second lease of the same
        shape before ``release()`` raises ``ReplayError``."""
        return self._lease(shape, self.static_inputs[key_of(shape)])

    def _lease(self, shape: PiecewiseCaptureShape, buffers: dict) -> BufferLease:
        key = key_of(shape)
        if key in self._leases:
            raise ReplayError(
                f"the static buffers of shape (bs={shape.bs}, total={shape.total_tokens}) are "
                "already leased; release() the earlier lease before leasing or replaying it again."
            )
        lease = self._leases[key] = BufferLease(shape, buffers, self._leases)
        return lease

    # ---------------------------------------------------------------------------------------
    # replay

    def replay(
        self,
        live_inputs: dict[str, torch.Tensor],
        seq_lens: list[int] | None = None,
        engine_inputs: Any = None,
    ) -> dict[str, torch.Tensor]:
        """Replay the smallest shape holding the batch; return views of the real rows of each
        output (the next replay of that shape overwrites them). Packed batches need
        ``seq_lens``; batched ones take it optionally (lengths within ``seq_len``)."""
        self._check_alive("replay")
        shape, rows = self._pick(live_inputs, seq_lens)
        key = key_of(shape)
        real_bs = len(seq_lens) if self.packed else rows
        lens = self.config.replay_seq_lens(shape, seq_lens, real_bs)
        static = self.static_inputs[key]
        step = self._declare(shape, static, lens)
        call = PiecewiseCallInputs(static, engine_inputs, self.config.forward_kwargs, step)
        if resource_layout(call.resources) != self._step_layout[key]:
            raise ReplayError(
                f"declare_step returned resources {resource_layout(call.resources)} at replay but "
                f"{self._step_layout[key]} at capture; a graph reads only the tensors it "
                "captured: write the new step into the same tensors, in place."
            )
        for name, t in live_inputs.items():
            static[name][:rows].copy_(t)
            self._pads.repad(static[name], rows, PAD_VALUE)
        self.graphs[key].replay()
        self.last_call, self.replays = call, self.replays + 1
        real_tokens = sum(lens[:real_bs]) if self.packed else rows * self.config.seq_len
        return {
            name: t[:real_bs] if t.shape[0] == shape.num_requests else t[:real_tokens]
            for name, t in self.outputs[key].items()
        }

    def _pick(self, live: dict[str, torch.Tensor], seq_lens: list[int] | None):
        """Check the live inputs against the static ones and pick the smallest shape holding
        them; returns (shape, live rows). Raises before anything is copied."""
        template = self.static_inputs[key_of(self.shapes[-1])]
        subset_ok = self.config.declare_step is not None  # a declared step may fill the rest
        n = check_inputs(live, template, label="the live batch", subset_ok=subset_ok)
        if self.packed and (seq_lens is None or sum(seq_lens) != n or not seq_lens):
            raise ReplayError(
                f"a packed replay needs seq_lens summing to the {n} live tokens, got {seq_lens}."
            )
        bs = len(seq_lens) if self.packed else n
        shape = smallest_fit(self.shapes, key_of, bs, n, self.packed)
        if shape is not None:
            return shape, n
        raise ReplayError(
            f"no captured shape holds {bs} requests of {n} rows (largest: bs="
            f"{self.shapes[-1].bs}, total={self.shapes[-1].total_tokens}); run this step "
            "eagerly, or capture larger shapes."
        )

    # ---------------------------------------------------------------------------------------
    # lifetime

    def shutdown(self) -> None:
        """Release graphs, static buffers and the pool. Any later call raises ``ReplayError``."""
        self._release_graphs()
        self._shut_down = True

    def mark_inputs_dirty(self) -> None:
        """Re-pad every static input row at the next replay: call it after writing into the
        static inputs outside ``replay`` (padding rows are otherwise re-written only when a
        larger batch left them live)."""
        self._pads.forget()

    def _forget_graphs(self) -> None:
        self.outputs.clear()
        self._shared.release()
        self._pads.forget()
        self.static_inputs.clear()
