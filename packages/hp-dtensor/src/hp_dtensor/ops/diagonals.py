"""Diagonals: ``diagonal`` (+ copy, backward, scatter), ``diag_embed`` and ``trace`` on cut inputs.

See [Note: diagonal plans].
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from typing import Any

import torch

from hp_dtensor.layout import Layout
from hp_dtensor.ops.dispatch import Decision, LocalCall, OpCall, register
from hp_dtensor.placements import Partial, Placement, Replicate, Shard

__all__ = ["diag_embed_rule", "diagonal_rule", "trace_rule"]


# [Note: diagonal plans]
# ``diagonal(x, offset, dim1, dim2)`` takes, for every index of the other
# dims (the *batch* dims), the diagonal of the matrix in ``dim1`` x ``dim2``;
# the output holds the batch dims in order, then the diagonal. A cut batch dim
# is copied as it is: each rank takes the diagonals of its own matrices, and
# the output is cut on that dim's place among the batch dims, with no
# communication; so are ``diagonal_copy``, ``diagonal_backward`` (the
# diagonals put back into zeros), ``diagonal_scatter`` (the input and the
# source cut alike) and ``diag_embed`` (the inverse: the last dim becomes the
# diagonal of two new dims). A cut of a matrix dim leaves each rank a run of
# the diagonal: kept, on the output's last dim, where the runs are the
# output's own pieces ([Note: cut matrix dims]), gathered otherwise; a cut
# diagonal given to ``diag_embed`` becomes a cut of the rows (or columns) by
# the same test. The ops are
# linear: a ``Partial("sum")`` / ``Partial("avg")`` input stays partial
# (``diagonal_scatter`` keeps it only with both operands partial).
#
# ``trace`` of a matrix cut on rows and / or columns is a partial sum: the
# piece starting at row ``o`` and column ``c`` holds diagonal element ``i`` at
# local ``(i - o, i - c)``, on its local diagonal ``o - c``, so each rank sums
# that and the result is ``Partial("sum")`` with no communication (an empty
# run sums to zero). torch's DTensor gathers these cuts (one all-gather);
# ``diag`` and ``diagflat`` reach ``diag_embed`` / ``diagonal``.

aten = torch.ops.aten
R = Replicate()


def _arg(call: OpCall | LocalCall, index: int, name: str, default: Any) -> Any:
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


# [Note: cut matrix dims]
# Diagonal element ``i`` (offset ``k``) sits at row ``i + r0`` and column
# ``i + c0`` (``r0 = max(0, -k)``, ``c0 = max(0, k)``). A rank holding rows
# ``[ro, ro + rs)`` and columns ``[co, co + cs)`` of the matrix holds the
# run ``i`` in ``[max(ro - r0, co - c0), min(ro + rs - r0, co + cs - c0))``,
# on its local diagonal ``k + ro - co``. When at every mesh coordinate that
# run is exactly the rank's ``torch.chunk`` piece of the diagonal (a square
# matrix cut on its rows, offset 0, is the common case), the output is cut on
# its last dim with no communication; otherwise those mesh dims are gathered.
# ``diagonal_backward`` puts the pieces back into the rows (or else the
# columns) by the same test.
def _runs_agree(matrix: Layout, diagonal: Layout, first: int, second: int, k: int) -> bool:
    """Whether every rank's run of the diagonal is its piece of the output's last dim."""
    rows, columns = matrix.shape[first], matrix.shape[second]
    r0, c0 = max(0, -k), max(0, k)
    length = max(min(rows - r0, columns - c0), 0)
    for coord in itertools.product(*(range(n) for n in matrix.mesh.shape)):
        offset, size = matrix.local_offset_at(coord), matrix.local_shape_at(coord)
        low = max(offset[first] - r0, offset[second] - c0, 0)
        high = min(offset[first] + size[first] - r0, offset[second] + size[second] - c0, length)
        count = max(high - low, 0)
        if diagonal.local_shape_at(coord)[-1] != count:
            return False
        if count and diagonal.local_offset_at(coord)[-1] != low:
            return False
    return True


def _shifted(matrix: Layout, k: int, first: int, second: int) -> int:
    """This rank's local diagonal offset ([Note: cut matrix dims])."""
    offset = matrix.local_offset()
    return k + offset[first] - offset[second]


def _diagonal_kernel(call: LocalCall) -> torch.Tensor:
    x = call.args[0]
    k, dim1, dim2 = _arg(call, 1, "offset", 0), _arg(call, 2, "dim1", 0), _arg(call, 3, "dim2", 1)
    first, second = dim1 % x.dim(), dim2 % x.dim()
    return call.func(x, _shifted(call.layout(0), k, first, second), dim1, dim2)


@register(aten.diagonal.default, aten.diagonal_copy.default)
def diagonal_rule(call: OpCall) -> Decision:
    """Batch-dim cuts pass to the output's leading dims; matrix cuts whose runs agree to its last."""
    position = call.positions[0]
    layout = call.layout(position)
    k, dim1, dim2 = _arg(call, 1, "offset", 0), _arg(call, 2, "dim1", 0), _arg(call, 3, "dim2", 1)
    first, second = dim1 % layout.ndim, dim2 % layout.ndim
    batch = _batch_dims(layout.ndim, dim1, dim2)
    inputs, outputs = _carry(layout.placements, batch, list(range(len(batch))))
    matrix = [m for m, p in enumerate(layout.placements) if p in (Shard(first), Shard(second))]
    if matrix:
        ins, outs = list(inputs), list(outputs)
        for m in matrix:
            ins[m], outs[m] = layout.placements[m], Shard(len(batch))
        shape = (*[layout.shape[d] for d in batch], _diagonal_length(layout.shape, first, second, k))
        cut, diag = layout.with_placements(ins), Layout(layout.mesh, outs, shape)
        if _runs_agree(cut, diag, first, second, k):
            return Decision(inputs={position: tuple(ins)}, outputs=[tuple(outs)], kernel=_diagonal_kernel)
    return Decision(inputs={position: inputs}, outputs=[outputs])


def _diagonal_length(shape: tuple[int, ...] | list[int], first: int, second: int, k: int) -> int:
    return max(min(shape[first] - max(0, -k), shape[second] - max(0, k)), 0)


def _backward_kernel(matrix: Layout, call: LocalCall) -> torch.Tensor:
    grad, sizes, k, dim1, dim2 = call.args[:5]
    first, second = dim1 % len(sizes), dim2 % len(sizes)
    return call.func(grad, sizes, _shifted(matrix, k, first, second), dim1, dim2)


@register(aten.diagonal_backward.default)
def diagonal_backward_rule(call: OpCall) -> Decision:
    """Leading-dim cuts go back to the batch dims; a cut diagonal to the rows or columns if its runs agree."""
    position = call.positions[0]
    layout = call.layout(position)
    sizes = [int(s) for s in call.args[1]]
    k, first, second = int(call.args[2]), call.args[3] % len(sizes), call.args[4] % len(sizes)
    batch = _batch_dims(len(sizes), first, second)
    inputs, outputs = _carry(layout.placements, list(range(len(batch))), batch)
    cut = [m for m, p in enumerate(layout.placements) if p == Shard(len(batch))]
    for target in (first, second):
        if not cut:
            break
        ins, outs = list(inputs), list(outputs)
        for m in cut:
            ins[m], outs[m] = layout.placements[m], Shard(target)
        matrix = Layout(layout.mesh, outs, sizes)
        if _runs_agree(matrix, layout.with_placements(ins), first, second, k):
            kernel = functools.partial(_backward_kernel, matrix)
            return Decision(inputs={position: tuple(ins)}, outputs=[tuple(outs)], size_arg=1, kernel=kernel)
    return Decision(inputs={position: inputs}, outputs=[outputs], size_arg=1)


def _embed_kernel(matrix: Layout, call: LocalCall) -> torch.Tensor:
    """This rank's rows (or columns) of the matrices, its run of the diagonal written in."""
    x = call.args[0]
    k, dim1, dim2 = _arg(call, 1, "offset", 0), _arg(call, 2, "dim1", -2), _arg(call, 3, "dim2", -1)
    first, second = dim1 % matrix.ndim, dim2 % matrix.ndim
    out = x.new_zeros(matrix.local_shape())
    torch.diagonal(out, _shifted(matrix, k, first, second), first, second).copy_(x)
    return out


@register(aten.diag_embed.default)
def diag_embed_rule(call: OpCall) -> Decision:
    """Leading-dim cuts pass to the batch dims; a cut diagonal to the rows or columns if its runs agree."""
    position = call.positions[0]
    layout = call.layout(position)
    k, dim1, dim2 = _arg(call, 1, "offset", 0), _arg(call, 2, "dim1", -2), _arg(call, 3, "dim2", -1)
    ndim = layout.ndim + 1
    first, second = dim1 % ndim, dim2 % ndim
    batch = _batch_dims(ndim, dim1, dim2)
    inputs, outputs = _carry(layout.placements, list(range(layout.ndim - 1)), batch)
    cut = [m for m, p in enumerate(layout.placements) if p == Shard(layout.ndim - 1)]
    size = layout.shape[-1] + abs(k)
    shape = [0] * ndim
    for d, s in zip(batch, layout.shape[:-1], strict=True):
        shape[d] = s
    shape[first] = shape[second] = size
    for target in (first, second) if cut else ():
        ins, outs = list(inputs), list(outputs)
        for m in cut:
            ins[m], outs[m] = layout.placements[m], Shard(target)
        matrix = Layout(layout.mesh, outs, shape)
        if _runs_agree(matrix, layout.with_placements(ins), first, second, k):
            kernel = functools.partial(_embed_kernel, matrix)
            return Decision(inputs={position: tuple(ins)}, outputs=[tuple(outs)], kernel=kernel)
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
