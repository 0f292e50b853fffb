"""``repeat``: a cut dim that is not repeated keeps its cut; a repeated cut dim is gathered.

``x.repeat(r_0, ..., r_k)`` prepends ``k + 1 - x.dim()`` new dims and tiles
dim ``d`` of ``x`` ``r`` times along output dim ``d + k + 1 - x.dim()``. A
cut dim with a repeat count of 1 is copied as it is, so each rank repeats its
own piece (output cut on the shifted dim), with no communication. A cut dim
repeated more than once would interleave the ranks' pieces (``[a, b, a,
b]``, not ``[a, a, b, b]``), so that mesh dim is gathered. The op is linear:
a ``Partial("sum")`` / ``Partial("avg")`` input stays partial. ``tile`` and
``instance_norm`` (its weight and running statistics are repeated over the
batch) reach this op; torch's DTensor sends nothing in the same cases.
"""

from __future__ import annotations

import torch

from hp_dtensor.ops.along_dims import linear_placements
from hp_dtensor.ops.dispatch import Decision, OpCall, register
from hp_dtensor.placements import Replicate

__all__ = ["repeat_rule"]

aten = torch.ops.aten


@register(aten.repeat.default)
def repeat_rule(call: OpCall) -> Decision:
    """Unrepeated cut dims pass (shifted by the new leading dims); linear partials pass."""
    position = call.positions[0]
    layout = call.layout(position)
    repeats = [int(r) for r in call.args[1]]
    shift = len(repeats) - layout.ndim
    if shift < 0:  # fewer counts than dims: the op's own error, from the whole tensor
        whole = (Replicate(),) * layout.mesh.ndim
        return Decision(inputs={position: whole}, outputs=[whole])
    inputs, outputs = linear_placements(
        layout.placements, lambda p: p.dim + shift if repeats[p.dim + shift] == 1 else None
    )
    return Decision(inputs={position: inputs}, outputs=[outputs])
