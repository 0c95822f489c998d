"""The one place that talks to the CUDA driver (cuda-bindings) and reads raw argument bytes.

Everything else in ``graph_update`` calls the methods of a :class:`Driver` (or of the fake in
``tests/fake_driver.py``, which has the same methods). ``cuda.bindings.driver`` is imported on
first use, so ``import stepgraph`` works without cuda-bindings or without an NVIDIA driver; only
the calls fail, with a :class:`GraphUpdateError` that names the call and the ``CUresult``.

Handles are accepted as ints (``torch.cuda.CUDAGraph.raw_cuda_graph()`` and
``raw_cuda_graph_exec()`` return ints) or as cuda-bindings handle objects.
"""

from __future__ import annotations

import ctypes
from typing import Any

from ..errors import GraphUpdateError

_NODE_TYPE_PREFIX = "CU_GRAPH_NODE_TYPE_"

# What to try when a call fails; every message also gives the escape hatch.
_HINTS = {
    "CUDA_ERROR_INVALID_VALUE": "the node, exec or params do not match (was the graph "
    "re-instantiated or destroyed? rebuild the plan, or call plan.invalidate())",
    "CUDA_ERROR_INVALID_HANDLE": "the handle is stale: the graph or exec it came from is gone",
    "CUDA_ERROR_NOT_INITIALIZED": "no CUDA context yet: run any torch CUDA op first",
    "CUDA_ERROR_INVALID_CONTEXT": "no current CUDA context on this thread: run a torch CUDA op "
    "on this thread first",
}
_ESCAPE = "escape hatch: replay without per-token updates (mode='graph')"


def _fail(name: str, what: str, hint: str | None = None) -> GraphUpdateError:
    hint = hint or "see the CUDA driver API docs for this call"
    return GraphUpdateError(f"{name} failed: {what}; {hint}; {_ESCAPE}")


def check(name: str, result: tuple) -> Any:
    """Unwrap a cuda-bindings result tuple ``(CUresult, *values)``.

    Raises :class:`GraphUpdateError` naming the call and the ``CUresult`` on failure; returns
    None, the single value, or the tuple of values.
    """
    err, values = result[0], result[1:]
    if err:  # CUresult is an int enum; CUDA_SUCCESS == 0
        ename = getattr(err, "name", str(err))
        raise _fail(name, ename, _HINTS.get(ename))
    if not values:
        return None
    return values[0] if len(values) == 1 else values


def _load_bindings() -> Any:
    try:
        from cuda.bindings import driver as cuda_driver
    except ImportError as e:
        raise GraphUpdateError(
            "cuda-bindings is not importable, so graph nodes cannot be edited; "
            f"pip install cuda-bindings; {_ESCAPE}"
        ) from e
    return cuda_driver


class HostBuffer:
    """Host memory we own and may hand to the driver (kept alive by whoever holds this)."""

    __slots__ = ("_raw", "addr", "nbytes")

    def __init__(self, nbytes: int) -> None:
        # 8-byte aligned: pointer arrays and 8-byte args live in it.
        self._raw = (ctypes.c_uint64 * ((nbytes + 7) // 8))()
        self.addr = ctypes.addressof(self._raw)
        self.nbytes = nbytes


class Driver:
    """Thin wrapper over the cuda-bindings calls ``graph_update`` needs; one call per method.

    Name and parameter-layout look-ups are cached per function handle: the 16 layers of a model
    share a handful of kernels.
    """

    def __init__(self, bindings: Any = None) -> None:
        self._d = bindings if bindings is not None else _load_bindings()
        self._names: dict[tuple[int, int], str] = {}
        self._layouts: dict[tuple[int, int], tuple[tuple[int, int], ...]] = {}

    def _call(self, name: str, *args: Any) -> Any:
        try:
            result = getattr(self._d, name)(*args)
        except GraphUpdateError:
            raise
        except Exception as e:  # no libcuda.so, no driver, wrong handle type, ...
            raise _fail(name, f"{type(e).__name__}: {e}", "is an NVIDIA driver installed?") from e
        return check(name, result)

    # -- handles ----------------------------------------------------------------------------
    def graph_handle(self, graph: Any) -> Any:
        return graph if isinstance(graph, self._d.CUgraph) else self._d.CUgraph(int(graph))

    def exec_handle(self, exec_: Any) -> Any:
        return exec_ if isinstance(exec_, self._d.CUgraphExec) else self._d.CUgraphExec(int(exec_))

    # -- graph structure --------------------------------------------------------------------
    def graph_nodes(self, graph: Any) -> list[Any]:
        g = self.graph_handle(graph)
        _, count = self._call("cuGraphGetNodes", g, 0)  # nodes=NULL: count only
        if not count:
            return []
        nodes, count = self._call("cuGraphGetNodes", g, count)
        return list(nodes[:count])

    def graph_edges(self, graph: Any) -> list[tuple[Any, Any]]:
        """Dependency edges ``(from, to)``: ``to`` runs after ``from``."""
        g = self.graph_handle(graph)
        *_, count = self._call("cuGraphGetEdges", g, 0)  # from/to=NULL: count only
        if not count:
            return []
        src, dst, _data, count = self._call("cuGraphGetEdges", g, count)
        return list(zip(src[:count], dst[:count]))

    def node_type(self, node: Any) -> str:
        """``"KERNEL"``, ``"MEMCPY"``, ``"MEMSET"``, ``"EMPTY"``, ... (prefix stripped)."""
        t = self._call("cuGraphNodeGetType", node)
        return t.name.removeprefix(_NODE_TYPE_PREFIX)

    def kernel_params(self, node: Any) -> Any:
        """The node's ``CUDA_KERNEL_NODE_PARAMS`` (``_v2``); ``kernelParams`` is driver-owned."""
        return self._call("cuGraphKernelNodeGetParams", node)

    # -- functions --------------------------------------------------------------------------
    def _func_key(self, params: Any) -> tuple[int, int]:
        # Some nodes carry a CUkernel (``kern``) and leave ``func`` 0: handle both.
        func = int(params.func)
        if func:
            return (0, func)
        kern = int(params.kern)
        if not kern:
            raise _fail("cuFuncGetName", "node has neither func nor kern", "not a kernel node?")
        return (1, kern)

    def func_name(self, params: Any) -> str:
        key = self._func_key(params)
        name = self._names.get(key)
        if name is None:
            if key[0] == 0:
                raw = self._call("cuFuncGetName", params.func)
            else:
                raw = self._call("cuKernelGetName", params.kern)
            name = raw.decode() if isinstance(raw, bytes) else str(raw)
            self._names[key] = name
        return name

    def param_info(self, params: Any) -> tuple[tuple[int, int], ...]:
        """``(offset, size)`` of each driver-level parameter, in order."""
        key = self._func_key(params)
        layout = self._layouts.get(key)
        if layout is None:
            fn, handle = (
                ("cuFuncGetParamInfo", params.func)
                if key[0] == 0
                else ("cuKernelGetParamInfo", params.kern)
            )
            out: list[tuple[int, int]] = []
            invalid = self._d.CUresult.CUDA_ERROR_INVALID_VALUE
            while True:  # no count call on older drivers: probe until the index is out of range
                try:
                    result = getattr(self._d, fn)(handle, len(out))
                except Exception as e:
                    raise _fail(fn, f"{type(e).__name__}: {e}", "is a driver installed?") from e
                if result[0] == invalid:
                    break
                offset, size = check(fn, result)
                out.append((int(offset), int(size)))
            layout = tuple(out)
            self._layouts[key] = layout
        return layout

    # -- the update -------------------------------------------------------------------------
    def exec_set_params(self, exec_: Any, node: Any, params: Any) -> None:
        """Push ``params`` for ``node`` into the instantiated ``exec_`` (hot path: no wrapper)."""
        try:
            (err,) = self._d.cuGraphExecKernelNodeSetParams(exec_, node, params)
        except Exception as e:
            raise _fail("cuGraphExecKernelNodeSetParams", f"{type(e).__name__}: {e}") from e
        if err:
            check("cuGraphExecKernelNodeSetParams", (err,))

    # -- host memory: the argument bytes behind kernelParams --------------------------------
    @staticmethod
    def read_bytes(addr: int, n: int) -> bytes:
        if not addr:
            raise GraphUpdateError("read of a NULL host address (kernelParams missing?)")
        return ctypes.string_at(addr, n)

    @staticmethod
    def write_bytes(addr: int, data: bytes) -> None:
        if not addr:
            raise GraphUpdateError("write to a NULL host address (kernelParams missing?)")
        ctypes.memmove(addr, data, len(data))

    @staticmethod
    def alloc(nbytes: int) -> HostBuffer:
        return HostBuffer(nbytes)

    @staticmethod
    def i32_view(addr: int) -> ctypes.c_int32:
        """A live int32 view of ``addr`` (``.value = n`` is the cheapest write; hot path)."""
        return ctypes.c_int32.from_address(addr)


_DRIVER: Driver | None = None


def get_driver() -> Driver:
    """The process-wide real :class:`Driver`, created on first use."""
    global _DRIVER
    if _DRIVER is None:
        _DRIVER = Driver()
    return _DRIVER
