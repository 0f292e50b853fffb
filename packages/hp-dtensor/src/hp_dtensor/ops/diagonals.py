"""Diagonals: ``diagonal`` (+ copy, backward, scatter), ``diag_embed`` and ``trace`` on cut inputs.

``diagonal(x, offset, dim1, dim2)`` takes, for every index of the other
dims (the *batch* dims), the diagonal of the matrix in ``dim1`` x ``dim2``;
the output holds the batch dims in order, then the diagonal. A cut batch dim
is copied as it is: each rank takes the diagonals of its own matrices, and
the output is cut on that dim's place among the batch dims, with no
communication; so are ``diagonal_copy``, ``diagonal_backward`` (the
diagonals put back into zeros), ``diagonal_scatter`` (the input and the
source cut alike) and ``diag_embed`` (the inverse: the last dim becomes the
diagonal of two new dims). A cut of a matrix dim would leave each rank a
ragged run of the diagonal, so that mesh dim is gathered. The ops are
linear: a ``Partial("sum")`` / ``Partial("avg")`` input stays partial
(``diagonal_scatter`` keeps it only with both operands partial).

``trace`` of a matrix cut on rows and / or columns is a partial sum: the
piece starting at row ``o`` and column ``c`` holds diagonal element ``i`` at
local ``(i - o, i - c)``, on its local diagonal ``o - c``, so each rank sums
that and the result is ``Partial("sum")`` with no communication (an empty
run sums to zero). torch's DTensor gathers these cuts (one all-gather);
``diag`` and ``diagflat`` reach ``diag_embed`` / ``diagonal``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hp_dtensor.ops.dispatch import Decision, LocalCall, OpCall, register
from hp_dtensor.placements import Partial, Placement, Replicate, Shard

__all__ = ["diag_embed_rule", "diagonal_rule", "trace_rule"]

aten = torch.ops.aten
R = Replicate()


def _arg(call: OpCall, index: int, name: str, default: Any) -> Any:
    return call.args[index] if len(call.args) > index else call.kwargs.get(name, default)


def _linear_partial(p: Placement) -> bool:
    return isinstance(p, Partial) and p.reduce_op in ("sum", "avg")


def _batch_dims(ndim: int, dim1: int, dim2: int) -> list[int]:
    """The dims of an ``ndim``-D tensor other than its two matrix dims, in order."""
    first, second = dim1 % ndim, dim2 % ndim
    return [d for d in range(ndim) if d not in (first, second)]


def _map(
    placements: tuple[Placement, ...], cut: Callable[[int], Placement | None]
) -> tuple[tuple[Placement, ...], tuple[Placement, ...]]:
    """(input, output) placements: a cut of dim ``d`` becomes ``cut(d)`` (None: gathered); partials stay."""
    inputs: list[Placement] = []
    outputs: list[Placement] = []
    for p in placements:
        out = cut(p.dim) if isinstance(p, Shard) else p if _linear_partial(p) else None
        inputs.append(R if out is None else p)
        outputs.append(R if out is None else out)
    return tuple(inputs), tuple(outputs)


def _carry(
    placements: tuple[Placement, ...], source: list[int], target: list[int]
) -> tuple[tuple[Placement, ...], tuple[Placement, ...]]:
    """A cut of ``source[i]`` becomes a cut of ``target[i]``; other cuts are gathered."""
    return _map(placements, lambda d: Shard(target[source.index(d)]) if d in source else None)


@register(aten.diagonal.default, aten.diagonal_copy.default)
def diagonal_rule(call: OpCall) -> Decision:
    """Batch-dim cuts pass to their place among the output's leading dims."""
    position = call.positions[0]
    layout = call.layout(position)
    dim1, dim2 = _arg(call, 2, "dim1", 0), _arg(call, 3, "dim2", 1)
    batch = _batch_dims(layout.ndim, dim1, dim2)
    inputs, outputs = _carry(layout.placements, batch, list(range(len(batch))))
    return Decision(inputs={position: inputs}, outputs=[outputs])


@register(aten.diagonal_backward.default)
def diagonal_backward_rule(call: OpCall) -> Decision:
    """The gradient's leading-dim cuts go back to the input's batch dims (the size is made local)."""
    position = call.positions[0]
    layout = call.layout(position)
    ndim = len(call.args[1])
    batch = _batch_dims(ndim, call.args[3], call.args[4])
    inputs, outputs = _carry(layout.placements, list(range(len(batch))), batch)
    return Decision(inputs={position: inputs}, outputs=[outputs], size_arg=1)


@register(aten.diag_embed.default)
def diag_embed_rule(call: OpCall) -> Decision:
    """Cuts of the leading dims pass to the output dims that are not the two new matrix dims."""
    position = call.positions[0]
    layout = call.layout(position)
    dim1, dim2 = _arg(call, 2, "dim1", -2), _arg(call, 3, "dim2", -1)
    batch = _batch_dims(layout.ndim + 1, dim1, dim2)
    inputs, outputs = _carry(layout.placements, list(range(layout.ndim - 1)), batch)
    return Decision(inputs={position: inputs}, outputs=[outputs])


@register(aten.diagonal_scatter.default)
def diagonal_scatter_rule(call: OpCall) -> Decision:
    """``self`` keeps its batch cuts and ``src`` takes the matching cut of its leading dims."""
    self_pos, src_pos = call.position_of(call.args[0]), call.position_of(call.args[1])
    base, src = call.layout(self_pos), call.layout(src_pos)
    dim1, dim2 = _arg(call, 3, "dim1", 0), _arg(call, 4, "dim2", 1)
    batch = _batch_dims(base.ndim, dim1, dim2)
    lead = list(range(len(batch)))
    self_in: list[Placement] = []
    src_in: list[Placement] = []
    for p, q in zip(base.placements, src.placements, strict=True):
        if isinstance(p, Shard) and p.dim in batch:
            self_in.append(p)
            src_in.append(Shard(lead[batch.index(p.dim)]))
        elif isinstance(q, Shard) and q.dim in lead:
            self_in.append(Shard(batch[q.dim]))
            src_in.append(q)
        elif _linear_partial(p) and p == q:
            self_in.append(p)
            src_in.append(q)
        else:
            self_in.append(R)
            src_in.append(R)
    placements = tuple(self_in)
    return Decision(inputs={self_pos: placements, src_pos: tuple(src_in)}, outputs=[placements])


def _trace_kernel(call: LocalCall) -> torch.Tensor:
    """The sum of this rank's run of the diagonal (see the module docstring)."""
    x = call.args[0]
    row, column = call.layout(0).local_offset()
    dtype = call.func(x.new_empty(0, 0)).dtype  # the op's result dtype (int64 for integer inputs)
    return torch.diagonal(x, row - column).sum(dtype=dtype)


@register(aten.trace.default)
def trace_rule(call: OpCall) -> Decision:
    """Row and column cuts give a partial sum of the local diagonal runs; partial sums stay partial."""
    position = call.positions[0]
    layout = call.layout(position)
    inputs, outputs = _map(layout.placements, lambda d: Partial("sum"))
    cut = any(isinstance(p, Shard) for p in inputs)
    return Decision(inputs={position: inputs}, outputs=[outputs], kernel=_trace_kernel if cut else None)
