"""Reductions: sum, mean, amax / amin, max / min (whole tensor and along a dim with indices).

A sum over a sharded dim is a sum of per-rank sums, so it stays local and
gives ``Partial("sum")``; ``amax`` / ``max()`` give ``Partial("max")`` and
``amin`` / ``min()`` ``Partial("min")``. ``mean`` over a sharded dim gives
``Partial("avg")`` only when every rank holds the same number of rows (the
average of local means is the mean only then); an uneven cut is gathered
first. Max and min of a cut with an empty piece are gathered first too (the
maximum of nothing is undefined). Shards of dims that are not reduced pass
through, renumbered when the reduced dims are dropped.

[Note: max with indices]
``max(x, dim)`` returns values and the index of the maximum. With ``dim``
sharded, each rank reduces its piece; one ``all_reduce(max)`` of the values
gives the answer, and the index is the smallest global index (local index
plus the piece's offset) among the ranks that hold the winning value: one
``all_reduce(min)`` over candidates where the others offer a sentinel larger
than any index. That is PyTorch's choice among ties (the first occurrence),
and both outputs come back replicated along those mesh dims.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import hp_core.collectives as hc
import torch
from hp_core.distributed import mesh_group

from hp_dtensor.layout import Layout, chunk_sizes
from hp_dtensor.ops.dispatch import Decision, LocalCall, OpCall, register
from hp_dtensor.placements import Partial, Placement, Replicate, Shard

__all__ = ["reduce_decision"]

aten = torch.ops.aten
_FULL = {aten.sum.default, aten.mean.default, aten.max.default, aten.min.default}


def _reduced_dims(layout: Layout, dims: Any) -> list[int]:
    if dims is None or (isinstance(dims, Sequence) and len(dims) == 0):
        return list(range(layout.ndim))
    if isinstance(dims, int):
        dims = [dims]
    return sorted({int(d) % max(layout.ndim, 1) for d in dims})


def reduce_decision(
    layout: Layout, dims: list[int], keepdim: bool, kind: str, empty_ok: bool = False
) -> tuple[list[Placement], list[Placement]]:
    """(input, output) placements for a ``kind`` ("sum", "avg", "max", "min") reduction over ``dims``."""
    inputs: list[Placement] = []
    out: list[Placement] = []
    for m, placement in enumerate(layout.placements):
        if isinstance(placement, Partial):
            linear = kind in ("sum", "avg") and placement.reduce_op in ("sum", "avg")
            same = kind in ("max", "min") and placement.reduce_op == kind
            keep = linear or same
            inputs.append(placement if keep else Replicate())
            out.append(placement if keep else Replicate())
        elif isinstance(placement, Shard) and placement.dim in dims:
            sizes = chunk_sizes(layout.shape[placement.dim], layout.mesh.shape[m])
            uneven = any(s != sizes[0] for s in sizes)
            if (kind == "avg" and uneven) or (kind in ("max", "min") and 0 in sizes and not empty_ok):
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
    return inputs, out


def _reduce(call: OpCall, kind: str) -> Decision:
    position = call.positions[0]
    layout = call.layout(position)
    if call.func in _FULL:
        dims, keepdim = _reduced_dims(layout, None), False
    else:
        dims = _reduced_dims(layout, call.args[1] if len(call.args) > 1 else call.kwargs.get("dim"))
        keepdim = bool(call.args[2]) if len(call.args) > 2 else bool(call.kwargs.get("keepdim", False))
    inputs, out = reduce_decision(layout, dims, keepdim, kind)
    return Decision(inputs={position: tuple(inputs)}, outputs=[tuple(out)])


@register(aten.sum.default, aten.sum.dim_IntList)
def sum_rule(call: OpCall) -> Decision:
    """Sum: sharded reduced dims become ``Partial("sum")``."""
    return _reduce(call, "sum")


@register(aten.mean.default, aten.mean.dim)
def mean_rule(call: OpCall) -> Decision:
    """Mean: even sharded reduced dims become ``Partial("avg")``."""
    return _reduce(call, "avg")


@register(aten.amax.default, aten.max.default)
def amax_rule(call: OpCall) -> Decision:
    """Max over dims (or all of them): sharded reduced dims become ``Partial("max")``."""
    return _reduce(call, "max")


@register(aten.amin.default, aten.min.default)
def amin_rule(call: OpCall) -> Decision:
    """Min over dims (or all of them): sharded reduced dims become ``Partial("min")``."""
    return _reduce(call, "min")


def _select_kernel(kind: str) -> Callable[[LocalCall], tuple[torch.Tensor, torch.Tensor]]:
    """``max.dim`` / ``min.dim`` with ``dim`` sharded (see [Note: max with indices])."""

    def run(call: LocalCall) -> tuple[torch.Tensor, torch.Tensor]:
        x = call.args[0]
        dim = int(call.args[1]) % x.dim()
        keepdim = bool(call.args[2]) if len(call.args) > 2 else bool(call.kwargs.get("keepdim", False))
        layout = call.layout(0)
        sentinel = torch.iinfo(torch.int64).max
        empty = x.shape[dim] == 0  # an uneven cut's empty piece: it offers nothing
        if empty:
            shape = list(x.shape)
            if keepdim:
                shape[dim] = 1
            else:
                del shape[dim]
            info = torch.finfo(x.dtype) if x.is_floating_point() else torch.iinfo(x.dtype)
            values = x.new_full(shape, info.min if kind == "max" else info.max)
            indices = torch.full(shape, sentinel, dtype=torch.int64, device=x.device)
        else:
            values, indices = call.func(x, dim, keepdim)
        offset = layout.local_offset()[dim]
        groups = [
            mesh_group(layout.mesh, m)
            for m, p in enumerate(layout.placements)
            if isinstance(p, Shard) and p.dim == dim
        ]
        best = values.contiguous().clone()
        for group in groups:
            hc.all_reduce(best, kind, group)
        won = (values == best) & (not empty)
        candidates = torch.where(won, indices + offset, torch.full_like(indices, sentinel))
        for group in groups:
            hc.all_reduce(candidates, "min", group)
        return best, candidates

    return run


def _select_rule(kind: str) -> Callable[[OpCall], Decision]:
    def rule(call: OpCall) -> Decision:
        position = call.positions[0]
        layout = call.layout(position)
        dim = int(call.args[1]) % max(layout.ndim, 1)
        keepdim = bool(call.args[2]) if len(call.args) > 2 else bool(call.kwargs.get("keepdim", False))
        inputs, out = reduce_decision(layout, [dim], keepdim, kind, empty_ok=True)
        # Values and indices are complete after the kernel: replicated where the dim was cut.
        out = [Replicate() if isinstance(p, Partial) else p for p in out]
        sharded = any(isinstance(p, Shard) and p.dim == dim for p in inputs)
        kernel = _select_kernel(kind) if sharded else None
        inputs = [Replicate() if isinstance(p, Partial) else p for p in inputs]
        return Decision(inputs={position: tuple(inputs)}, outputs=[tuple(out), tuple(out)], kernel=kernel)

    return rule


register(aten.max.dim)(_select_rule("max"))
register(aten.min.dim)(_select_rule("min"))
