"""``tril`` / ``triu`` on any cut, with the diagonal shifted by the piece's start.

``tril(x, k)`` keeps element ``(i, j)`` of each matrix (the last two dims)
when ``j - i <= k`` (``triu``: ``>= k``). A rank whose piece starts at row
``o`` and column ``c`` holds element ``(i, j)`` at local ``(i - o, j - c)``,
where the test reads ``j' - i' <= k + o - c``: the same op on the piece with
the diagonal ``k + o - c``. So every cut (batch, row, column, uneven or not)
is local, forward and backward (the gradient of ``tril`` is ``tril`` of the
gradient); a batch cut needs no shift. The op is linear: a
``Partial("sum")`` / ``Partial("avg")`` stays partial. torch's DTensor
gathers a row or column cut (one all-gather), where this rule sends nothing.
"""

from __future__ import annotations

import torch

from hp_dtensor.ops.dispatch import Decision, LocalCall, OpCall, register
from hp_dtensor.placements import Partial, Placement, Replicate, Shard

__all__ = ["triangular_rule"]

aten = torch.ops.aten


def _diagonal_arg(call: OpCall | LocalCall) -> int:
    return int(call.args[1]) if len(call.args) > 1 else int(call.kwargs.get("diagonal", 0))


def _shifted_kernel(call: LocalCall) -> torch.Tensor:
    """The op on this rank's piece with the diagonal moved by the piece's row and column start."""
    layout = call.layout(0)
    offset = layout.local_offset()
    shift = offset[-2] - offset[-1]
    return call.func(call.args[0], _diagonal_arg(call) + shift)


@register(aten.tril.default, aten.triu.default)
def triangular_rule(call: OpCall) -> Decision:
    """Every cut stays; a cut matrix dim shifts the local diagonal (see the module docstring)."""
    position = call.positions[0]
    layout = call.layout(position)
    placements: tuple[Placement, ...] = tuple(
        p
        if isinstance(p, Shard) or (isinstance(p, Partial) and p.reduce_op in ("sum", "avg"))
        else Replicate()
        for p in layout.placements
    )
    matrix_cut = any(isinstance(p, Shard) and p.dim >= layout.ndim - 2 for p in placements)
    return Decision(
        inputs={position: placements}, outputs=[placements], kernel=_shifted_kernel if matrix_cut else None
    )
