"""Exact split geometry for a captured decode graph (DESIGN §5).

``fa_plan`` finds every registered split kernel (main + combine) among a graph's kernel nodes and
pairs them by the identity of their shared pointer argument; ``fa_apply`` then retunes, before a
replay, each main's split grid axis and each combine's split count to what eager would launch for
the live ``t_kv``, pushing only when the count steps. Everything else replays as captured.

After ``g.instantiate()`` builds a fresh exec (every edit lost), call ``plan.invalidate()``; the
plan also notices on its own when ``fa_apply`` is handed a different exec. The node handles and
their staging stay valid as long as the template graph (``keep_graph=True``) does, so the plan
need not be rebuilt.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError, GraphUpdateError
from ..kernels.decode.splits import fa_split_keys, monotone_steps, splits_from_keys
from .nodes import _GRID_FIELDS, KernelNode, read_i32_arg, read_ptr_arg
from .registry import (
    DEFAULT_REGISTRY,
    SplitKernelRegistry,
    SplitKernelSpec,
    SplitKeys,
    TwoArgSplitKeys,
    as_split_keys,
)

_default_split_keys: SplitKeys = fa_split_keys


@dataclass(eq=False)
class FaMain:
    """One main split node with its paired combine: the unit ``fa_apply`` retunes.

    ``bucket_splits`` is the main's split grid value at capture (the upper clamp); ``ns`` is the
    split count currently applied in the plan's exec (None: unknown, i.e. as captured).
    ``bs`` and ``n_kv_heads`` come from the main's grid (ladder rule only).
    """

    main: KernelNode
    combine: KernelNode | None  # None: a main that merges its own splits
    spec: SplitKernelSpec
    bucket_splits: int
    bs: int | None = None
    n_kv_heads: int | None = None
    ns: int | None = None


@dataclass(eq=False)
class _Group:
    """Mains whose split count is the same function of ``t_kv`` (computed once per apply)."""

    block_n: int  # self-limiting rule; 0 for the ladder
    bs: int
    n_kv_heads: int
    bucket: int
    members: list[FaMain]
    # Per member, what the push needs, resolved at plan time (hot path: no look-ups):
    # (FaMain, main handle, main params, grid field, main int32 slot or None,
    #  combine handle, combine params, combine int32 slot)
    pushes: list[tuple] = field(default_factory=list)
    applied: int | None = None
    # ``applied`` is known to be the count for every t_kv in [lo, hi] (empty: 1 > 0)
    lo: int = 1
    hi: int = 0
    table: tuple[list[int], list[int]] | None = None  # ladder steps (monotone ladders only)


@dataclass(eq=False)
class FaPlan:
    """The retunable split kernels of one captured graph, and what is applied in its exec."""

    mains: list[FaMain]
    max_t_kv: int
    num_sms: int
    driver: Any = field(default=None, repr=False)
    _groups: list[_Group] = field(default_factory=list, repr=False)
    _exec_key: Any = field(default=None, repr=False)
    _exec_handle: Any = field(default=None, repr=False)
    _split_keys: Any = field(default=None, repr=False)  # the ladder the intervals were built for
    _ladder: Any = field(default=None, repr=False)  # ... with our four-argument signature
    _has_ladder: bool = field(default=False, repr=False)

    def invalidate(self) -> None:
        """Forget what was applied (the exec was re-instantiated): the next apply pushes all."""
        self._exec_key = self._exec_handle = None
        for g in self._groups:
            g.applied, g.lo, g.hi = None, 1, 0
        for m in self.mains:
            m.ns = None


def _pair_error(spec: SplitKernelSpec, kernel: str, arg: int, what: str) -> GraphUpdateError:
    return GraphUpdateError(
        f"kernel {kernel}: argument {arg} (pairing pointer of {spec.main}/{spec.combine}) {what}; "
        "the update plan cannot tell which combine reduces which main; escape hatch: mode='graph'"
    )


def _pairs(spec: SplitKernelSpec, ptr: int, ms: list[KernelNode], cs: list[KernelNode]):
    """Pair the mains and combines that share pointer ``ptr``.

    One of each: paired by the pointer alone, whatever the node order. Several (all layers share
    one workspace): paired in graph order, which must alternate main, combine, main, ... since
    each main overwrites the partials the previous combine read.
    """
    if not cs:
        raise _pair_error(spec, ms[0].name, spec.main_ptr_arg, f"0x{ptr:x} has no combine")
    if not ms:
        raise _pair_error(spec, cs[0].name, spec.combine_ptr_arg, f"0x{ptr:x} has no main")
    if len(ms) == len(cs) == 1:
        return [(ms[0], cs[0])]
    shared = f"0x{ptr:x} is shared by {len(ms)} {spec.main} and {len(cs)} {spec.combine} nodes"
    if any(n.order is None for n in ms + cs):
        shared += " and the graph order is unknown (kernel_nodes could not read the edges)"
    if len(ms) != len(cs) or any(n.order is None for n in ms + cs):
        if len(cs) > len(ms):
            raise _pair_error(spec, cs[0].name, spec.combine_ptr_arg, shared)
        raise _pair_error(spec, ms[0].name, spec.main_ptr_arg, shared)
    seq = sorted(ms + cs, key=lambda n: n.order)
    mains, combines = seq[0::2], seq[1::2]
    if any(n.name != spec.main for n in mains) or any(n.name != spec.combine for n in combines):
        raise _pair_error(
            spec,
            ms[0].name,
            spec.main_ptr_arg,
            shared + " that do not alternate main, combine in graph order",
        )
    return list(zip(mains, combines))


def fa_plan(
    nodes: Iterable[KernelNode],
    *,
    max_t_kv: int,
    num_sms: int,
    registry: SplitKernelRegistry | None = None,
) -> FaPlan:
    """Find and pair every registered main/combine among ``nodes`` (from ``kernel_nodes``).

    ``max_t_kv`` is the context the graph was captured for; ``num_sms`` feeds the ladder. A plan
    with no mains is returned empty (the caller decides whether that is an error).
    """
    if max_t_kv < 1 or num_sms < 1:
        raise ConfigError(
            f"fa_plan needs max_t_kv >= 1 and num_sms >= 1 (got {max_t_kv}, {num_sms})"
        )
    reg = registry if registry is not None else DEFAULT_REGISTRY
    found: dict[tuple[str, int], tuple[list[KernelNode], list[KernelNode]]] = {}
    driver = None
    for node in nodes:
        if (spec := reg.by_main.get(node.name)) is not None:
            idx, side = spec.main_ptr_arg, 0
            node.check_arg(idx, 8, "pairing pointer")
            if spec.main_splits_arg is not None:
                node.check_arg(spec.main_splits_arg, 4, "split count, int32")
        elif (spec := reg.by_combine.get(node.name)) is not None:
            idx, side = spec.combine_ptr_arg, 1
            node.check_arg(idx, 8, "pairing pointer")
            node.check_arg(spec.combine_splits_arg, 4, "split count, int32")
        else:
            continue  # not ours: replays as captured
        driver = driver or node.driver
        key = (spec.main, read_ptr_arg(node, idx))
        found.setdefault(key, ([], []))[side].append(node)

    plan = FaPlan([], max_t_kv, num_sms, driver)
    groups: dict[tuple[int, int, int, int], _Group] = {}
    for (main_name, ptr), (ms, cs) in found.items():
        spec = reg.by_main[main_name]
        pairs = [(m, None) for m in ms] if spec.combine is None else _pairs(spec, ptr, ms, cs)
        for main, combine in pairs:
            _add(plan, groups, spec, main, combine)
    plan.mains.sort(key=lambda m: (m.main.order is None, m.main.order or 0))
    plan._groups = list(groups.values())
    plan._has_ladder = any(not g.block_n for g in plan._groups)
    return plan


def _add(plan: FaPlan, groups: dict, spec: SplitKernelSpec, main: KernelNode, combine):
    grid = main.grid
    bucket = grid[spec.split_axis]
    for node, arg in ((combine, spec.combine_splits_arg), (main, spec.main_splits_arg)):
        if node is None:
            continue
        if arg is not None and (found := read_i32_arg(node, arg)) != bucket:
            raise GraphUpdateError(
                f"kernel {node.name}: argument {arg} (split count) is {found} at capture, but "
                f"the paired {main.name} launches {bucket} splits on grid axis "
                f"{spec.split_axis}; the spec does not describe this kernel"
            )
    ladder = spec.rule == "ladder"
    fm = FaMain(main, combine, spec, bucket)
    if ladder:
        fm.bs, fm.n_kv_heads = grid[spec.bs_axis], grid[spec.heads_axis]
    plan.mains.append(fm)
    gkey = (0, fm.bs, fm.n_kv_heads, bucket) if ladder else (spec.block_n, 0, 0, bucket)
    group = groups.get(gkey)
    if group is None:
        group = groups[gkey] = _Group(*gkey, members=[])
    group.members.append(fm)
    main_slot = None if spec.main_splits_arg is None else main.i32_slot(spec.main_splits_arg)
    group.pushes.append(
        (
            fm,
            main.handle,
            main.params,
            _GRID_FIELDS[spec.split_axis],
            main_slot,
            None if combine is None else combine.handle,
            None if combine is None else combine.params,
            None if combine is None else combine.i32_slot(spec.combine_splits_arg),
        )
    )


def fa_apply(
    plan: FaPlan,
    exec_: Any,
    t_kv: int,
    split_keys: SplitKeys | TwoArgSplitKeys | None = None,
    driver: Any = None,
) -> int:
    """Retune every main and combine of ``plan`` in ``exec_`` to the eager split count for
    ``t_kv``; returns the number of nodes pushed (0 when no count stepped since the last apply).

    Ladder: ``ceil(t_kv / split_keys(t_kv, n_kv_heads, bs, num_sms))``; self-limiting:
    ``ceil(t_kv / block_n)``; both clamped to ``[1, bucket_splits]``. ``split_keys`` defaults to
    ``stepgraph.kernels.decode.splits.fa_split_keys``, the ladder eager uses, so the two stay in
    step; two-argument ladders ``split_keys(t_kv, n_kv_heads)`` work too.
    Per-token hot path: keep it lean.
    """
    if exec_ != plan._exec_key:  # first apply, or a new exec (re-instantiated): push all
        plan.invalidate()
        d = driver if driver is not None else plan.driver
        plan._exec_handle = d.exec_handle(exec_) if d is not None else exec_
        plan._exec_key = exec_
    if not 1 <= t_kv <= plan.max_t_kv:
        raise GraphUpdateError(
            f"fa_apply: t_kv = {t_kv} is outside [1, {plan.max_t_kv}] (the context this graph was "
            "captured for); capture a larger bucket, or run this step eagerly"
        )
    if split_keys is None and plan._has_ladder:
        split_keys = _default_split_keys
    if split_keys is not plan._split_keys:  # another ladder: the cached intervals do not hold
        plan._split_keys, plan._ladder = split_keys, as_split_keys(split_keys)
        for g in plan._groups:
            g.lo, g.hi, g.table = 1, 0, None
    pushed = 0
    for g in plan._groups:
        if g.lo <= t_kv <= g.hi:  # the applied count holds here: the per-token no-op
            continue
        ns, lo, hi = _split_count(plan, g, t_kv, plan._ladder)
        if ns != g.applied:
            pushed += _push(plan, g, ns, driver if driver is not None else plan.driver)
        g.lo, g.hi = lo, hi
    return pushed


def _split_count(plan: FaPlan, g: _Group, t_kv: int, split_keys: Any) -> tuple[int, int, int]:
    """``(ns, lo, hi)``: the clamped split count at ``t_kv`` and an interval where it holds."""
    top = plan.max_t_kv
    if g.block_n:  # self-limiting: ns = min(bucket, ceil(t / block_n)), steps every block_n
        ns = min(g.bucket, -(-t_kv // g.block_n))
        hi = top if ns == g.bucket else min(top, ns * g.block_n)
        return ns, (ns - 1) * g.block_n + 1, hi

    def ns_of(t: int) -> int:
        keys = split_keys(t, g.n_kv_heads, g.bs, plan.num_sms)
        if keys < 1:
            raise GraphUpdateError(f"split_keys returned {keys} for t_kv = {t}; need >= 1")
        return splits_from_keys(t, keys, g.bucket)

    # A ladder whose count never decreases as t_kv grows (ours; or one marked ``monotone``) is
    # tabulated once, so the per-token check is an interval test instead of a ladder call.
    if split_keys is _default_split_keys or getattr(split_keys, "monotone", False):
        if g.table is None:
            g.table = monotone_steps(ns_of, top)
        starts, values = g.table
        i = bisect_right(starts, t_kv) - 1
        return values[i], starts[i], starts[i + 1] - 1 if i + 1 < len(starts) else top
    return ns_of(t_kv), t_kv, t_kv


def _push(plan: FaPlan, g: _Group, ns: int, d: Any) -> int:
    exec_h, push = plan._exec_handle, d.exec_set_params
    # unknown until every member is pushed: a failed push is retried in full
    g.applied, g.lo, g.hi = None, 1, 0
    for fm, mh, mp, grid_field, mslot, ch, cp, cslot in g.pushes:
        setattr(mp, grid_field, ns)
        if mslot is not None:
            mslot.value = ns
        push(exec_h, mh, mp)
        if ch is not None:
            cslot.value = ns
            push(exec_h, ch, cp)
        fm.ns = ns
    g.applied = ns
    return sum(1 if p[5] is None else 2 for p in g.pushes)
