"""The compile counter's logic on the CPU (nothing compiles under the interpreter): variants
counted from kernel caches of made-up JIT functions, the difference of two counts, and the
compile hook counting by name, chaining the hook set before and restoring it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from stepgraph.runner.compiles import CompileCounter, kernel_variants, new_variants


def _jit(module: str, name: str, per_device: list[int]):
    """A stand-in JITFunction: ``device_caches[d][0]`` is the kernel cache of device d."""
    caches = {}
    for d, n in enumerate(per_device):
        caches[d] = ({f"k{i}": object() for i in range(n)}, {}, None, None, None)
    inner = SimpleNamespace(__qualname__=name)
    return SimpleNamespace(module=module, fn=inner, device_caches=caches)


def test_variants_are_counted_over_devices_and_new_ones_found():
    a, b, c = _jit("m", "decode", [2, 1]), _jit("m", "prefill", [0]), _jit("n", "head", [])
    before = kernel_variants([a, b, c])
    assert before == {"m.decode": 3}  # kernels with no variant left out
    b.device_caches[0][0]["new"] = object()  # a prompt of a new length compiled prefill once
    a.device_caches[1][0]["x"] = object()
    after = kernel_variants([a, b, c])
    assert new_variants(before, after) == {"m.decode": 1, "m.prefill": 1}
    assert new_variants(after, after) == {}


def test_every_registered_jit_function_is_read_without_creating_caches():
    pytest.importorskip("triton")
    from triton.runtime.jit import _triton_jit_function_registry as registry

    import stepgraph.kernels.decode.split_kv  # noqa: F401  (registers its kernels)

    sizes = {k: len(getattr(f, "device_caches", {})) for k, f in registry.items()}
    kernel_variants()
    assert {k: len(getattr(f, "device_caches", {})) for k, f in registry.items()} == sizes


def test_the_hook_counts_by_name_chains_and_restores():
    pytest.importorskip("triton")
    from triton import knobs

    seen = []
    knobs.runtime.jit_post_compile_hook = lambda *a, **kw: seen.append(kw["fn"].name)
    try:
        info = SimpleNamespace(module="stepgraph.kernels.x", name="extend")
        with CompileCounter() as counter:
            knobs.runtime.jit_post_compile_hook(key=1, repr="r", fn=info)
            knobs.runtime.jit_post_compile_hook(key=2, repr="r", fn=info)
        assert counter.names == {"stepgraph.kernels.x.extend": 2} and counter.count == 2
        assert seen == ["extend", "extend"]  # the hook set before still ran
        knobs.runtime.jit_post_compile_hook(key=3, repr="r", fn=info)
        assert counter.count == 2 and len(seen) == 3  # restored: no longer counted
    finally:
        knobs.runtime.jit_post_compile_hook = None
