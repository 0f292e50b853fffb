"""Embedding lookups and their backward: column-wise, row-wise (vocab-parallel) and batch-sharded.

Per mesh dim, by the table's placement: ``S(1)`` table, ``R`` ids: each rank
looks up its columns (output ``S(last)``); ``S(0)`` table, ``R`` ids: a partial
sum without communication ([Note: row-wise lookup]); ``R`` table, ``S(d)`` ids:
each rank looks up its ids (output ``S(d)``). A table and ids both sharded on
one mesh dim keep the table's shard and gather the ids (ids are small, tables
are not). The row-wise backward computes only this rank's rows
([Note: row-wise backward]). ``embedding_bag`` is in
:mod:`hp_dtensor.ops.embedding_bag`.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

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


# ids tensor (by identity, weakly) -> {num_weights: layout of the last row-sharded table looked up}
_ROWWISE_TABLES: Any = WeakIdKeyDictionary()


def _record_rowwise(ids: torch.Tensor, layout: Layout) -> None:
    """Remember the row-sharded table ``ids`` were looked up in ([Note: row-wise backward])."""
    tables = _ROWWISE_TABLES.get(ids)
    if tables is None:
        tables = _ROWWISE_TABLES[ids] = {}
    tables[layout.shape[0]] = layout


def _rowwise_table(ids: Any, num_weights: int, mesh: Any) -> Layout | None:
    """The table layout recorded for ``ids`` (a DTensor or a plain tensor), if usable here."""
    local = getattr(ids, "_local", ids)
    tables = _ROWWISE_TABLES.get(local)
    layout = None if tables is None else tables.get(num_weights)
    if layout is None or layout.mesh is not mesh:
        return None
    return layout


# [Note: row-wise lookup]
# A rank holding rows ``[lo, hi)`` of the table looks up the ids in that
# range (shifted by ``lo``) and writes zeros for the others, so the ranks'
# outputs sum to the lookup: ``Partial("sum")`` without communication; the
# consumer's all-reduce (or reduce-scatter, for sequence parallelism) finishes
# it.
def _rowwise_kernel(call: LocalCall) -> torch.Tensor:
    """Look up this rank's rows, zeros elsewhere ([Note: row-wise lookup])."""
    table, ids = call.args[0], call.args[1]
    layout = call.layout(0)
    _record_rowwise(ids, layout)
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


# [Note: row-wise backward]
# The backward op (``embedding_dense_backward(grad, ids, num_weights, ...)``)
# does not see the table, so by itself it cannot know the table was cut by
# rows; computed as-is it builds the whole table's gradient on every rank
# (``num_weights`` x dim, replicated), only for ``RowwiseParallel``'s gradient
# hook to slice it back. Instead, the row-wise lookup records, per ids tensor
# (weakly, by identity: autograd hands the backward the very ids tensor the
# forward saw), the table layout it was cut by. The backward rule finds it
# there and computes only this rank's rows: ids outside ``[lo, hi)`` are
# masked out of the gradient, the rest shifted by ``lo``, and the op runs with
# ``num_weights`` = this rank's row count. The result has the table's
# row-shard placements; the values are the full gradient's rows, so it is
# right whichever table the record names: the last lookup of these ids in a
# row-sharded table of this size wins, and ids reused with another such table
# on the same mesh only change where the gradient lands, never its values (a
# table on another mesh object is ignored). The rule is registered
# ``cached=False`` because its decision depends on that record. It falls back
# to the full, replicated gradient when there is no usable record (e.g. ids
# that had to be redistributed for the lookup) and for ``scale_grad_by_freq``
# (which counts ids over the whole vocabulary).
def _rowwise_backward_kernel(table: Layout, call: LocalCall) -> torch.Tensor:
    """This rank's rows of the table gradient ([Note: row-wise backward])."""
    grad, ids = call.args[0], call.args[1]
    padding_idx, scale = call.args[3], call.args[4]
    low = table.local_offset()[0]
    rows = table.local_shape()[0]
    if rows == 0:
        return grad.new_zeros((0, grad.shape[-1]))
    inside = (ids >= low) & (ids < low + rows)
    local_ids = torch.where(inside, ids - low, torch.zeros_like(ids))
    masked = grad * inside.unsqueeze(-1).to(grad.dtype)
    local_padding = padding_idx - low if padding_idx >= 0 and low <= padding_idx < low + rows else -1
    return aten.embedding_dense_backward.default(masked, local_ids, rows, local_padding, scale)


@register(aten.embedding_dense_backward.default, cached=False)
def embedding_backward_rule(call: OpCall) -> Decision | None:
    """Gradient of the table: column shards stay column shards; id-dim shards give partial sums;
    row shards stay row shards when the lookup was recorded ([Note: row-wise backward])."""
    from hp_dtensor.dtensor import DTensor

    grad, ids = call.args[0], call.args[1]
    if not isinstance(grad, DTensor) or not isinstance(ids, DTensor):
        return None
    pg, pi = call.position_of(grad), call.position_of(ids)
    lg = call.layout(pg)
    num_weights, scale = call.args[2], call.args[4]
    table = None if scale else _rowwise_table(ids, num_weights, lg.mesh)
    tg: list[Placement] = []
    ti: list[Placement] = []
    out: list[Placement] = []
    for m, placement in enumerate(lg.placements):
        if table is not None and table.placements[m] == Shard(0):
            tg.append(R)  # every id's gradient row, then keep this rank's rows (the kernel)
            ti.append(R)
            out.append(Shard(0))
        elif isinstance(placement, Shard) and placement.dim == lg.ndim - 1:
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
    kernel = functools.partial(_rowwise_backward_kernel, table) if table is not None else None
    return Decision(inputs={pg: tuple(tg), pi: tuple(ti)}, outputs=[tuple(out)], kernel=kernel)
