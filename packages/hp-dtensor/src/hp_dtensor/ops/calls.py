"""What a sharding rule sees and returns: :class:`OpCall` in, :class:`Decision` out.

Kept apart from the dispatcher that runs them so the modules rules lean on
(:mod:`hp_dtensor.ops.strided` among them) can name these types without
importing the dispatcher, which in turn asks rules through them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hp_core import DeviceMesh

from hp_dtensor.layout import Layout
from hp_dtensor.placements import Placement

__all__ = ["Decision", "Kernel", "LocalCall", "OpCall", "Rule"]


@dataclass
class LocalCall:
    """What a :attr:`Decision.kernel` gets: the op, its local arguments and their layouts.

    ``args`` and ``kwargs`` hold local tensors where the call had DTensors
    (already moved to the rule's placements); ``layouts`` and
    ``kwarg_layouts`` hold those tensors' layouts, aligned with ``args`` and
    ``kwargs`` (None for arguments that are not DTensors).
    """

    func: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    layouts: tuple[Any, ...]
    kwarg_layouts: dict[str, Any]
    mesh: DeviceMesh

    def layout(self, index: int) -> Layout:
        """The layout of positional argument ``index`` (which must be a DTensor)."""
        layout = self.layouts[index]
        assert isinstance(layout, Layout), f"argument {index} of {self.func} is not a DTensor"
        return layout


Kernel = Callable[[LocalCall], Any]


@dataclass
class Decision:
    """What a rule wants: target placements per DTensor input (by flat position) and per output.

    ``inputs`` maps the position of a DTensor in the flattened ``(args,
    kwargs)`` to its required placements; positions not listed stay as they
    are. ``outputs`` has one entry per output tensor in flattened order
    (None for non-tensor outputs). ``inplace`` marks ops that return their
    first argument. ``kernel``, when set, runs instead of the op on the
    local tensors (see :class:`LocalCall`). ``output_metas``, when set, is
    the op's result on global meta tensors (see [Note: rule-supplied metas]).
    """

    inputs: dict[int, tuple[Placement, ...]] = field(default_factory=dict)
    outputs: list[tuple[Placement, ...] | None] = field(default_factory=list)
    inplace: bool = False
    size_arg: int | None = None  # positional arg holding the global output size (view, expand)
    kernel: Kernel | None = None
    output_metas: Any = None  # the op's global outputs as meta tensors, instead of a meta run


# [Note: rule-supplied metas]
# The dispatcher builds each output's layout from the op's result on meta
# tensors at the global shapes. Some ops have no meta kernel
# (``_ctc_loss_backward``), and some outputs' shapes follow argument values a
# meta run cannot see (``_ctc_loss.Tensor``'s ``log_alpha`` is as wide as the
# longest target, a value inside a tensor). A rule for such an op puts the
# result's global shapes, strides and dtypes into ``Decision.output_metas``
# (meta tensors, in the op's output structure) and the dispatcher runs no meta
# op. Decisions are cached by the arguments' layouts and plain values, so a
# rule whose metas read a tensor's values must be registered ``cached=False``.


@dataclass
class OpCall:
    """An op call as rules see it."""

    func: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    flat: list[Any]
    positions: list[int]  # flat positions of the DTensors

    def layout(self, position: int) -> Layout:
        """The layout of the DTensor at flat ``position``."""
        return self.flat[position]._layout

    def position_of(self, arg: Any) -> int:
        """The flat position of a DTensor argument (by identity)."""
        for p in self.positions:
            if self.flat[p] is arg:
                return p
        raise KeyError("argument is not a DTensor of this call")


Rule = Callable[[OpCall], Decision | None]
