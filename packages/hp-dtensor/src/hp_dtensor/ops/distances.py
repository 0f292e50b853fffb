"""Distances: ``dist``, ``cdist`` and ``pdist`` on cut inputs, local or as norm partials.

See [Note: distance plans].
"""

from __future__ import annotations

import math

import torch

from hp_dtensor.layout import Layout
from hp_dtensor.ops.dispatch import Decision, LocalCall, OpCall, register
from hp_dtensor.ops.vector_norms import norm_partial, vector_norm_decision
from hp_dtensor.placements import Partial, Placement, Replicate, Shard

__all__ = ["cdist_backward_rule", "cdist_rule", "dist_rule", "pdist_backward_rule", "pdist_rule"]


# [Note: distance plans]
# ``dist(x, y, p)``: the p-norm of ``x - y`` as a norm partial, with no communication.
#
# With ``x`` and ``y`` of one shape cut alike, each rank's ``dist`` of its
# pieces is the p-norm of its part of ``x - y``, so the result is
# ``Partial("norm", p)`` (``Partial("sum")`` for the 0-"norm", a count) as for
# ``linalg_vector_norm`` (see [Note: norm partials] in
# :mod:`hp_dtensor.placements`); reading it is one scalar all-reduce per mesh
# dim. ``y`` is moved to ``x``'s cut (a replicated ``y`` is cut locally, for
# free). A rank whose pieces are empty (uneven cuts) contributes the norm
# partial's identity. Operands of different shapes (broadcasting) are both
# replicated.
#
# ``cdist(x1, x2, p)`` (``(*B, P, M)`` and ``(*B, Q, M)`` to ``(*B, P, Q)``),
# per mesh dim ([Note: cdist cuts]): a batch cut of both, a row cut of ``x1``
# (``x2`` whole) or of ``x2`` (``x1`` whole) is local; a cut of the feature dim
# ``M`` of both gives each rank the p-norms over its features, a norm partial.
# ``pdist(x, p)`` of an ``(N, M)`` input cut on ``M`` is a norm partial too;
# its row cut is gathered (each output pairs rows of every rank).

aten = torch.ops.aten
R = Replicate()


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


# [Note: cdist cuts]
# Per mesh dim, from the operands' placements (the first that applies):
#
# * a batch dim cut on either: both cut there, the output too;
# * ``x1``'s rows cut: ``x2`` whole, the output cut on its rows;
# * ``x2``'s rows cut: ``x1`` whole, the output cut on its columns;
# * the feature dim cut on either: both cut there, and each rank's distances
#   over its features are p-norm terms, ``Partial("norm", p)`` (a count,
#   ``Partial("sum")``, for p = 0). A rank with no features computes zeros,
#   the terms' identity (distances are never negative).
#
# In the backward (``_cdist_backward(grad, x1, x2, p, cdist)`` gives ``x1``'s
# gradient; autograd calls it again with the operands swapped for ``x2``'s)
# the batch and row cuts of ``x1`` stay cuts; a row cut of ``x2`` makes the
# gradient a partial sum (each rank sums over its own columns); a feature cut
# keeps the gradient cut on the features, with the whole distances and
# gradient (each feature's term needs only the full distance). Operands whose
# batch dims differ (broadcasting) keep only the row cuts.
def _cdist_roles(x1: Layout, x2: Layout) -> list[str | None]:
    """Per mesh dim: "batch:<dim>", "rows1", "rows2", "features" or None."""
    batch = x1.ndim - 2
    alike = x1.ndim == x2.ndim and x1.shape[:batch] == x2.shape[:batch]
    roles: list[str | None] = []
    for p1, p2 in zip(x1.placements, x2.placements, strict=True):
        dims = [p.dim for p in (p1, p2) if isinstance(p, Shard)]
        if alike and any(d < batch for d in dims):
            roles.append(f"batch:{min(d for d in dims if d < batch)}")
        elif p1 == Shard(x1.ndim - 2):
            roles.append("rows1")
        elif p2 == Shard(x2.ndim - 2):
            roles.append("rows2")
        elif alike and (p1 == Shard(x1.ndim - 1) or p2 == Shard(x2.ndim - 1)):
            roles.append("features")
        else:
            roles.append(None)
    return roles


def _columns(rows: list[tuple[Placement, ...]]) -> list[tuple[Placement, ...]]:
    """Per-mesh-dim rows of placements (one per tensor) as one placement tuple per tensor."""
    return [tuple(column) for column in zip(*rows, strict=True)]


@register(aten._cdist_forward.default)
def cdist_rule(call: OpCall) -> Decision:
    """Batch and row cuts local; a feature cut gives a norm partial ([Note: cdist cuts])."""
    p1, p2 = call.position_of(call.args[0]), call.position_of(call.args[1])
    x1, x2 = call.layout(p1), call.layout(p2)
    rows: list[tuple[Placement, ...]] = []  # per mesh dim: (x1, x2, output)
    last = x1.ndim - 1
    for role in _cdist_roles(x1, x2):
        if role is not None and role.startswith("batch:"):
            cut = Shard(int(role[6:]))
            rows.append((cut, cut, cut))
        elif role == "rows1":
            rows.append((Shard(last - 1), R, Shard(last - 1)))
        elif role == "rows2":
            rows.append((R, Shard(last - 1), Shard(last)))
        elif role == "features":
            rows.append((Shard(last), Shard(last), norm_partial(float(call.args[2]))))
        else:
            rows.append((R, R, R))
    t1, t2, out = _columns(rows)
    return Decision(inputs={p1: t1, p2: t2}, outputs=[out])


@register(aten._cdist_backward.default)
def cdist_backward_rule(call: OpCall) -> Decision:
    """``x1``'s gradient: batch, row and feature cuts stay; ``x2``'s row cut sums ([Note: cdist cuts])."""
    positions = [call.position_of(a) for a in (call.args[0], call.args[1], call.args[2], call.args[4])]
    x1, x2 = call.layout(positions[1]), call.layout(positions[2])
    rows: list[tuple[Placement, ...]] = []  # per mesh dim: (grad, x1, x2, cdist, x1's gradient)
    last = x1.ndim - 1
    for role in _cdist_roles(x1, x2):
        if role is not None and role.startswith("batch:"):
            rows.append((Shard(int(role[6:])),) * 5)
        elif role == "rows1":
            cut = Shard(last - 1)
            rows.append((cut, cut, R, cut, cut))
        elif role == "rows2":
            rows.append((Shard(last), R, Shard(last - 1), Shard(last), Partial("sum")))
        elif role == "features":
            rows.append((R, Shard(last), Shard(last), R, Shard(last)))
        else:
            rows.append((R,) * 5)
    *targets, out = _columns(rows)
    return Decision(inputs=dict(zip(positions, targets, strict=True)), outputs=[out])


@register(aten._pdist_forward.default)
def pdist_rule(call: OpCall) -> Decision:
    """A feature cut gives a norm partial; a row cut is gathered."""
    position = call.positions[0]
    layout = call.layout(position)
    p = float(call.args[1]) if len(call.args) > 1 else float(call.kwargs.get("p", 2.0))
    inputs = tuple(Shard(1) if q == Shard(1) else R for q in layout.placements)
    outputs = tuple(norm_partial(p) if q == Shard(1) else R for q in inputs)
    return Decision(inputs={position: inputs}, outputs=[outputs])


@register(aten._pdist_backward.default)
def pdist_backward_rule(call: OpCall) -> Decision:
    """The input's feature cut stays, with the whole gradient and distances."""
    positions = [call.position_of(a) for a in (call.args[0], call.args[1], call.args[3])]
    x = call.layout(positions[1])
    cut = tuple(Shard(1) if q == Shard(1) else R for q in x.placements)
    whole = (R,) * len(cut)
    return Decision(inputs={positions[0]: whole, positions[1]: cut, positions[2]: whole}, outputs=[cut])
