"""The runner's exec updater (mode "exact"): per-bucket update plans, applied before each replay.

The runner talks to an ``ExecUpdater``; the default one retunes flash-decode attention nodes
through ``stepgraph.graph_update`` (DESIGN §5). Tests on the CPU inject their own.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from ..backends import CapturedGraph
from ..errors import CaptureError
from .flash import fa_apply, fa_plan
from .nodes import kernel_nodes


class ExecUpdater(Protocol):
    def plan(self, graph: CapturedGraph, bs: int) -> Any:
        """Build the update plan of one freshly captured bucket graph (raise CaptureError if the
        graph holds nothing to retune)."""

    def apply(self, plan: Any, graph: CapturedGraph, t_kv: int) -> int:
        """Retune ``graph``'s exec to KV length ``t_kv``; return the number of nodes pushed."""

    def invalidate(self, plan: Any) -> None:
        """Forget applied state (after re-instantiation every exec edit is gone)."""


class FlashExecUpdater:
    """Retunes every split-KV main/combine pair of a bucket graph to the live KV length."""

    def __init__(self, max_t_kv: int, num_sms: int, split_keys: Any = None) -> None:
        self.max_t_kv = max_t_kv
        self.num_sms = num_sms
        self.split_keys = split_keys  # None: fa_apply's default, the head_dim-64 ladder

    def plan(self, graph: CapturedGraph, bs: int) -> Any:
        raw = getattr(graph, "raw_cuda_graph", None)
        if raw is None:
            raise CaptureError(
                "mode='exact' needs real CUDA graphs (it edits kernel nodes through the driver); "
                "on the CPU stand-in use mode='graph'."
            )
        plan = fa_plan(kernel_nodes(raw()), max_t_kv=self.max_t_kv, num_sms=self.num_sms)
        if not plan.mains:
            raise CaptureError(
                f"mode='exact' found no flash-decode attention nodes in the graph of batch size "
                f"{bs}, so there is nothing to retune; use mode='graph', or route decode "
                "attention through stepgraph.kernels.decode.flash_decode (or register your own "
                "split kernel with stepgraph.graph_update.register_split_kernel)."
            )
        return plan

    def apply(self, plan: Any, graph: CapturedGraph, t_kv: int) -> int:
        return fa_apply(plan, graph.raw_cuda_graph_exec(), t_kv, self.split_keys)

    def invalidate(self, plan: Any) -> None:
        plan.invalidate()


def default_exec_updater(model_runner: Any) -> FlashExecUpdater:
    """The flash-decode updater for a model runner exposing ``max_context_len``; it retunes with
    the ladder of the runner's ``attn_backend.split_keys`` where there is one (our model's:
    eager and exact then take the same split counts for any head_dim), else the default."""
    device = torch.device(model_runner.device)
    num_sms = (
        torch.cuda.get_device_properties(device).multi_processor_count
        if device.type == "cuda"
        else 1
    )
    ladder = getattr(getattr(model_runner, "attn_backend", None), "split_keys", None)
    return FlashExecUpdater(int(model_runner.max_context_len), num_sms, ladder)
