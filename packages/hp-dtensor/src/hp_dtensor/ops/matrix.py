"""Matrix products: mm, addmm, bmm (and so linear and matmul).

Per mesh dim, ``A @ B`` with ``A`` (m, k) and ``B`` (k, n):

==========  ==========  =========  ==================================
A           B           out        why
==========  ==========  =========  ==================================
S(0)        R           S(0)       rows of A give rows of out
R           S(1)        S(1)       columns of B give columns of out
S(1)        S(0)        P(sum)     each rank sums part of the k terms
R           R           R
P(sum)      R           P(sum)     linear in A
R           P(sum)      P(sum)     linear in B
==========  ==========  =========  ==================================

Any other pair is moved to the nearest row of the table, preferring to keep
the larger operand's shard. ``bmm`` adds a batch dim that may be sharded on
both operands. ``addmm`` makes its bias match the product's placement (a
partial product takes a partial bias: one rank keeps it, see
:func:`hp_dtensor.redistribute._to_partial`).
"""

from __future__ import annotations

from typing import Any

import torch

from hp_dtensor.ops.dispatch import Decision, OpCall, register
from hp_dtensor.placements import Partial, Placement, Replicate, Shard

__all__ = ["mm_placements"]

aten = torch.ops.aten
R = Replicate()
SUM = Partial("sum")


def mm_placements(a: Placement, b: Placement, batch: int) -> tuple[Placement, Placement, Placement]:
    """Target (A, B, out) placements for one mesh dim; ``batch`` leading dims shard together."""
    row, inner, col = batch, batch + 1, batch + 1  # A's row dim, A's k dim, B's column dim
    b_inner = batch
    if batch and Shard(0) in (a, b):
        return Shard(0), Shard(0), Shard(0)
    if isinstance(a, Shard) and a.dim == row:
        return a, R, Shard(row)
    if isinstance(b, Shard) and b.dim == col:
        return R, b, Shard(col)
    if isinstance(a, Shard) and a.dim == inner:
        return a, Shard(b_inner), SUM
    if isinstance(b, Shard) and b.dim == b_inner:
        return Shard(inner), b, SUM
    if a == SUM and not isinstance(b, Partial):
        return a, R, SUM
    if b == SUM and not isinstance(a, Partial):
        return R, b, SUM
    return R, R, R


def _mm(
    call: OpCall, a_arg: Any, b_arg: Any, batch: int
) -> tuple[dict[int, tuple[Placement, ...]], tuple[Placement, ...]]:
    pa, pb = call.position_of(a_arg), call.position_of(b_arg)
    la, lb = call.layout(pa), call.layout(pb)
    ta: list[Placement] = []
    tb: list[Placement] = []
    out: list[Placement] = []
    for m in range(la.mesh.ndim):
        x, y, z = mm_placements(la.placements[m], lb.placements[m], batch)
        ta.append(x)
        tb.append(y)
        out.append(z)
    return {pa: tuple(ta), pb: tuple(tb)}, tuple(out)


def _lift_args(call: OpCall, *names: int) -> bool:
    from hp_dtensor.dtensor import DTensor

    return all(isinstance(call.args[i], DTensor) for i in names)


@register(aten.mm.default)
def mm_rule(call: OpCall) -> Decision | None:
    """``mm``: the table above."""
    if not _lift_args(call, 0, 1):
        return None
    inputs, out = _mm(call, call.args[0], call.args[1], 0)
    return Decision(inputs=inputs, outputs=[out])


@register(aten.bmm.default)
def bmm_rule(call: OpCall) -> Decision | None:
    """``bmm``: the table with a leading batch dim, which may be sharded on both operands."""
    if not _lift_args(call, 0, 1):
        return None
    inputs, out = _mm(call, call.args[0], call.args[1], 1)
    return Decision(inputs=inputs, outputs=[out])


@register(aten.addmm.default)
def addmm_rule(call: OpCall) -> Decision | None:
    """``bias + A @ B``: the product's placement, with the bias cut (or made partial) to match."""
    if not _lift_args(call, 0, 1, 2):
        return None
    inputs, out = _mm(call, call.args[1], call.args[2], 0)
    pbias = call.position_of(call.args[0])
    bias = call.layout(pbias)
    target: list[Placement] = []
    for placement in out:
        if isinstance(placement, Shard):
            dim = placement.dim - (2 - bias.ndim)
            ok = dim >= 0 and bias.shape[dim] != 1
            target.append(Shard(dim) if ok else R)
        else:
            target.append(placement)
    inputs[pbias] = tuple(target)
    return Decision(inputs=inputs, outputs=[out])
