"""Embedding lookups and their backward: column-wise, row-wise (vocab-parallel) and batch-sharded.

Per mesh dim, by the table's placement:

=========  =========  ==============  ==========================================
table      ids        output          how
=========  =========  ==============  ==========================================
S(1)       R          S(last)         each rank looks up its columns
S(0)       R          P(sum)          [Note: row-wise lookup]
R          S(d)       S(d)            each rank looks up its ids
R          R          R
=========  =========  ==============  ==========================================

A table and ids both sharded on one mesh dim keep the table's shard and
gather the ids (ids are small, tables are not).

[Note: row-wise lookup]
A rank holding rows ``[lo, hi)`` of the table looks up the ids in that
range (shifted by ``lo``) and writes zeros for the others, so the ranks'
outputs sum to the lookup: ``Partial("sum")`` without communication; the
consumer's all-reduce (or reduce-scatter, for sequence parallelism) finishes
it. The backward op (``embedding_dense_backward``) does not see the table,
so it cannot know the table was cut by rows: given a replicated gradient it
returns the whole table's gradient, replicated. ``RowwiseParallel`` cuts
that back to the table's rows with a gradient hook (a local slice, no
communication); see :mod:`hp_dtensor.tp`.
"""

from __future__ import annotations

from typing import Any

import torch

from hp_dtensor.layout import Layout
from hp_dtensor.ops.dispatch import Decision, LocalCall, OpCall, register
from hp_dtensor.placements import Partial, Placement, Replicate, Shard

__all__ = ["embedding_placements"]

aten = torch.ops.aten
R = Replicate()
SUM = Partial("sum")


def embedding_placements(
    table: Layout, ids: Layout | None
) -> tuple[tuple[Placement, ...], tuple[Placement, ...], tuple[Placement, ...], bool]:
    """(table, ids, output) placements and whether some mesh dim is row-wise."""
    ids_ndim = ids.ndim if ids is not None else 1
    t_out: list[Placement] = []
    i_out: list[Placement] = []
    out: list[Placement] = []
    rowwise = False
    for m, placement in enumerate(table.placements):
        id_placement = ids.placements[m] if ids is not None else R
        if placement == Shard(1):
            t_out.append(placement)
            i_out.append(R)
            out.append(Shard(ids_ndim))
        elif placement == Shard(0):
            rowwise = True
            t_out.append(placement)
            i_out.append(R)
            out.append(SUM)
        elif isinstance(id_placement, Shard):
            t_out.append(R)
            i_out.append(id_placement)
            out.append(id_placement)
        else:
            t_out.append(R)
            i_out.append(R)
            out.append(R)
    return tuple(t_out), tuple(i_out), tuple(out), rowwise


def _rowwise_kernel(call: LocalCall) -> torch.Tensor:
    """Look up this rank's rows, zeros elsewhere ([Note: row-wise lookup])."""
    table, ids = call.args[0], call.args[1]
    layout = call.layout(0)
    low = layout.local_offset()[0]
    high = low + table.shape[0]
    inside = (ids >= low) & (ids < high)
    local_ids = torch.where(inside, ids - low, torch.zeros_like(ids))
    if table.shape[0] == 0:
        return table.new_zeros((*ids.shape, table.shape[1]))
    out = aten.embedding.default(table, local_ids)
    return out * inside.unsqueeze(-1).to(out.dtype)


@register(aten.embedding.default)
def embedding_rule(call: OpCall) -> Decision | None:
    """The table above."""
    from hp_dtensor.dtensor import DTensor

    table, ids = call.args[0], call.args[1]
    if not isinstance(table, DTensor) or table.dim() != 2:
        return None
    table_layout = call.layout(call.position_of(table))
    ids_layout: Any = call.layout(call.position_of(ids)) if isinstance(ids, DTensor) else None
    t_target, i_target, out, rowwise = embedding_placements(table_layout, ids_layout)
    inputs = {call.position_of(table): t_target}
    if ids_layout is not None:
        inputs[call.position_of(ids)] = i_target
    return Decision(inputs=inputs, outputs=[out], kernel=_rowwise_kernel if rowwise else None)


@register(aten.embedding_dense_backward.default)
def embedding_backward_rule(call: OpCall) -> Decision | None:
    """Gradient of the table: column shards stay column shards; id-dim shards give partial sums."""
    from hp_dtensor.dtensor import DTensor

    grad, ids = call.args[0], call.args[1]
    if not isinstance(grad, DTensor) or not isinstance(ids, DTensor):
        return None
    pg, pi = call.position_of(grad), call.position_of(ids)
    lg = call.layout(pg)
    tg: list[Placement] = []
    ti: list[Placement] = []
    out: list[Placement] = []
    for placement in lg.placements:
        if isinstance(placement, Shard) and placement.dim == lg.ndim - 1:
            tg.append(placement)
            ti.append(R)
            out.append(Shard(1))
        elif isinstance(placement, Shard):
            tg.append(placement)
            ti.append(placement)
            out.append(SUM)
        else:
            tg.append(R)
            ti.append(R)
            out.append(R)
    return Decision(inputs={pg: tuple(tg), pi: tuple(ti)}, outputs=[tuple(out)])
