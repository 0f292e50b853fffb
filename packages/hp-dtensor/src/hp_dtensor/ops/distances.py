"""``dist(x, y, p)``: the p-norm of ``x - y`` as a norm partial, with no communication.

With ``x`` and ``y`` of one shape cut alike, each rank's ``dist`` of its
pieces is the p-norm of its part of ``x - y``, so the result is
``Partial("norm", p)`` (``Partial("sum")`` for the 0-"norm", a count) as for
``linalg_vector_norm`` (see [Note: norm partials] in
:mod:`hp_dtensor.placements`); reading it is one scalar all-reduce per mesh
dim. ``y`` is moved to ``x``'s cut (a replicated ``y`` is cut locally, for
free). A rank whose pieces are empty (uneven cuts) contributes the norm
partial's identity. Operands of different shapes (broadcasting) are both
replicated.
"""

from __future__ import annotations

import math

import torch

from hp_dtensor.ops.dispatch import Decision, LocalCall, OpCall, register
from hp_dtensor.ops.vector_norms import vector_norm_decision
from hp_dtensor.placements import Replicate, Shard

__all__ = ["dist_rule"]

aten = torch.ops.aten


def _p(call: OpCall | LocalCall) -> float:
    value = call.args[2] if len(call.args) > 2 else call.kwargs.get("p", 2)
    return float(value)


def _dist_kernel(call: LocalCall) -> torch.Tensor:
    """``dist`` of this rank's pieces, or the partial's identity when they are empty."""
    x = call.args[0]
    if x.numel() > 0:
        return call.func(*call.args, **call.kwargs)
    p = _p(call)
    fill = math.inf if (p == -math.inf or p < 0) else 0.0
    dtype = torch.promote_types(x.dtype, call.args[1].dtype)
    return torch.full((), fill, dtype=torch.empty((), dtype=dtype).abs().dtype, device=x.device)


@register(aten.dist.default)
def dist_rule(call: OpCall) -> Decision:
    """Same-shape operands cut like ``x``: the result is a norm partial; else both replicated."""
    x_pos, y_pos = call.position_of(call.args[0]), call.position_of(call.args[1])
    x, y = call.layout(x_pos), call.layout(y_pos)
    if x.shape != y.shape:
        replicate = (Replicate(),) * len(x.placements)
        return Decision(inputs={x_pos: replicate, y_pos: replicate}, outputs=[replicate])
    cut = x.with_placements([p if isinstance(p, Shard) else Replicate() for p in x.placements])
    inputs, out = vector_norm_decision(cut, list(range(x.ndim)), False, _p(call))
    sharded = any(isinstance(p, Shard) for p in inputs)
    return Decision(
        inputs={x_pos: inputs, y_pos: inputs}, outputs=[out], kernel=_dist_kernel if sharded else None
    )
