"""graph_update.driver and graph_update.nodes on the fake driver: enumeration, argument bytes,
grid edits, pushes into an exec, re-instantiation, and the driver's error reporting."""

from __future__ import annotations

import random
import struct

import pytest

from stepgraph.errors import GraphUpdateError
from stepgraph.graph_update import (
    kernel_nodes,
    node_census,
    read_i32_arg,
    read_ptr_arg,
    set_exec_params,
    write_i32_arg,
)
from stepgraph.graph_update.driver import Driver, check

from .fake_driver import CUresult, FakeDriver

SIZES = (4, 8, 2, 1, 16)  # int32, pointer, half, byte, a small by-value struct


def _random_value(rng: random.Random, size: int) -> bytes:
    return bytes(rng.randrange(256) for _ in range(size))


def _random_graph(rng: random.Random, n_kernels: int = 12):
    """A graph of random kernels (random signatures and argument bytes) among other nodes."""
    fd = FakeDriver()
    g = fd.new_graph()
    expected = {}  # node id -> (name, sizes, values, grid, by_kern)
    for i in range(n_kernels):
        sizes = [rng.choice(SIZES) for _ in range(rng.randrange(0, 9))]
        values = [_random_value(rng, s) for s in sizes]
        name = f"kern_{i}_{rng.randrange(1000)}"
        grid = tuple(rng.randrange(1, 100) for _ in range(3))
        by_kern = rng.random() < 0.3
        kid = fd.cuda.kernel(name, sizes)
        nid = fd.cuda.add_kernel_node(g, kid, values, grid, by_kern=by_kern)
        expected[nid] = (name, sizes, values, grid, by_kern)
        for _ in range(rng.randrange(0, 3)):
            fd.cuda.add_node(g, rng.choice(["MEMCPY", "MEMSET", "EMPTY"]))
    rng.shuffle(fd.cuda.graphs[g])  # the driver's node order is not capture order
    return fd, g, expected


def test_kernel_nodes_enumerates_kernels_only_with_names_layouts_and_bytes():
    rng = random.Random(0)
    for _ in range(20):
        fd, g, expected = _random_graph(rng)
        nodes = kernel_nodes(g, driver=fd)
        assert sorted(int(n.handle) for n in nodes) == sorted(expected)
        for node in nodes:
            name, sizes, values, grid, _ = expected[int(node.handle)]
            assert node.name == name
            assert [s for _, s in node.arg_layout] == sizes
            assert node.grid == grid
            for idx, (size, value) in enumerate(zip(sizes, values)):
                assert fd.read_bytes(node.arg_addr(idx), size) == value
                if size == 4:
                    assert read_i32_arg(node, idx) == struct.unpack("<i", value)[0]
                if size == 8:
                    assert read_ptr_arg(node, idx) == struct.unpack("<Q", value)[0]


def test_node_census_counts_every_type():
    rng = random.Random(1)
    fd, g, expected = _random_graph(rng)
    types = [
        fd.cuda.nodes[n].type.name.removeprefix("CU_GRAPH_NODE_TYPE_").lower()
        for n in fd.cuda.graphs[g]
    ]
    census = node_census(g, driver=fd)
    assert census == {t: types.count(t) for t in set(types)}
    assert census["kernel"] == len(expected)
    assert node_census(fd.new_graph(), driver=fd) == {}


def test_write_i32_round_trip_reaches_exec_only_after_push():
    rng = random.Random(2)
    for _ in range(10):
        fd, g, expected = _random_graph(rng)
        ex = fd.cuda.instantiate(g)
        for node in kernel_nodes(g, driver=fd):
            _, sizes, values, grid, _ = expected[int(node.handle)]
            i32 = [i for i, s in enumerate(sizes) if s == 4]
            if not i32:
                continue
            new = dict(values=list(values))
            for idx in rng.sample(i32, rng.randrange(1, len(i32) + 1)):
                v = rng.randrange(-(2**31), 2**31)
                write_i32_arg(node, idx, v)
                assert read_i32_arg(node, idx) == v
                new["values"][idx] = struct.pack("<i", v)
            axis, gv = rng.randrange(3), rng.randrange(1, 60000)
            node.set_grid(axis, gv)
            new_grid = tuple(gv if a == axis else grid[a] for a in range(3))
            assert node.grid == new_grid
            # the exec still runs what was captured ...
            assert fd.exec_grid(ex, node.handle) == grid
            assert [fd.exec_arg(ex, node.handle, i) for i in range(len(sizes))] == values
            set_exec_params(ex, node)
            # ... until the push; every other argument is carried byte for byte
            assert fd.exec_grid(ex, node.handle) == new_grid
            assert [fd.exec_arg(ex, node.handle, i) for i in range(len(sizes))] == new["values"]


def test_template_is_untouched_so_reinstantiation_gives_the_captured_graph():
    rng = random.Random(3)
    fd, g, expected = _random_graph(rng, 20)
    ex = fd.cuda.instantiate(g)
    nodes = [n for n in kernel_nodes(g, driver=fd) if 4 in [s for _, s in n.arg_layout]]
    assert nodes
    for node in nodes:
        idx = [s for _, s in node.arg_layout].index(4)
        write_i32_arg(node, idx, 123456)
        node.set_grid(2, 7)
        set_exec_params(ex, node)
    ex2 = fd.cuda.instantiate(g, old_exec=ex)
    for node in nodes:
        _, sizes, values, grid, _ = expected[int(node.handle)]
        assert fd.exec_grid(ex2, node.handle) == grid
        assert [fd.exec_arg(ex2, node.handle, i) for i in range(len(sizes))] == values
    # the old exec is gone: pushing to it names the call and the CUresult
    with pytest.raises(GraphUpdateError, match="cuGraphExecKernelNodeSetParams.*INVALID_VALUE"):
        set_exec_params(ex, nodes[0])
    # the edited node can be pushed into the new exec
    set_exec_params(ex2, nodes[0])
    assert fd.exec_grid(ex2, nodes[0].handle)[2] == 7


def test_argument_bounds_name_the_kernel_the_index_and_the_size():
    fd = FakeDriver()
    g = fd.new_graph()
    kid = fd.cuda.kernel("my_kernel", [8, 4, 8])
    fd.cuda.add_kernel_node(g, kid, [0xDEADBEEF, 5, 7], (1, 1, 1))
    (node,) = kernel_nodes(g, driver=fd)
    with pytest.raises(GraphUpdateError, match=r"my_kernel: argument 0 \(int32\) is 8 bytes"):
        write_i32_arg(node, 0, 1)
    with pytest.raises(GraphUpdateError, match=r"my_kernel: argument 2 \(int32\) is 8 bytes"):
        read_i32_arg(node, 2)
    with pytest.raises(GraphUpdateError, match=r"my_kernel: argument 1 \(pointer\) is 4 bytes"):
        read_ptr_arg(node, 1)
    for bad in (3, 17, -1):
        with pytest.raises(GraphUpdateError, match=f"argument {bad} .*does not exist.*3 driver"):
            read_i32_arg(node, bad)
    with pytest.raises(GraphUpdateError, match="not an int32"):
        write_i32_arg(node, 1, 2**31)
    with pytest.raises(GraphUpdateError, match="grid axis 3"):
        node.set_grid(3, 1)
    with pytest.raises(GraphUpdateError, match="outside"):
        node.set_grid(1, 65536)
    with pytest.raises(GraphUpdateError, match="outside"):
        node.set_grid(0, 0)
    assert read_ptr_arg(node, 0) == 0xDEADBEEF and read_i32_arg(node, 1) == 5


def test_extra_packed_arguments_are_refused():
    fd = FakeDriver()
    g = fd.new_graph()
    fd.cuda.add_kernel_node(g, fd.cuda.kernel("packed", [4]), [3], (1, 1, 1), extra=True)
    (node,) = kernel_nodes(g, driver=fd)
    with pytest.raises(GraphUpdateError, match="packed.*extra"):
        read_i32_arg(node, 0)


def test_topological_order_follows_edges_not_driver_order():
    rng = random.Random(4)
    fd = FakeDriver()
    g = fd.new_graph()
    kid = fd.cuda.kernel("k", [4])
    chain = [fd.cuda.add_kernel_node(g, kid, [i], (1, 1, 1)) for i in range(30)]
    fd.chain(g, chain)
    rng.shuffle(fd.cuda.graphs[g])
    nodes = kernel_nodes(g, driver=fd)
    by_order = sorted(nodes, key=lambda n: n.order)
    assert [read_i32_arg(n, 0) for n in by_order] == list(range(30))
    fd.cuda.edges[g].append((chain[-1], chain[0]))
    with pytest.raises(GraphUpdateError, match="cycle"):
        kernel_nodes(g, driver=fd)


# -- driver.py itself ---------------------------------------------------------------------------
def test_check_unwraps_values_and_names_call_and_result():
    assert check("cuX", (CUresult.CUDA_SUCCESS,)) is None
    assert check("cuX", (CUresult.CUDA_SUCCESS, 5)) == 5
    assert check("cuX", (CUresult.CUDA_SUCCESS, 5, 6)) == (5, 6)
    with pytest.raises(GraphUpdateError) as e:
        check("cuGraphExecKernelNodeSetParams", (CUresult.CUDA_ERROR_INVALID_VALUE, None))
    msg = str(e.value)
    assert msg.startswith("cuGraphExecKernelNodeSetParams failed: CUDA_ERROR_INVALID_VALUE; ")
    assert "re-instantiated" in msg and "mode='graph'" in msg


def test_driver_reports_calls_that_raise_and_unknown_handles():
    class Broken:
        CUgraph = FakeDriver().cuda.CUgraph

        def cuGraphGetNodes(self, *a):
            raise RuntimeError("libcuda.so not found")

    d = Driver(Broken())
    with pytest.raises(GraphUpdateError, match="cuGraphGetNodes failed: RuntimeError: libcuda"):
        d.graph_nodes(1)
    fd = FakeDriver()
    with pytest.raises(GraphUpdateError, match="cuGraphGetNodes failed: CUDA_ERROR_INVALID_VALUE"):
        kernel_nodes(999, driver=fd)


def test_names_and_layouts_via_func_or_kern_are_cached_per_function():
    fd = FakeDriver()
    g = fd.new_graph()
    kf, kk = fd.cuda.kernel("via_func", [8, 4]), fd.cuda.kernel("via_kern", [4, 4, 8])
    for _ in range(3):
        fd.cuda.add_kernel_node(g, kf, [1, 2], (1, 1, 1))
        fd.cuda.add_kernel_node(g, kk, [1, 2, 3], (1, 1, 1), by_kern=True)
    calls = []
    for name in ("cuFuncGetName", "cuKernelGetName", "cuFuncGetParamInfo", "cuKernelGetParamInfo"):
        orig = getattr(fd.cuda, name)
        setattr(fd.cuda, name, lambda *a, _n=name, _o=orig: (calls.append(_n), _o(*a))[1])
    nodes = kernel_nodes(g, driver=fd)
    assert sorted(n.name for n in nodes) == ["via_func"] * 3 + ["via_kern"] * 3
    for n in nodes:
        assert [s for _, s in n.arg_layout] == ([8, 4] if n.name == "via_func" else [4, 4, 8])
    assert calls.count("cuFuncGetName") == 1 and calls.count("cuKernelGetName") == 1
    # the layout probe runs until CUDA_ERROR_INVALID_VALUE: n + 1 calls, once per function
    assert calls.count("cuFuncGetParamInfo") == 3 and calls.count("cuKernelGetParamInfo") == 4
