"""Kernel nodes of a captured graph: enumerate them, read and edit their arguments and grid, and
push the edit into an instantiated exec with ``cuGraphExecKernelNodeSetParams``.

Editing model. ``cuGraphKernelNodeGetParams`` hands back a params struct whose ``kernelParams``
is a driver-owned ``void*`` array, one pointer per argument. The first write to a node copies
that array and the argument bytes into a host buffer the node owns (its *staging*) and points the
struct's ``kernelParams`` at it; later writes go into the staging. The template node is never
touched, so a re-instantiated exec is exactly the captured graph (consistent, fixed geometry)
until the plan is re-applied, instead of a mix of captured grids and edited arguments. A write
alone does not reach the exec: :func:`set_exec_params` pushes it, and the driver copies the
arguments at that call. The staging lives as long as the node, so nothing handed to the driver
is freed early.
"""

from __future__ import annotations

import heapq
import struct
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ..errors import GraphUpdateError
from .driver import get_driver

_GRID_FIELDS = ("gridDimX", "gridDimY", "gridDimZ")
_GRID_LIMITS = (2**31 - 1, 65535, 65535)  # CUDA's per-axis grid limits
_I32 = struct.Struct("<i")
_U64 = struct.Struct("<Q")


@dataclass(eq=False)
class KernelNode:
    """One kernel node of a captured graph.

    ``params`` is the node's launch struct (grid, block, shared memory, ``kernelParams``); it is
    edited in place and pushed back whole by :func:`set_exec_params`. ``name`` is the kernel's
    symbol (for Triton kernels, the Python function's name).
    """

    handle: Any  # CUgraphNode of the template graph (identifies the node in every exec)
    params: Any  # CUDA_KERNEL_NODE_PARAMS(_v2)
    name: str
    driver: Any = field(repr=False)
    order: int | None = None  # position in a topological order of the whole graph
    _layout: tuple[tuple[int, int], ...] | None = field(default=None, repr=False)
    _arg_addrs: list[int] | None = field(default=None, repr=False)
    _staging: Any = field(default=None, repr=False)  # HostBuffer once edited

    # -- launch geometry ----------------------------------------------------------------------
    @property
    def grid(self) -> tuple[int, int, int]:
        p = self.params
        return (p.gridDimX, p.gridDimY, p.gridDimZ)

    @property
    def block(self) -> tuple[int, int, int]:
        p = self.params
        return (p.blockDimX, p.blockDimY, p.blockDimZ)

    def set_grid(self, axis: int, value: int) -> None:
        """Set one grid axis (0 = x, 1 = y, 2 = z). Pushed by :func:`set_exec_params`."""
        if axis not in (0, 1, 2):
            raise GraphUpdateError(f"kernel {self.name}: grid axis {axis} is not 0, 1 or 2")
        if not 1 <= value <= _GRID_LIMITS[axis]:
            raise GraphUpdateError(
                f"kernel {self.name}: grid axis {axis} = {value} is outside "
                f"[1, {_GRID_LIMITS[axis]}]"
            )
        setattr(self.params, _GRID_FIELDS[axis], value)

    # -- arguments ----------------------------------------------------------------------------
    @property
    def arg_layout(self) -> tuple[tuple[int, int], ...]:
        """``(offset, size)`` per driver-level parameter (``cuFuncGetParamInfo``)."""
        if self._layout is None:
            self._layout = tuple(self.driver.param_info(self.params))
        return self._layout

    def arg_addr(self, idx: int) -> int:
        """Host address of argument ``idx``'s bytes (the staging's once the node was edited)."""
        if self._arg_addrs is None:
            array = int(self.params.kernelParams)
            if not array:
                raise GraphUpdateError(
                    f"kernel {self.name}: the node passes its arguments through `extra`, not "
                    "kernelParams, so they cannot be read or edited; launch it with kernelParams"
                )
            raw = self.driver.read_bytes(array, 8 * len(self.arg_layout))
            self._arg_addrs = [_U64.unpack_from(raw, 8 * i)[0] for i in range(len(self.arg_layout))]
        return self._arg_addrs[idx]

    def check_arg(self, idx: int, size: int, what: str) -> None:
        """Raise unless argument ``idx`` exists and is ``size`` bytes."""
        layout = self.arg_layout
        if not 0 <= idx < len(layout):
            raise GraphUpdateError(
                f"kernel {self.name}: argument {idx} ({what}) does not exist; the kernel has "
                f"{len(layout)} driver-level parameters with sizes {[s for _, s in layout]} "
                "(Triton drops constexpr and specialised args and appends 2 scratch pointers)"
            )
        found = layout[idx][1]
        if found != size:
            raise GraphUpdateError(
                f"kernel {self.name}: argument {idx} ({what}) is {found} bytes, expected {size}; "
                "the kernel's signature is not what the update plan assumes"
            )

    def stage(self) -> None:
        """Copy the arguments into node-owned staging and point ``kernelParams`` at it (once)."""
        if self._staging is not None:
            return
        layout = self.arg_layout
        n = len(layout)
        head = 8 * n  # the pointer array; argument bytes follow at their device-layout offsets
        total = head + max((off + size for off, size in layout), default=0)
        buf = self.driver.alloc(total)
        addrs = []
        for i, (off, size) in enumerate(layout):
            dst = buf.addr + head + off
            self.driver.write_bytes(dst, self.driver.read_bytes(self.arg_addr(i), size))
            addrs.append(dst)
        self.driver.write_bytes(buf.addr, b"".join(_U64.pack(a) for a in addrs))
        self._staging = buf
        self._arg_addrs = addrs
        self.params.kernelParams = buf.addr

    def i32_slot(self, idx: int) -> Any:
        """A live int32 view of argument ``idx`` in the staging (``.value = n``; hot path)."""
        self.check_arg(idx, 4, "int32")
        self.stage()
        return self.driver.i32_view(self._arg_addrs[idx])


def read_i32_arg(node: KernelNode, idx: int) -> int:
    """Read int32 argument ``idx`` as the node would launch it now."""
    node.check_arg(idx, 4, "int32")
    return _I32.unpack(node.driver.read_bytes(node.arg_addr(idx), 4))[0]


def write_i32_arg(node: KernelNode, idx: int, value: int) -> None:
    """Overwrite int32 argument ``idx``. Does NOT reach the exec until :func:`set_exec_params`."""
    node.check_arg(idx, 4, "int32")
    if not -(2**31) <= value < 2**31:
        raise GraphUpdateError(f"kernel {node.name}: argument {idx} = {value} is not an int32")
    node.stage()
    node.driver.write_bytes(node.arg_addr(idx), _I32.pack(value))


def read_ptr_arg(node: KernelNode, idx: int) -> int:
    """Read pointer argument ``idx`` (a device address, as an unsigned 64-bit int)."""
    node.check_arg(idx, 8, "pointer")
    return _U64.unpack(node.driver.read_bytes(node.arg_addr(idx), 8))[0]


def set_exec_params(exec_: Any, node: KernelNode) -> None:
    """Push the node's edited struct (grid and arguments) into the instantiated ``exec_``.

    Topology-preserving: no re-instantiation. ``exec_`` is ``raw_cuda_graph_exec()`` (an int) or
    a driver handle.
    """
    d = node.driver
    d.exec_set_params(d.exec_handle(exec_), node.handle, node.params)


def _topological_ranks(nodes: list[Any], edges: list[tuple[Any, Any]]) -> dict[int, int]:
    """Rank of each node in a topological order (ties broken by the driver's node order)."""
    index = {int(n): i for i, n in enumerate(nodes)}
    after: dict[int, list[int]] = {i: [] for i in range(len(nodes))}
    pending = [0] * len(nodes)
    for src, dst in edges:
        a, b = index[int(src)], index[int(dst)]
        after[a].append(b)
        pending[b] += 1
    ready = [i for i in range(len(nodes)) if not pending[i]]
    heapq.heapify(ready)
    ranks: dict[int, int] = {}
    while ready:
        i = heapq.heappop(ready)
        ranks[int(nodes[i])] = len(ranks)
        for j in after[i]:
            pending[j] -= 1
            if not pending[j]:
                heapq.heappush(ready, j)
    if len(ranks) != len(nodes):
        raise GraphUpdateError("the graph's dependency edges form a cycle; is it a CUDA graph?")
    return ranks


def kernel_nodes(graph: Any, driver: Any = None) -> list[KernelNode]:
    """Every kernel node of the template ``graph`` (``raw_cuda_graph()``), in driver order.

    Memcpy, memset, empty and other nodes are skipped: they replay as captured. Each node's
    ``order`` is its rank in a topological order of the graph (what ``fa_plan`` uses to pair
    mains and combines that share one workspace).
    """
    d = driver if driver is not None else get_driver()
    nodes = d.graph_nodes(graph)
    try:
        edges = d.graph_edges(graph)
    except GraphUpdateError:
        # Order only matters when layers share one workspace; fa_plan then refuses clearly
        # (order None) instead of every plan failing here.
        edges = None
    ranks = _topological_ranks(nodes, edges) if edges is not None else {}
    out = []
    for node in nodes:
        if d.node_type(node) == "KERNEL":
            params = d.kernel_params(node)
            out.append(KernelNode(node, params, d.func_name(params), d, ranks.get(int(node))))
    return out


def node_census(graph: Any, driver: Any = None) -> dict[str, int]:
    """Node count by type, e.g. ``{"kernel": 40, "memset": 2}`` (mem_alloc/mem_free nodes are
    the usual suspects when a graph launch is slow)."""
    d = driver if driver is not None else get_driver()
    counts = Counter(d.node_type(n).lower() for n in d.graph_nodes(graph))
    return dict(sorted(counts.items()))
