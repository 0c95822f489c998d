"""The registry of retunable split kernels: which main/combine kernel pairs ``fa_plan`` finds in a
graph, which arguments pair them, and how their split count follows the context length.

Our Triton decode kernel (``stepgraph/kernels/decode/flash_decode.py``) is registered by default. A
user with their own split kernel describes it with a :class:`SplitKernelSpec` and calls
:func:`register_split_kernel`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Literal

from ..errors import ConfigError
from ..kernels.decode import split_kv, split_kv_fold

Rule = Literal["ladder", "self_limiting"]
SplitKeys = Callable[[int, int, int, int], int]  # (t_kv, n_kv_heads, bs, num_sms) -> keys/split
TwoArgSplitKeys = Callable[[int, int], int]  # (t_kv, n_kv_heads) -> keys


def as_split_keys(ladder: SplitKeys | TwoArgSplitKeys | None) -> SplitKeys | None:
    """``ladder`` with our four-argument signature. Two-argument ladders
    ``split_keys(t_kv, n_kv)`` are wrapped (they ignore ``bs`` and ``num_sms``); a ``monotone``
    mark carries over."""
    if ladder is None:
        return None
    try:
        inspect.signature(ladder).bind(1, 1, 1, 1)
        return ladder
    except TypeError:
        inspect.signature(ladder).bind(1, 1)  # neither signature: let the TypeError say so

    def four(t_kv: int, n_kv_heads: int, bs: int, num_sms: int) -> int:
        return ladder(t_kv, n_kv_heads)

    four.monotone = getattr(ladder, "monotone", False)  # type: ignore[attr-defined]
    return four


@dataclass(frozen=True)
class SplitKernelSpec:
    """One main (split) kernel and its combine kernel, as driver-level argument indices.

    - ``main_ptr_arg`` / ``combine_ptr_arg``: the pointer argument (e.g. ``partial_o``) that the
      main writes and the combine reads; equal pointers pair a main with its combine.
    - ``combine_splits_arg``: the combine's int32 split count; ``main_splits_arg`` the main's,
      if it has one (ours reads ``tl.num_programs(split_axis)`` instead).
    - ``split_axis``: the main's grid axis that holds the split count.
    - ``rule``: ``"ladder"``: ``ns = ceil(t_kv / split_keys(t_kv, n_kv_heads, bs, num_sms))``,
      with bs and n_kv_heads read from the main's grid at ``bs_axis`` / ``heads_axis``;
      ``"self_limiting"``: the kernel uses ``min(grid, ceil(t_kv / block_n))`` splits itself, so
      the grid is shrunk to exactly that and no block launches empty.

    Either rule is clamped to ``[1, bucket_splits]`` (the split count the graph was captured with).
    """

    main: str
    combine: str | None  # None: the main merges its own splits (grid axis only is retuned)
    main_ptr_arg: int
    combine_ptr_arg: int
    combine_splits_arg: int
    split_axis: int
    rule: Rule = "ladder"
    main_splits_arg: int | None = None
    block_n: int | None = None
    bs_axis: int = 0
    heads_axis: int = 1

    def __post_init__(self) -> None:
        if self.rule not in ("ladder", "self_limiting"):
            raise ConfigError(f"{self.main}: rule {self.rule!r} is not 'ladder' or 'self_limiting'")
        if self.main == self.combine:
            raise ConfigError(f"{self.main}: the main and combine kernels must differ")
        if self.combine is None and self.main_splits_arg is not None:
            raise ConfigError(f"{self.main}: a spec without a combine reads its grid only")
        if self.split_axis not in (0, 1, 2):
            raise ConfigError(f"{self.main}: split_axis {self.split_axis} is not 0, 1 or 2")
        if self.rule == "self_limiting" and (self.block_n is None or self.block_n < 1):
            raise ConfigError(f"{self.main}: a self_limiting spec needs block_n >= 1")
        if self.rule == "ladder":
            axes = {self.split_axis, self.bs_axis, self.heads_axis}
            if len(axes) != 3 or not axes <= {0, 1, 2}:
                raise ConfigError(
                    f"{self.main}: split_axis, bs_axis and heads_axis must be 0, 1, 2 in some "
                    f"order (got {self.split_axis}, {self.bs_axis}, {self.heads_axis})"
                )
        args = [self.main_ptr_arg, self.combine_ptr_arg, self.combine_splits_arg]
        if self.main_splits_arg is not None:
            args.append(self.main_splits_arg)
        if any(a < 0 for a in args):
            raise ConfigError(f"{self.main}: argument indices must be >= 0 (got {args})")
        if (self.combine is not None and self.combine_ptr_arg == self.combine_splits_arg) or (
            self.main_ptr_arg == self.main_splits_arg
        ):
            raise ConfigError(f"{self.main}: a pointer and a split count share an argument index")


# Our kernel (``stepgraph/kernels/decode/split_kv.py``): partial_o pairs the two; the main's split
# count is grid z; the combine's n_splits is an int32 argument in do_not_specialize.
FLASH_DECODE_SPEC = SplitKernelSpec(
    main=split_kv.MAIN_KERNEL_NAME,
    combine=split_kv.COMBINE_KERNEL_NAME,
    main_ptr_arg=split_kv.MAIN_PARTIAL_O_ARG,
    combine_ptr_arg=split_kv.COMBINE_PARTIAL_O_ARG,
    combine_splits_arg=split_kv.COMBINE_N_SPLITS_ARG,
    split_axis=2,
    rule="ladder",
)
# The folded kernel (``stepgraph/kernels/decode/split_kv_fold.py``, the fused decode step): no
# combine node; the split count is grid z alone.
FLASH_DECODE_FOLD_SPEC = SplitKernelSpec(
    main=split_kv_fold.FOLD_KERNEL_NAME,
    combine=None,
    main_ptr_arg=split_kv_fold.FOLD_PARTIAL_O_ARG,
    combine_ptr_arg=0,
    combine_splits_arg=0,
    split_axis=2,
    rule="ladder",
)


class SplitKernelRegistry:
    """Specs by main and by combine kernel name; a name belongs to at most one spec."""

    def __init__(self, specs: Iterable[SplitKernelSpec] = ()) -> None:
        self.by_main: dict[str, SplitKernelSpec] = {}
        self.by_combine: dict[str, SplitKernelSpec] = {}
        for spec in specs:
            self.register(spec)

    def register(self, spec: SplitKernelSpec) -> None:
        """Add ``spec``; registering an equal spec again is a no-op, a clashing one an error."""
        for name in (spec.main, spec.combine):
            if name is None:
                continue
            old = self.by_main.get(name) or self.by_combine.get(name)
            if old is not None and old != spec:
                raise ConfigError(
                    f"kernel {name} is already registered as part of {old}; "
                    f"unregister_split_kernel({old.main!r}) first"
                )
        self.by_main[spec.main] = spec
        if spec.combine is not None:
            self.by_combine[spec.combine] = spec

    def unregister(self, main: str) -> None:
        spec = self.by_main.pop(main, None)
        if spec is not None:
            self.by_combine.pop(spec.combine, None)

    def __iter__(self) -> Iterator[SplitKernelSpec]:
        return iter(list(self.by_main.values()))

    def __len__(self) -> int:
        return len(self.by_main)


DEFAULT_REGISTRY = SplitKernelRegistry([FLASH_DECODE_SPEC, FLASH_DECODE_FOLD_SPEC])


def register_split_kernel(
    spec: SplitKernelSpec, registry: SplitKernelRegistry | None = None
) -> None:
    """Make ``fa_plan`` find and retune ``spec``'s kernels (in the default registry)."""
    (registry if registry is not None else DEFAULT_REGISTRY).register(spec)


def unregister_split_kernel(main: str, registry: SplitKernelRegistry | None = None) -> None:
    (registry if registry is not None else DEFAULT_REGISTRY).unregister(main)
