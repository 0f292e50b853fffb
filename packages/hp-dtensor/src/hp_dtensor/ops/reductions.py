"""Reductions: sum, mean, amax / amin, max / min (whole tensor and along a dim with indices).

A sum over a sharded dim is a sum of per-rank sums, so it stays local and
gives ``Partial("sum")``; ``amax`` / ``max()`` give ``Partial("max")`` and
``amin`` / ``min()`` ``Partial("min")``. ``mean`` over a sharded dim gives
``Partial("avg")`` when every rank holds the same number of rows, and a
local sum over the global count, ``Partial("sum")``, when the cut is uneven
([Note: mean over an uneven cut]). Max and min of a cut with an empty piece
are gathered first (the maximum of nothing is undefined). Shards of dims that are not reduced pass
through, renumbered when the reduced dims are dropped. ``max(x, dim)`` with
``dim`` sharded takes one all-reduce of the values and one of the indices
([Note: max with indices]).
"""

from __future__ import annotations

import math
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


# [Note: mean over an uneven cut]
# The average of the pieces' means is the mean only when every piece holds
# the same number of elements; 5 rows over 2 ranks would weigh a row of the
# 2-row piece like 1.5 rows of the 3-row one. So when any mesh dim cuts a
# reduced dim unevenly, each rank divides its piece's *sum* by the *global*
# count of the reduced elements (known from the global shape) and the terms
# are ``Partial("sum")`` on every mesh dim that cuts a reduced dim: they add up
# to the mean however the rows are cut, an empty piece adds 0, and nothing is
# gathered. ``l1_loss``, ``kl_div`` and the other losses torch writes as
# pointwise ops then ``mean()`` take this path. Linear partial inputs stay as
# they are (the kernel is linear). The backward is torch's (``expand`` of the
# gradient divided by the count): pointwise, no communication.
def _mean_over_count(dims: list[int], keepdim: bool, count: int) -> Callable[[LocalCall], torch.Tensor]:
    """The local sum over ``dims`` divided by the global ``count`` (see [Note: mean over an uneven cut])."""

    def run(call: LocalCall) -> torch.Tensor:
        x = call.args[0]
        total = torch.sum(x, dims, keepdim=keepdim, dtype=call.kwargs.get("dtype"))
        return total / count

    return run


@register(aten.mean.default, aten.mean.dim)
def mean_rule(call: OpCall) -> Decision:
    """Mean: even sharded reduced dims become ``Partial("avg")``, uneven ones a sum over the global count."""
    position = call.positions[0]
    layout = call.layout(position)
    if call.func is aten.mean.default:
        dims, keepdim = _reduced_dims(layout, None), False
    else:
        dims = _reduced_dims(layout, call.args[1] if len(call.args) > 1 else call.kwargs.get("dim"))
        keepdim = bool(_kwarg(call, 2, "keepdim", False))
    cutting = {m: p.dim for m, p in enumerate(layout.placements) if isinstance(p, Shard) and p.dim in dims}
    uneven = any(len(set(chunk_sizes(layout.shape[d], layout.mesh.shape[m]))) > 1 for m, d in cutting.items())
    if not uneven:
        return _reduce(call, "avg")
    inputs, out = reduce_decision(layout, dims, keepdim, "sum")
    count = math.prod(layout.shape[d] for d in dims)
    kernel = _mean_over_count(dims, keepdim, count)
    return Decision(inputs={position: tuple(inputs)}, outputs=[tuple(out)], kernel=kernel)


@register(aten.amax.default, aten.max.default)
def amax_rule(call: OpCall) -> Decision:
    """Max over dims (or all of them): sharded reduced dims become ``Partial("max")``."""
    return _reduce(call, "max")


@register(aten.amin.default, aten.min.default)
def amin_rule(call: OpCall) -> Decision:
    """Min over dims (or all of them): sharded reduced dims become ``Partial("min")``."""
    return _reduce(call, "min")


@register(aten.any.default, aten.any.dim, aten.any.dims, aten.all.default, aten.all.dim, aten.all.dims)
def any_all_rule(call: OpCall) -> Decision:
    """``any`` / ``all``: sharded reduced dims become ``Partial("max")`` / ``Partial("min")`` of booleans.

    A piece's ``any`` is False and its ``all`` True when it is empty, the
    identities of max and min over booleans, so uneven cuts need nothing. A
    partial input is reduced first.
    """
    position = call.positions[0]
    layout = call.layout(position)
    if call.func in (aten.any.default, aten.all.default):
        dims, keepdim = _reduced_dims(layout, None), False
    else:
        dims = _reduced_dims(layout, call.args[1] if len(call.args) > 1 else call.kwargs.get("dim"))
        keepdim = bool(call.args[2]) if len(call.args) > 2 else bool(call.kwargs.get("keepdim", False))
    kind = "max" if call.func in (aten.any.default, aten.any.dim, aten.any.dims) else "min"
    inputs, out = reduce_decision(layout, dims, keepdim, kind, empty_ok=True)
    for m, placement in enumerate(layout.placements):
        if isinstance(placement, Partial):  # whether a sum's (or max's) value is nonzero is not per term
            inputs[m] = out[m] = Replicate()
    return Decision(inputs={position: tuple(inputs)}, outputs=[tuple(out)])


# [Note: max with indices]
# ``max(x, dim)`` returns values and the index of the maximum. With ``dim``
# sharded, each rank reduces its piece; one ``all_reduce(max)`` of the values
# gives the answer, and the index is the smallest global index (local index
# plus the piece's offset) among the ranks that hold the winning value: one
# ``all_reduce(min)`` over candidates where the others offer a sentinel larger
# than any index. That is PyTorch's choice among ties (the first occurrence),
# and both outputs come back replicated along those mesh dims.
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
            if x.dtype == torch.bool:  # the identities of max and min over bools
                fill: Any = kind != "max"
            else:
                info = torch.finfo(x.dtype) if x.is_floating_point() else torch.iinfo(x.dtype)
                fill = info.min if kind == "max" else info.max
            values = x.new_full(shape, fill)
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


# -- reductions computed by a kernel, or with the reduced dims gathered ----------------------------


def kernel_reduce_decision(
    layout: Layout, dims: list[int], keepdim: bool, gather: bool = False
) -> tuple[tuple[Placement, ...], tuple[Placement, ...], list[int]]:
    """(input, output, mesh dims cutting a reduced dim) for a reduction that is not a partial.

    Partial inputs are reduced. With ``gather`` the reduced dims' shards are
    gathered and the op runs locally; otherwise they stay and a kernel combines
    the pieces across the returned mesh dims, its output replicated there.
    Shards of other dims pass, renumbered when the reduced dims are dropped.
    """
    inputs: list[Placement] = []
    out: list[Placement] = []
    cutting: list[int] = []
    for m, placement in enumerate(layout.placements):
        if isinstance(placement, Shard) and placement.dim in dims:
            inputs.append(Replicate() if gather else placement)
            out.append(Replicate())
            if not gather:
                cutting.append(m)
        elif isinstance(placement, Shard):
            inputs.append(placement)
            shift = 0 if keepdim else sum(1 for d in dims if d < placement.dim)
            out.append(Shard(placement.dim - shift))
        else:
            inputs.append(Replicate())
            out.append(Replicate())
    return tuple(inputs), tuple(out), cutting


def _groups(layout: Layout, mesh_dims: list[int]) -> list[Any]:
    return [mesh_group(layout.mesh, m) for m in mesh_dims]


def _drop(value: torch.Tensor, dims: list[int], keepdim: bool) -> torch.Tensor:
    """``value`` reduced with ``keepdim=True`` over ``dims``, squeezed unless ``keepdim``."""
    return value if keepdim or not dims else value.squeeze(dims)


def _kwarg(call: OpCall | LocalCall, index: int, name: str, default: Any) -> Any:
    if len(call.args) > index:
        return call.args[index]
    return call.kwargs.get(name, default)


def _logsumexp_kernel(dims: list[int], keepdim: bool, mesh_dims: list[int]) -> Callable[[LocalCall], Any]:
    """Local max, ``all_reduce(max)``, local sum of ``exp(x - max)``, ``all_reduce(sum)``, log."""

    def run(call: LocalCall) -> torch.Tensor:
        x = call.args[0]
        if not x.is_floating_point() and not x.is_complex():
            x = x.to(torch.get_default_dtype())
        groups = _groups(call.layout(0), mesh_dims)
        if x.numel() == 0:
            shape = [1 if d in dims else s for d, s in enumerate(x.shape)]
            best = x.new_full(shape, float("-inf"))
        else:
            best = x.amax(dims, keepdim=True).contiguous()
        for group in groups:
            hc.all_reduce(best, "max", group)
        best = best.masked_fill(best.isinf(), 0.0)  # torch's shift for rows of infinities
        total = (x - best).exp().sum(dims, keepdim=True).contiguous()
        for group in groups:
            hc.all_reduce(total, "sum", group)
        return _drop(total.log() + best, dims, keepdim)

    return run


@register(aten.logsumexp.default)
def logsumexp_rule(call: OpCall) -> Decision:
    """``logsumexp``: other dims' shards pass; sharded reduced dims by a max and a sum all-reduce."""
    position = call.position_of(call.args[0])
    layout = call.layout(position)
    dims = _reduced_dims(layout, _kwarg(call, 1, "dim", None))
    keepdim = bool(_kwarg(call, 2, "keepdim", False))
    inputs, out, cutting = kernel_reduce_decision(layout, dims, keepdim)
    kernel = _logsumexp_kernel(dims, keepdim, cutting) if cutting else None
    return Decision(inputs={position: inputs}, outputs=[out], kernel=kernel)


@register(aten.prod.default, aten.prod.dim_int)
def prod_rule(call: OpCall) -> Decision:
    """``prod``: other dims' shards pass; sharded reduced dims give ``Partial("product")``, no communication.

    The product of the pieces' products is the product (an empty piece's is 1,
    the identity), exact with zeros and negatives; the one all-reduce is paid
    when a later op needs the value, or never when it stays partial, as in
    torch's DTensor.
    """
    position = call.position_of(call.args[0])
    layout = call.layout(position)
    if call.func is aten.prod.default:
        dims, keepdim = _reduced_dims(layout, None), False
    else:
        dims = _reduced_dims(layout, call.args[1])
        keepdim = bool(_kwarg(call, 2, "keepdim", False))
    inputs, out, cutting = kernel_reduce_decision(layout, dims, keepdim)
    product = tuple(Partial("product") if m in cutting else p for m, p in enumerate(out))
    return Decision(inputs={position: inputs}, outputs=[product])


@register(aten.aminmax.default)
def aminmax_rule(call: OpCall) -> Decision:
    """``aminmax``: sharded reduced dims give ``Partial("min")`` and ``Partial("max")``, no communication."""
    position = call.position_of(call.args[0])
    layout = call.layout(position)
    dim = call.kwargs.get("dim", call.args[1] if len(call.args) > 1 else None)
    dims = _reduced_dims(layout, dim)
    keepdim = bool(_kwarg(call, 2, "keepdim", False))
    # Only the shards reach the outputs: partial inputs are reduced (their min and max differ).
    whole = layout.with_placements([p if isinstance(p, Shard) else Replicate() for p in layout.placements])
    inputs, low = reduce_decision(whole, dims, keepdim, "min")
    _, high = reduce_decision(whole, dims, keepdim, "max")
    return Decision(inputs={position: tuple(inputs)}, outputs=[tuple(low), tuple(high)])


@register(aten.mode.default)
def mode_rule(call: OpCall) -> Decision:
    """``mode`` along ``dim``: that dim is gathered if sharded (a mode is not combinable); others pass."""
    position = call.position_of(call.args[0])
    layout = call.layout(position)
    dims = _reduced_dims(layout, int(_kwarg(call, 1, "dim", -1)))
    keepdim = bool(_kwarg(call, 2, "keepdim", False))
    inputs, out, _ = kernel_reduce_decision(layout, dims, keepdim, gather=True)
    return Decision(inputs={position: inputs}, outputs=[out, out])
