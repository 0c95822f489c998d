"""A stand-in for the CUDA driver, for the CPU tier of ``graph_update``.

``FakeCuda`` mimics the part of ``cuda.bindings.driver`` that ``stepgraph.graph_update.driver``
calls (same names, same ``(CUresult, *values)`` tuples), and ``FakeDriver`` is the real
``Driver`` class running on it, so ``driver.py`` itself is exercised too.

It keeps the driver's rules where they are observable:
- argument bytes are real host memory: ``kernelParams`` is the address of a ``void*`` array whose
  entries point at each argument's bytes (laid out at their ``cuFuncGetParamInfo`` offsets);
- ``cuGraphKernelNodeGetParams`` returns a fresh struct each call, pointing at the node's
  driver-owned array;
- an exec holds its own copy of every kernel node's grid and argument bytes; only
  ``cuGraphExecKernelNodeSetParams`` changes it, copying the bytes the struct points at then;
- instantiating builds a fresh exec from the template node (its stored grid and the bytes behind
  its own array), and re-instantiating destroys the old exec (pushes to it fail).
"""

from __future__ import annotations

import ctypes
import enum
import struct
from dataclasses import dataclass, field

from stepgraph.graph_update.driver import Driver


class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_INVALID_HANDLE = 400


class CUgraphNodeType(enum.IntEnum):
    CU_GRAPH_NODE_TYPE_KERNEL = 0
    CU_GRAPH_NODE_TYPE_MEMCPY = 1
    CU_GRAPH_NODE_TYPE_MEMSET = 2
    CU_GRAPH_NODE_TYPE_EMPTY = 5


class _Handle:
    __slots__ = ("_v",)

    def __init__(self, v: int = 0) -> None:
        self._v = int(v)

    def __int__(self) -> int:
        return self._v

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and int(other) == self._v

    def __hash__(self) -> int:
        return hash((type(self).__name__, self._v))

    def __repr__(self) -> str:
        return f"<{type(self).__name__} 0x{self._v:x}>"


class CUgraph(_Handle):
    pass


class CUgraphExec(_Handle):
    pass


class CUgraphNode(_Handle):
    pass


class CUfunction(_Handle):
    pass


class CUkernel(_Handle):
    pass


@dataclass
class FakeParams:
    """The fields of ``CUDA_KERNEL_NODE_PARAMS`` that graph_update uses."""

    func: CUfunction
    kern: CUkernel
    gridDimX: int
    gridDimY: int
    gridDimZ: int
    blockDimX: int = 128
    blockDimY: int = 1
    blockDimZ: int = 1
    sharedMemBytes: int = 0
    kernelParams: int = 0
    extra: int = 0


@dataclass
class _Kernel:
    name: bytes
    layout: tuple[tuple[int, int], ...]


@dataclass
class _Node:
    graph: int
    type: CUgraphNodeType
    kernel_id: int = 0  # key into FakeCuda.kernels
    by_kern: bool = False  # the node carries a CUkernel and func == 0
    grid: tuple[int, int, int] = (1, 1, 1)
    args: object = None  # ctypes buffer holding the argument bytes (driver-owned)
    array: object = None  # ctypes void* array: kernelParams
    extra: bool = False  # arguments packed through `extra` (kernelParams NULL)


@dataclass
class _Exec:
    graph: int
    live: bool = True
    state: dict[int, tuple[tuple[int, int, int], list[bytes]]] = field(default_factory=dict)


def natural_layout(sizes: list[int]) -> tuple[tuple[int, int], ...]:
    """Offsets as a compiler lays out scalar/pointer parameters (aligned to their size)."""
    out, off = [], 0
    for s in sizes:
        align = min(s, 8)
        off = (off + align - 1) // align * align
        out.append((off, s))
        off += s
    return tuple(out)


class FakeCuda:
    """The cuda.bindings.driver calls graph_update makes, over host memory."""

    CUresult = CUresult
    CUgraph = CUgraph
    CUgraphExec = CUgraphExec

    def __init__(self) -> None:
        self.kernels: dict[int, _Kernel] = {}
        self.nodes: dict[int, _Node] = {}
        self.graphs: dict[int, list[int]] = {}  # node ids, in cuGraphGetNodes order
        self.edges: dict[int, list[tuple[int, int]]] = {}  # (from, to) per graph
        self.execs: dict[int, _Exec] = {}
        self.pushes: list[tuple[int, int]] = []  # (exec, node) per successful push
        self.fail_push_after: int | None = None  # inject an error after this many more pushes
        self._next = 0x1000

    def _id(self) -> int:
        self._next += 0x10
        return self._next

    # -- building graphs (test side) ----------------------------------------------------------
    def kernel(self, name: str, sizes: list[int]) -> int:
        kid = self._id()
        self.kernels[kid] = _Kernel(name.encode(), natural_layout(sizes))
        return kid

    def add_node(self, graph: int, type_name: str) -> int:
        nid = self._id()
        self.nodes[nid] = _Node(graph, CUgraphNodeType[f"CU_GRAPH_NODE_TYPE_{type_name}"])
        self.graphs[graph].append(nid)
        return nid

    def add_kernel_node(self, graph, kid, values, grid, *, by_kern=False, extra=False) -> int:
        layout = self.kernels[kid].layout
        assert len(values) == len(layout)
        nid = self.add_node(graph, "KERNEL")
        size = max((o + s for o, s in layout), default=0)
        args = (ctypes.c_uint64 * ((size + 7) // 8 + 1))()
        base = ctypes.addressof(args)
        for (off, s), v in zip(layout, values):
            raw = v if isinstance(v, bytes) else int(v).to_bytes(s, "little", signed=v < 0)
            assert len(raw) == s
            ctypes.memmove(base + off, raw, s)
        array = (ctypes.c_void_p * max(len(layout), 1))(*[base + o for o, _ in layout])
        self.nodes[nid] = _Node(
            graph,
            CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL,
            kid,
            by_kern,
            tuple(grid),
            args,
            array,
            extra,
        )
        return nid

    def _snapshot(self, node: _Node, grid, array_addr: int) -> tuple:
        layout = self.kernels[node.kernel_id].layout
        ptrs = struct.unpack(f"<{len(layout)}Q", ctypes.string_at(array_addr, 8 * len(layout)))
        return (tuple(grid), [ctypes.string_at(p, s) for p, (_, s) in zip(ptrs, layout)])

    def instantiate(self, graph: int, old_exec: int | None = None) -> int:
        if old_exec is not None:
            self.execs[old_exec].live = False
        eid = self._id()
        ex = self.execs[eid] = _Exec(graph)
        for nid in self.graphs[graph]:
            n = self.nodes[nid]
            if n.type == CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL:
                ex.state[nid] = self._snapshot(n, n.grid, ctypes.addressof(n.array))
        return eid

    # -- the cuda.bindings.driver surface ----------------------------------------------------
    def cuGraphGetNodes(self, graph, numNodes=0):
        g = self.graphs.get(int(graph))
        if g is None:
            return (CUresult.CUDA_ERROR_INVALID_VALUE, None, 0)
        if numNodes == 0:
            return (CUresult.CUDA_SUCCESS, [], len(g))
        nodes = [CUgraphNode(n) for n in g[:numNodes]]
        return (CUresult.CUDA_SUCCESS, nodes + [None] * (numNodes - len(nodes)), len(nodes))

    def cuGraphGetEdges(self, graph, numEdges=0):
        e = self.edges.get(int(graph))
        if e is None:
            return (CUresult.CUDA_ERROR_INVALID_VALUE, None, None, None, 0)
        if numEdges == 0:
            return (CUresult.CUDA_SUCCESS, [], [], [], len(e))
        src = [CUgraphNode(a) for a, _ in e[:numEdges]]
        dst = [CUgraphNode(b) for _, b in e[:numEdges]]
        return (CUresult.CUDA_SUCCESS, src, dst, [None] * len(src), len(src))

    def cuGraphNodeGetType(self, node):
        n = self.nodes.get(int(node))
        if n is None:
            return (CUresult.CUDA_ERROR_INVALID_VALUE, None)
        return (CUresult.CUDA_SUCCESS, n.type)

    def cuGraphKernelNodeGetParams(self, node):
        n = self.nodes.get(int(node))
        if n is None or n.type != CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL:
            return (CUresult.CUDA_ERROR_INVALID_VALUE, None)
        f, k = (0, n.kernel_id) if n.by_kern else (n.kernel_id, 0)
        p = FakeParams(CUfunction(f), CUkernel(k), *n.grid)
        p.kernelParams = 0 if n.extra else ctypes.addressof(n.array)
        p.extra = 0xE0 if n.extra else 0
        return (CUresult.CUDA_SUCCESS, p)

    def _kernel_of(self, handle, kind):
        if not isinstance(handle, kind):
            raise TypeError(f"expected {kind.__name__}, got {type(handle).__name__}")
        return self.kernels.get(int(handle))

    def cuFuncGetName(self, func):
        k = self._kernel_of(func, CUfunction)
        return (CUresult.CUDA_ERROR_INVALID_VALUE, None) if k is None else (CUresult(0), k.name)

    def cuKernelGetName(self, kern):
        k = self._kernel_of(kern, CUkernel)
        return (CUresult.CUDA_ERROR_INVALID_VALUE, None) if k is None else (CUresult(0), k.name)

    def _param_info(self, k, idx):
        if k is None or not 0 <= idx < len(k.layout):
            return (CUresult.CUDA_ERROR_INVALID_VALUE, 0, 0)
        return (CUresult.CUDA_SUCCESS, *k.layout[idx])

    def cuFuncGetParamInfo(self, func, idx):
        return self._param_info(self._kernel_of(func, CUfunction), idx)

    def cuKernelGetParamInfo(self, kern, idx):
        return self._param_info(self._kernel_of(kern, CUkernel), idx)

    def cuGraphExecKernelNodeSetParams(self, exec_, node, params):
        assert isinstance(exec_, CUgraphExec), "exec must be converted to a handle"
        ex, n = self.execs.get(int(exec_)), self.nodes.get(int(node))
        if ex is None or not ex.live or n is None or n.graph != ex.graph:
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)
        if self.fail_push_after is not None:
            if self.fail_push_after == 0:
                self.fail_push_after = None
                return (CUresult.CUDA_ERROR_INVALID_VALUE,)
            self.fail_push_after -= 1
        if (int(params.func) or int(params.kern)) != n.kernel_id or not params.kernelParams:
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)
        grid = (params.gridDimX, params.gridDimY, params.gridDimZ)
        ex.state[int(node)] = self._snapshot(n, grid, params.kernelParams)
        self.pushes.append((int(exec_), int(node)))
        return (CUresult.CUDA_SUCCESS,)


class FakeDriver(Driver):
    """The real ``Driver`` over ``FakeCuda``, plus the test-side helpers to build graphs."""

    def __init__(self) -> None:
        self.cuda = FakeCuda()
        super().__init__(self.cuda)

    def new_graph(self) -> int:
        gid = self.cuda._id()
        self.cuda.graphs[gid] = []
        self.cuda.edges[gid] = []
        return gid

    def chain(self, graph: int, nodes: list[int]) -> None:
        """Add edges that run ``nodes`` one after the other (a single-stream capture)."""
        self.cuda.edges[graph] += list(zip(nodes, nodes[1:]))

    def exec_grid(self, exec_: int, node) -> tuple[int, int, int]:
        return self.cuda.execs[exec_].state[int(node)][0]

    def exec_arg(self, exec_: int, node, idx: int) -> bytes:
        return self.cuda.execs[exec_].state[int(node)][1][idx]
