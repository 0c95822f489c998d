"""Programmatic dependent launch (PDL) for the fused decode kernels: when to use it, the launch
option, and the two device calls.

With ``launch_pdl=True`` (Triton 3.4 and later, Hopper and later) a kernel may start while its
predecessor in the stream is still running: it issues its weight loads, then ``gdc_wait()``
blocks until the predecessor has finished and its writes are visible. ``gdc_launch_dependents()``
lets the next PDL kernel start its own prologue. It saves about a launch's latency per kernel
inside a CUDA graph, and the programmatic edges survive torch's capture (docs/design.md §8).

The rules every kernel here keeps (tests/gpu/test_fused_step_kernels_gpu.py checks the PTX):
- ``gdc_wait()`` before reading anything a predecessor wrote (activations, positions, the KV
  cache) and before writing anything; only weights (never written during a step) load before it;
- the wait comes before any loop, since the software pipeliner may hoist a loop's loads;
- ``gdc_launch_dependents()`` after the wait (before it, a whole chain of waiting kernels could
  occupy the SMs), except in modes 4 and 5 below, for a kernel whose dependent triggers after
  its own wait, so that one kernel at most waits ahead. Where after it is the trigger mode,
  ``USE_PDL``'s value: 1 right after the wait, so the next kernel prefetches its weights while
  this one streams, one kernel ahead (the one-row GEMVs); 2 after the main loop (the
  tensor-core tiles from two rows: docs/experiments.md#the-late-trigger-from-two-rows). The
  trigger only schedules; the wait still sees every write.
The wait is transitive: a kernel finishes only after its own wait returned, so waiting on the
predecessor also orders it after every earlier kernel.

Fallback: on the CPU interpreter, before Hopper, or with PDL off (``DecodeTuning.pdl.enabled``,
``STEPGRAPH_PDL=0`` in ``DecodeTuning.default()``) the kernels get
``USE_PDL=False`` (a constexpr: the calls are compiled out) and are launched without the option.
"""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

if TYPE_CHECKING:
    from ..tuning import DecodeTuning

try:  # Triton >= 3.4
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    HAS_GDC = True
except ImportError:  # pragma: no cover - older Triton: never called (USE_PDL is False)
    HAS_GDC = False

    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass


# Where a kernel lets its dependents launch, the ``USE_PDL`` value of a PDL launch: 1 "wait",
# right after its wait; 2 "late", after its main loop (the projections' K loop, the attention's
# key loop; a kernel without one triggers at its wait); 3 "exit", never explicitly (the
# dependents launch as its programs finish). The callers pick it (the fused step: "late" from
# two rows, docs/experiments.md#pdl-placement); ``DecodeTuning.pdl.trigger`` (wait, late or
# exit), when set, overrides the mode of every launch in one of these three.
# Two more, for the attention at one row (``step_attention``): 4 "early", the trigger before
# the wait (the combine: o_proj then launches while the split kernel runs; safe as long as the
# dependent triggers after its own wait, so at most one more kernel waits on the SMs); 5
# "detached", compiled with the trigger at its start and launched *without* the PDL attribute
# (the split kernel: it starts only once its predecessor has finished, as a plain launch, yet
# lets its PDL dependent launch at once; no wait is compiled, there being nothing to wait on).
TRIGGER_MODES = {"wait": 1, "late": 2, "exit": 3, "early": 4, "detached": 5}
DETACHED = TRIGGER_MODES["detached"]


@functools.cache
def hopper_or_later(index: int) -> bool:
    """Whether CUDA device ``index`` has compute capability 9.0 or later (PDL, TMA)."""
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_enabled(device: torch.device | str | None) -> bool:
    """True when kernels on ``device`` should be launched with PDL: a CUDA device of compute
    capability 9.0 or later, compiled Triton (not ``TRITON_INTERPRET=1``) that has the device
    calls (``DecodeTuning.pdl.enabled`` is checked beside it, ``resolve_pdl``)."""
    if device is None or not HAS_GDC:
        return False
    device = torch.device(device)
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1":
        return False
    return hopper_or_later(device.index if device.index is not None else 0)


def trigger_mode(default: int = 1, override: str | None = None) -> int:
    """The trigger mode of a PDL launch: ``override``'s (wait, late or exit; anything else is
    refused by name) where given, else ``default``; the attention's early and detached launches
    keep theirs."""
    if override is None or default >= TRIGGER_MODES["early"]:
        return default
    if override not in ("wait", "late", "exit"):
        raise ValueError(f"pdl.trigger={override!r}: expected one of exit, late, wait")
    return TRIGGER_MODES[override]


def resolve_pdl(
    use_pdl: bool | int | None, device: torch.device | str, tuning: DecodeTuning | None = None
) -> int:
    """``USE_PDL`` for a launch on ``device``: False (0) where PDL is off or cannot run, else a
    trigger mode (1 == True). ``use_pdl``: None (the device's default, mode 1), False, True
    (mode 1) or a mode of ``TRIGGER_MODES``; ``tuning.pdl`` (None: ``DecodeTuning.default()``)
    turns PDL off or overrides the mode."""
    if use_pdl not in (None, False, True, *TRIGGER_MODES.values()):
        raise ValueError(f"use_pdl={use_pdl!r}: expected None, a bool or a trigger mode 1-5")
    from ..tuning import default_tuning

    placement = default_tuning(tuning).pdl
    supported = placement.enabled and pdl_enabled(device)
    on = supported if use_pdl is None else (bool(use_pdl) and supported)
    return trigger_mode(1 if use_pdl is None else int(use_pdl), placement.trigger) if on else False


def launch_options(use_pdl: bool | int) -> dict:
    """Extra keyword arguments of a kernel launch: ``{"launch_pdl": True}`` or nothing (the
    interpreter and old Triton do not know the option; a "detached" kernel has none)."""
    return {"launch_pdl": True} if use_pdl and use_pdl != DETACHED else {}


@triton.jit
def _wait_and_trigger(USE_PDL: tl.constexpr, TRIGGER_AT_WAIT: tl.constexpr):
    # the trigger first in modes 4-5, the wait unless detached (5), then the trigger in modes
    # up to TRIGGER_AT_WAIT
    if USE_PDL:
        if USE_PDL >= 4:
            gdc_launch_dependents()
        if USE_PDL != 5:  # detached: launched plainly, nothing to wait on
            gdc_wait()
        if USE_PDL <= TRIGGER_AT_WAIT:
            gdc_launch_dependents()


@triton.jit
def pdl_wait_then_trigger(USE_PDL: tl.constexpr):
    """Wait for the predecessor, then (trigger mode 1) let the next kernel start its prologue;
    modes 4 and 5 trigger first (see above)."""
    _wait_and_trigger(USE_PDL, 1)


@triton.jit
def pdl_trigger_late(USE_PDL: tl.constexpr):
    """Trigger mode 2: let the next kernel start, after this program's main loop."""
    if USE_PDL == 2:
        gdc_launch_dependents()


@triton.jit
def pdl_wait_then_trigger_short(USE_PDL: tl.constexpr):
    """``pdl_wait_then_trigger`` for a kernel without a main loop: mode 2 triggers at its wait
    too."""
    _wait_and_trigger(USE_PDL, 2)


__all__ = [
    "DETACHED",
    "HAS_GDC",
    "TRIGGER_MODES",
    "gdc_launch_dependents",
    "gdc_wait",
    "hopper_or_later",
    "launch_options",
    "pdl_enabled",
    "pdl_trigger_late",
    "pdl_wait_then_trigger",
    "pdl_wait_then_trigger_short",
    "resolve_pdl",
    "trigger_mode",
]
