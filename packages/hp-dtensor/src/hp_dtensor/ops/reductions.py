"""Reductions (sum, mean, amax) and softmax / log_softmax with their backward ops.

A sum over a sharded dim is a sum of per-rank sums, so it stays local and
gives ``Partial("sum")``; ``amax`` gives ``Partial("max")``. ``mean`` over a
sharded dim gives ``Partial("avg")`` only when every rank holds the same
number of rows (the average of local means is the mean only then); an uneven
cut is gathered first. Softmax needs its whole dim on one rank, so that dim
is gathered; other shards pass through.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hp_dtensor.layout import Layout, chunk_sizes
from hp_dtensor.ops.dispatch import Decision, OpCall, register
from hp_dtensor.placements import Partial, Placement, Replicate, Shard

__all__ = ["whole_dims_rule"]

aten = torch.ops.aten


def _reduced_dims(layout: Layout, dims: Any) -> list[int]:
    if dims is None or (isinstance(dims, Sequence) and len(dims) == 0):
        return list(range(layout.ndim))
    if isinstance(dims, int):
        dims = [dims]
    return sorted({int(d) % max(layout.ndim, 1) for d in dims})


def _reduce(call: OpCall, kind: str) -> Decision:
    position = call.positions[0]
    layout = call.layout(position)
    if call.func in (aten.sum.default, aten.mean.default):
        dims, keepdim = _reduced_dims(layout, None), False
    else:
        dims = _reduced_dims(layout, call.args[1] if len(call.args) > 1 else call.kwargs.get("dim"))
        keepdim = bool(call.args[2]) if len(call.args) > 2 else bool(call.kwargs.get("keepdim", False))
    inputs: list[Placement] = []
    out: list[Placement] = []
    for m, placement in enumerate(layout.placements):
        if isinstance(placement, Partial):
            linear = kind in ("sum", "avg") and placement.reduce_op in ("sum", "avg")
            inputs.append(placement if linear else Replicate())
            out.append(placement if linear else Replicate())
        elif isinstance(placement, Shard) and placement.dim in dims:
            sizes = chunk_sizes(layout.shape[placement.dim], layout.mesh.shape[m])
            if kind == "avg" and any(s != sizes[0] for s in sizes):
                inputs.append(Replicate())
                out.append(Replicate())
            else:
                inputs.append(placement)
                out.append(Partial(kind))
        elif isinstance(placement, Shard):
            inputs.append(placement)
            shift = 0 if keepdim else sum(1 for d in dims if d < placement.dim)
            out.append(Shard(placement.dim - shift))
        else:
            inputs.append(placement)
            out.append(placement)
    return Decision(inputs={position: tuple(inputs)}, outputs=[tuple(out)])


@register(aten.sum.default, aten.sum.dim_IntList)
def sum_rule(call: OpCall) -> Decision:
    """Sum: sharded reduced dims become ``Partial("sum")``."""
    return _reduce(call, "sum")


@register(aten.mean.default, aten.mean.dim)
def mean_rule(call: OpCall) -> Decision:
    """Mean: even sharded reduced dims become ``Partial("avg")``."""
    return _reduce(call, "avg")


@register(aten.amax.default)
def amax_rule(call: OpCall) -> Decision:
    """Max over dims: sharded reduced dims become ``Partial("max")``."""
    return _reduce(call, "max")


def whole_dims_rule(call: OpCall, dims: Sequence[int], n_outputs: int = 1) -> Decision:
    """Inputs keep the first input's shards except on ``dims`` (gathered) and partials (reduced)."""
    ref = call.layout(call.positions[0])
    target: list[Placement] = []
    for placement in ref.placements:
        if isinstance(placement, Shard) and placement.dim not in dims:
            target.append(placement)
        else:
            target.append(Replicate())
    inputs = {p: tuple(target) for p in call.positions if call.layout(p).shape == ref.shape}
    for p in call.positions:
        if p not in inputs:
            inputs[p] = (Replicate(),) * ref.mesh.ndim
    return Decision(inputs=inputs, outputs=[tuple(target)] * n_outputs)


@register(aten._softmax.default, aten._log_softmax.default)
def softmax_rule(call: OpCall) -> Decision:
    """Softmax over ``dim``: that dim whole, others as they are."""
    ndim = call.layout(call.positions[0]).ndim
    return whole_dims_rule(call, [int(call.args[1]) % ndim])


@register(aten._softmax_backward_data.default, aten._log_softmax_backward_data.default)
def softmax_backward_rule(call: OpCall) -> Decision:
    """The backward of softmax needs the same whole dim."""
    ndim = call.layout(call.positions[0]).ndim
    return whole_dims_rule(call, [int(call.args[2]) % ndim])
