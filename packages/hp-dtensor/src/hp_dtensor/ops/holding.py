"""Keep as many shards as hold on every rank, and redistribute the rest (never the fallback).

Some rules keep a shard only when every rank's piece suits the local op:
``pixel_shuffle`` keeps a cut channel dim when each rank holds whole groups
of ``r * r`` channels, a pooling op refuses a piece with no channels. Those
conditions are about the ``torch.chunk`` sizes of every mesh coordinate,
which is exactly what the dispatcher's every-rank check ([Note: decisions
that hold on every rank] in :mod:`hp_dtensor.ops.everywhere`) computes. When
that check rejects a decision the dispatcher takes the replicated fallback;
a rule built on :func:`first_that_holds` asks the same check first and gives
up one mesh dim's shards at a time (those mesh dims are gathered, the others
stay cut), so a shape that does not divide costs a redistribution of the
mesh dims that need it instead of a gather of everything.
"""

from __future__ import annotations

from collections.abc import Callable

from torch.utils import _pytree as pytree

from hp_dtensor.ops.dispatch import Decision, OpCall
from hp_dtensor.ops.everywhere import decision_problem, to_meta
from hp_dtensor.placements import Shard

__all__ = ["first_that_holds"]


def _sharded_mesh_dims(decision: Decision) -> list[int]:
    """Mesh dims on which the decision keeps some input or output cut."""
    lists = list(decision.inputs.values()) + [p for p in decision.outputs if p is not None]
    dims = {m for placements in lists for m, p in enumerate(placements) if isinstance(p, Shard)}
    return sorted(dims)


def first_that_holds(call: OpCall, build: Callable[[frozenset[int]], Decision]) -> Decision:
    """``build(gathered)`` for the fewest ``gathered`` mesh dims whose decision holds on every rank.

    ``build`` must replicate every input and output on the mesh dims in
    ``gathered``. The mesh dims are given up from the last to the first; the
    decision with all of them gathered runs the op on whole tensors and is
    returned unchecked.
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
        problem = decision_problem(call.func, call.flat, spec, call.positions, decision, mesh, meta)
        if problem is None or not candidates:
            return decision
        gathered.add(candidates.pop())
        decision = build(frozenset(gathered))
