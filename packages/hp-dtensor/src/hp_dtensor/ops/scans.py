"""Scans along one dim: cumsum, cumprod, logcumsumexp, cummax, cummin.

A scan mixes the elements of its dim only, so shards of every other dim pass
through and the op runs on the local pieces with no communication. A
``Partial("sum")`` input stays partial through ``cumsum`` (a running sum of
terms is the term of the running sums); every other partial is reduced first.

A sharded scan dim is not gathered for the three scans with an associative
combine (see [Note: sharded scans]); ``cummax`` / ``cummin`` gather that mesh
dim only (their indices would need a second exchange for ties), as torch does.
"""

from __future__ import annotations

from collections.abc import Callable

import hp_core.collectives as hc
import torch
from hp_core.distributed import mesh_group

from hp_dtensor.layout import Layout
from hp_dtensor.ops.dispatch import Decision, LocalCall, OpCall, register
from hp_dtensor.placements import Partial, Placement, Replicate, Shard

__all__ = ["along_dims_placements"]

aten = torch.ops.aten


def along_dims_placements(
    layout: Layout, dims: list[int], linear: bool = False, keep_shards: bool = False
) -> tuple[Placement, ...]:
    """Placements for an op that mixes elements along ``dims`` only (scans, FFTs, softmax).

    Shards of other dims pass; shards of ``dims`` become ``Replicate()`` unless
    ``keep_shards``; ``Partial("sum"/"avg")`` passes when the op is ``linear``,
    every other partial is reduced.
    """
    out: list[Placement] = []
    for p in layout.placements:
        if isinstance(p, Shard):
            out.append(p if keep_shards or p.dim not in dims else Replicate())
        elif isinstance(p, Partial):
            out.append(p if linear and p.reduce_op in ("sum", "avg") else Replicate())
        else:
            out.append(p)
    return tuple(out)


def _combine_sum(previous: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    return previous + local


def _combine_prod(previous: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    return previous * local


def _combine_logsumexp(previous: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    return torch.logaddexp(previous, local)


# scan -> (fold of the earlier totals over dim 0, combine(prefix, local scan), identity)
_ASSOCIATIVE: dict[object, tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor], float]] = {
    aten.cumsum.default: (lambda t: t.sum(0), _combine_sum, 0.0),
    aten.cumprod.default: (lambda t: t.prod(0), _combine_prod, 1.0),
    aten.logcumsumexp.default: (lambda t: t.logsumexp(0), _combine_logsumexp, float("-inf")),
}


# [Note: sharded scans]
# With the scan dim cut over one mesh dim, rank ``r`` scans its own piece; the
# true scan is that local scan combined with the total of every earlier piece
# (sum for cumsum, product for cumprod, log-sum-exp for logcumsumexp). Each
# rank's total is the last slice of its local scan, so one ``all_gather`` of
# that slice (the size of the tensor with the scan dim taken as 1, per rank)
# gives every rank the totals of all pieces; rank ``r`` folds those of ranks
# ``< r`` and combines. An empty piece (uneven cut) offers the combine's
# identity. Communication is ``world`` slices instead of ``(world - 1) / world``
# of the tensor for gathering the dim; a dim shorter than two slices per rank,
# or cut over two mesh dims, is gathered instead.
def _prefix_kernel(mesh_dim: int) -> Callable[[LocalCall], torch.Tensor]:
    """See [Note: sharded scans]: local scan, one all_gather of each piece's total, combine."""

    def run(call: LocalCall) -> torch.Tensor:
        x = call.args[0]
        dim = int(call.args[1]) % max(x.dim(), 1)
        fold, combine, identity = _ASSOCIATIVE[call.func]
        local = call.func(*call.args, **call.kwargs)
        if local.dim() == 0:
            local = local.reshape(1)
        if local.shape[dim] > 0:
            last = local.narrow(dim, local.shape[dim] - 1, 1).contiguous()
        else:
            shape = list(local.shape)
            shape[dim] = 1
            last = local.new_full(shape, identity)
        layout = call.layout(0)
        group = mesh_group(layout.mesh, mesh_dim)
        world = layout.mesh.shape[mesh_dim]
        gathered = last.new_empty((world, *last.shape))
        hc.all_gather_into_tensor(gathered, last, group)
        me = layout.my_coordinate()[mesh_dim]
        if me > 0:
            local = combine(fold(gathered[:me]), local)
        return local.reshape(call.args[0].shape) if call.args[0].dim() == 0 else local

    return run


@register(
    aten.cumsum.default,
    aten.cumprod.default,
    aten.logcumsumexp.default,
    aten.cummax.default,
    aten.cummin.default,
)
def scan_rule(call: OpCall) -> Decision:
    """Shards of other dims pass; a sharded scan dim uses [Note: sharded scans] or is gathered."""
    position = call.position_of(call.args[0])
    layout = call.layout(position)
    dim = int(call.args[1]) % max(layout.ndim, 1)
    associative = call.func in _ASSOCIATIVE
    cutters = [m for m, p in enumerate(layout.placements) if isinstance(p, Shard) and p.dim == dim]
    # The prefix exchange sends one slice per rank: worth it once the pieces are 2+ slices long.
    prefix = (
        associative
        and len(cutters) == 1
        and layout.ndim > 0
        and layout.shape[dim] >= 2 * layout.mesh.shape[cutters[0]]
    )
    target = along_dims_placements(layout, [dim], linear=call.func is aten.cumsum.default, keep_shards=prefix)
    kernel = _prefix_kernel(cutters[0]) if prefix else None
    outputs: list[tuple[Placement, ...] | None] = [target] if associative else [target, target]
    return Decision(inputs={position: target}, outputs=outputs, kernel=kernel)
