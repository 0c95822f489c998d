"""Per-token update of a captured graph's kernel nodes (DESIGN §5), llama.cpp-style exec updates.

Capture a decode step once; before each replay, retune the split-KV attention nodes' grid and
split count to the live context through ``cuGraphExecKernelNodeSetParams``::

    g = torch.cuda.CUDAGraph(keep_graph=True)      # keep_graph: the template nodes must live
    ...capture..., g.instantiate()
    plan = fa_plan(kernel_nodes(g.raw_cuda_graph()), max_t_kv=ctx, num_sms=sms)
    fa_apply(plan, g.raw_cuda_graph_exec(), t_kv); g.replay()

This package is the only code that imports the CUDA driver bindings (lazily, in ``driver.py``).
"""

from __future__ import annotations

from .flash import FaMain, FaPlan, fa_apply, fa_plan
from .nodes import (
    KernelNode,
    kernel_nodes,
    node_census,
    read_i32_arg,
    read_ptr_arg,
    set_exec_params,
    write_i32_arg,
)
from .registry import (
    FLASH_DECODE_SPEC,
    SplitKernelRegistry,
    SplitKernelSpec,
    register_split_kernel,
    unregister_split_kernel,
)

__all__ = [
    "FLASH_DECODE_SPEC",
    "FaMain",
    "FaPlan",
    "KernelNode",
    "SplitKernelRegistry",
    "SplitKernelSpec",
    "fa_apply",
    "fa_plan",
    "kernel_nodes",
    "node_census",
    "read_i32_arg",
    "read_ptr_arg",
    "register_split_kernel",
    "set_exec_params",
    "unregister_split_kernel",
    "write_i32_arg",
]
