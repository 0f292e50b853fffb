"""``_trilinear``, the kernel of ``F.bilinear`` (and of its gradients), on cut operands.

``_trilinear(i1, i2, i3, expand1, expand2, expand3, sumdim)`` unsqueezes
each operand at its ``expand`` dims into one common space, multiplies the
three and sums over ``sumdim``: an einsum. Operand ``k``'s dims are the
common dims not in ``expand_k``, in order; the output's are the common dims
not in ``sumdim``. Per mesh dim, a cut of a common dim ``d`` (read from the
first operand cut there) is kept when every operand that has ``d`` is cut
on it and the others are whole: each rank multiplies its slice, and the
output is cut on ``d`` or, when ``d`` is summed, is a ``Partial("sum")``.
``F.bilinear``'s batch cut (``x1`` and ``x2`` cut on their rows, the weight
whole) is local, forward and backward (the weight's gradient, a sum over the
batch, is the partial sum); a cut weight is local too. The op is linear in
each operand: one ``Partial("sum")`` operand with the others whole stays
partial. torch's DTensor gathers the batch cut.
"""

from __future__ import annotations

import torch

from hp_dtensor.ops.dispatch import Decision, OpCall, register
from hp_dtensor.placements import Partial, Placement, Replicate, Shard

__all__ = ["trilinear_rule"]

aten = torch.ops.aten
R = Replicate()


def _operand_dims(ndim: int, expand: list[int]) -> list[int]:
    """The common dims an operand of ``ndim`` dims holds (those it is not unsqueezed at), in order."""
    common = ndim + len(expand)
    return [d for d in range(common) if d not in expand]


@register(aten._trilinear.default)
def trilinear_rule(call: OpCall) -> Decision:
    """Cuts of one common dim on every operand holding it stay; a summed one is a partial sum."""
    operands = list(call.args[:3])
    positions = [call.position_of(t) for t in operands]
    layouts = [call.layout(p) for p in positions]
    expands = [[int(d) for d in e] for e in call.args[3:6]]
    sumdim = [int(d) for d in call.args[6]]
    held = [_operand_dims(layout.ndim, e) for layout, e in zip(layouts, expands, strict=True)]
    common = layouts[0].ndim + len(expands[0])
    out_dims = [d for d in range(common) if d not in sumdim]
    columns: list[list[Placement]] = [[] for _ in range(4)]  # per operand, then the output
    for m in range(layouts[0].mesh.ndim):
        here = [layout.placements[m] for layout in layouts]
        cut = next((dims[p.dim] for p, dims in zip(here, held, strict=True) if isinstance(p, Shard)), None)
        partial = [i for i, p in enumerate(here) if isinstance(p, Partial) and p.reduce_op in ("sum", "avg")]
        row: list[Placement]
        if cut is not None:
            row = [Shard(dims.index(cut)) if cut in dims else R for dims in held]
            row.append(Partial("sum") if cut in sumdim else Shard(out_dims.index(cut)))
        elif len(partial) == 1:
            row = [here[partial[0]] if i == partial[0] else R for i in range(3)]
            row.append(here[partial[0]])
        else:
            row = [R, R, R, R]
        for column, p in zip(columns, row, strict=True):
            column.append(p)
    targets = [tuple(c) for c in columns]
    return Decision(inputs=dict(zip(positions, targets[:3], strict=True)), outputs=[targets[3]])
