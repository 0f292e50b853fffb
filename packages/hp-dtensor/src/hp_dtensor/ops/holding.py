"""Keep as many shards as hold on every rank, and redistribute the rest (never the fallback).

A rule built on :func:`first_that_holds` asks the dispatcher's every-rank
check first and gives up one mesh dim's shards at a time, so a shape that
does not divide costs a redistribution of the mesh dims that need it instead
of a gather of everything ([Note: giving up one mesh dim at a time]). Ops
whose CPU and meta kernels disagree on empty pieces pass ``nonempty=True``
([Note: empty pieces]).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from hp_dtensor.layout import Layout
from hp_dtensor.ops.dispatch import Decision, OpCall
from hp_dtensor.ops.everywhere import decision_problem, to_meta
from hp_dtensor.placements import Shard

__all__ = ["first_that_holds"]


def _sharded_mesh_dims(decision: Decision) -> list[int]:
    """Mesh dims on which the decision keeps some input or output cut."""
    lists = list(decision.inputs.values()) + [p for p in decision.outputs if p is not None]
    dims = {m for placements in lists for m, p in enumerate(placements) if isinstance(p, Shard)}
    return sorted(dims)


# [Note: giving up one mesh dim at a time]
# Some rules keep a shard only when every rank's piece suits the local op:
# ``pixel_shuffle`` keeps a cut channel dim when each rank holds whole groups
# of ``r * r`` channels, a pooling op refuses a piece with no channels. Those
# conditions are about the ``torch.chunk`` sizes of every mesh coordinate,
# which is exactly what the dispatcher's every-rank check ([Note: decisions
# that hold on every rank] in :mod:`hp_dtensor.ops.everywhere`) computes. When
# that check rejects a decision the dispatcher takes the replicated fallback;
# a rule built on :func:`first_that_holds` asks the same check first and gives
# up one mesh dim's shards at a time (those mesh dims are gathered, the others
# stay cut), so a shape that does not divide costs a redistribution of the
# mesh dims that need it instead of a gather of everything.
def first_that_holds(
    call: OpCall,
    build: Callable[[frozenset[int]], Decision],
    *,
    nonempty: bool = False,
    empty_batch_ok: bool = False,
) -> Decision:
    """``build(gathered)`` for the fewest ``gathered`` mesh dims whose decision holds on every rank.

    ``build`` must replicate every input and output on the mesh dims in
    ``gathered``. The mesh dims are given up from the last to the first; the
    decision with all of them gathered runs the op on whole tensors and is
    returned unchecked. With ``nonempty``, a decision that cuts some dim of a
    tensor to nothing on some rank (the dim itself not empty) does not hold
    either, except dim 0 when ``empty_batch_ok`` (see [Note: empty pieces]).
    """
    decision = build(frozenset())
    candidates = _sharded_mesh_dims(decision)
    if not candidates:
        return decision
    flat, spec = pytree.tree_flatten((call.args, call.kwargs))
    meta_args, meta_kwargs = pytree.tree_unflatten([to_meta(v) for v in flat], spec)
    meta = call.func(*meta_args, **meta_kwargs)
    mesh = call.layout(call.positions[0]).mesh
    gathered: set[int] = set()
    while True:
        problem = _empty_piece(call, decision, meta, 1 if empty_batch_ok else 0) if nonempty else None
        if problem is None:
            problem = decision_problem(call.func, call.flat, spec, call.positions, decision, mesh, meta)
        if problem is None or not candidates:
            return decision
        gathered.add(candidates.pop())
        decision = build(frozenset(gathered))


# [Note: empty pieces]
# The every-rank check runs the op on meta tensors, and some CPU kernels
# treat an empty piece differently from their meta kernel: ``pixel_shuffle``
# returns an empty input unchanged (the wrong shape), ``upsample_bilinear2d``
# refuses a piece with no channels that its meta kernel accepts, and the meta
# ``upsample_nearest2d`` refuses an empty batch the CPU kernel accepts. Rules
# for such ops pass ``nonempty=True``: a cut that leaves some rank nothing of
# a dim is gathered (it is small: fewer rows than ranks), except the batch
# dim of ops whose CPU kernels take an empty batch (``empty_batch_ok``).
def _empty_piece(call: OpCall, decision: Decision, meta: Any, first: int) -> str | None:
    """An input or output whose dim ``first`` or later some rank would hold none of (the dim not empty)."""
    layouts: list[Layout] = []
    for p in call.positions:
        layout = call.layout(p)
        target = decision.inputs.get(p)
        layouts.append(layout if target is None else layout.with_placements(target))
    results = [m for m in pytree.tree_leaves(meta) if isinstance(m, torch.Tensor)]
    for m, placements in zip(results, decision.outputs, strict=False):
        if placements is not None:
            layouts.append(Layout(layouts[0].mesh, placements, tuple(m.shape)))
    for layout in layouts:
        for shape in layout.table():
            if any(shape[d] == 0 < layout.shape[d] for d in range(first, layout.ndim)):
                return f"a rank would hold an empty piece {shape} of {layout}"
    return None
