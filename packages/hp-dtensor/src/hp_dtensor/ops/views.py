"""Shape ops: views, transposes, permutes, (un)squeeze, expand, split and cat.

These ops only relabel or regroup dims, so a shard survives when its dim
maps to an output dim whose pieces are the same elements: a transpose moves
``Shard(d)`` to the new position of ``d``; a view that merges or splits dims
keeps a shard on the outermost dim of a group only when the ``torch.chunk``
cut of the input dim and of the output dim select the same rows (checked
exactly, uneven sizes included). Otherwise that mesh dim is gathered first.
Partial and replicated values pass through every shape op.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from hp_dtensor.layout import Layout, chunk_sizes
from hp_dtensor.ops.dispatch import Decision, OpCall, register
from hp_dtensor.placements import Placement, Replicate, Shard

__all__ = ["view_groups"]

aten = torch.ops.aten


def _map_dims(call: OpCall, mapping: Sequence[int | None], out_ndim: int) -> Decision:
    """Shard(d) -> Shard(mapping[d]); a None entry means the dim cannot stay sharded."""
    position = call.positions[0]
    layout = call.layout(position)
    inputs: list[Placement] = []
    out: list[Placement] = []
    for placement in layout.placements:
        if isinstance(placement, Shard):
            target = mapping[placement.dim]
            if target is None:
                inputs.append(Replicate())
                out.append(Replicate())
            else:
                inputs.append(placement)
                out.append(Shard(target))
        else:
            inputs.append(placement)
            out.append(placement)
    return Decision(inputs={position: tuple(inputs)}, outputs=[tuple(out)])


@register(aten.t.default, aten.transpose.int)
def transpose_rule(call: OpCall) -> Decision:
    """Swap two dims; the shard follows its dim."""
    ndim = call.layout(call.positions[0]).ndim
    mapping: list[int | None] = list(range(ndim))
    if ndim == 0:  # t() and transpose(0, -1) of a 0-dim tensor return it as it is
        return _map_dims(call, mapping, ndim)
    if call.func is aten.t.default:
        d0, d1 = 0, min(1, ndim - 1)
    else:
        d0, d1 = int(call.args[1]) % ndim, int(call.args[2]) % ndim
    mapping[d0], mapping[d1] = d1, d0
    return _map_dims(call, mapping, ndim)


@register(aten.permute.default)
def permute_rule(call: OpCall) -> Decision:
    """Reorder dims; the shard follows its dim."""
    ndim = call.layout(call.positions[0]).ndim
    order = [int(d) % ndim for d in call.args[1]]
    mapping: list[int | None] = [0] * ndim
    for new, old in enumerate(order):
        mapping[old] = new
    return _map_dims(call, mapping, ndim)


@register(aten.unsqueeze.default)
def unsqueeze_rule(call: OpCall) -> Decision:
    """Insert a size-1 dim; later dims shift by one."""
    ndim = call.layout(call.positions[0]).ndim
    dim = int(call.args[1]) % (ndim + 1)
    return _map_dims(call, [d if d < dim else d + 1 for d in range(ndim)], ndim + 1)


@register(aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default)
def squeeze_rule(call: OpCall) -> Decision:
    """Drop the dims of global size 1.

    The local op is told exactly which dims: ``squeeze()`` on a piece would
    also drop a dim that is 1 only locally (a shard of 3 rows over 2 ranks
    leaves rank 1 one row), and ``squeeze(d)`` likewise.
    """
    layout = call.layout(call.positions[0])
    ndim = layout.ndim
    if call.func is aten.squeeze.default:
        drop = {d for d in range(ndim) if layout.shape[d] == 1}
    elif call.func is aten.squeeze.dim:
        drop = {int(call.args[1]) % max(ndim, 1)} if ndim else set()
    else:
        drop = {int(d) % max(ndim, 1) for d in call.args[1]} if ndim else set()
    drop = {d for d in drop if layout.shape[d] == 1}
    mapping: list[int | None] = []
    new = 0
    for d in range(ndim):
        if d in drop:
            mapping.append(None)
        else:
            mapping.append(new)
            new += 1
    decision = _map_dims(call, mapping, new)
    dims = tuple(sorted(drop))
    decision.kernel = lambda local: aten.squeeze.dims(local.args[0], dims)
    return decision


@register(aten.expand.default)
def expand_rule(call: OpCall) -> Decision:
    """Broadcast size-1 dims; existing dims keep their shard (an expanded dim had size 1, never cut)."""
    layout = call.layout(call.positions[0])
    sizes = list(call.args[1])
    lead = len(sizes) - layout.ndim
    mapping: list[int | None] = []
    for d in range(layout.ndim):
        expanded = layout.shape[d] == 1 and sizes[d + lead] not in (-1, 1)
        mapping.append(None if expanded else d + lead)
    decision = _map_dims(call, mapping, len(sizes))
    decision.size_arg = 1
    return decision


def view_groups(src: Sequence[int], dst: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """Pair up runs of input and output dims with equal products (size-1 dims join the next group)."""
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(src) or j < len(dst):
        gi: list[int] = []
        gj: list[int] = []
        pi = pj = 1
        while True:
            if pi == pj and (gi or gj) and (i >= len(src) or src[i] != 1) and (j >= len(dst) or dst[j] != 1):
                break
            if (pi <= pj or j >= len(dst)) and i < len(src):
                pi *= src[i]
                gi.append(i)
                i += 1
            elif j < len(dst):
                pj *= dst[j]
                gj.append(j)
                j += 1
            else:
                break
        groups.append((gi, gj))
    return groups


def _view_decision(call: OpCall, layout: Layout, out_shape: Sequence[int]) -> Decision:
    groups = view_groups(layout.shape, out_shape)
    mesh = layout.mesh
    inputs: list[Placement] = []
    out: list[Placement] = []
    for m, placement in enumerate(layout.placements):
        if not isinstance(placement, Shard):
            inputs.append(placement)
            out.append(placement)
            continue
        d = placement.dim
        keep: Placement = Replicate()
        shared = sum(1 for p in layout.placements if p == placement) > 1
        for gi, gj in groups:
            if d not in gi or shared:
                continue
            lead_in = [x for x in gi if layout.shape[x] != 1]
            lead_out = [x for x in gj if out_shape[x] != 1]
            if not lead_in or lead_in[0] != d or not lead_out:
                break
            o = lead_out[0]
            inner_in = math.prod(layout.shape[x] for x in gi if x > d)
            inner_out = math.prod(out_shape[x] for x in gj if x > o)
            n = mesh.shape[m]
            a = [s * inner_in for s in chunk_sizes(layout.shape[d], n)]
            b = [s * inner_out for s in chunk_sizes(out_shape[o], n)]
            if a == b:
                keep = Shard(o)
            break
        inputs.append(placement if isinstance(keep, Shard) else Replicate())
        out.append(keep)
    return Decision(inputs={call.positions[0]: tuple(inputs)}, outputs=[tuple(out)], size_arg=1)


def _infer(shape: Sequence[int], sizes: Sequence[int]) -> list[int]:
    sizes = [int(s) for s in sizes]
    if -1 in sizes:
        known = math.prod(s for s in sizes if s != -1)
        sizes[sizes.index(-1)] = math.prod(shape) // known if known else 0
    return sizes


@register(aten.view.default, aten._unsafe_view.default, aten.reshape.default)
def view_rule(call: OpCall) -> Decision:
    """Regroup dims; see the module docstring for when a shard survives."""
    layout = call.layout(call.positions[0])
    return _view_decision(call, layout, _infer(layout.shape, call.args[1]))


@register(aten.split.Tensor, aten.split_with_sizes.default)
def split_rule(call: OpCall) -> Decision:
    """Split along one dim: that dim must be whole; other shards carry over to every piece."""
    layout = call.layout(call.positions[0])
    dim = (int(call.args[2]) if len(call.args) > 2 else int(call.kwargs.get("dim", 0))) % layout.ndim
    inputs = tuple(Replicate() if p == Shard(dim) else p for p in layout.placements)
    if call.func is aten.split.Tensor:
        pieces = -(-layout.shape[dim] // int(call.args[1])) if layout.shape[dim] else 1
    else:
        pieces = len(call.args[1])
    return Decision(inputs={call.positions[0]: inputs}, outputs=[inputs] * max(pieces, 1))


@register(aten.cat.default)
def cat_rule(call: OpCall) -> Decision:
    """Concatenate along one dim: that dim must be whole; other dims follow the first input's cut."""
    tensors = [t for t in call.args[0]]
    dim = int(call.args[1]) if len(call.args) > 1 else int(call.kwargs.get("dim", 0))
    layouts = [call.layout(call.position_of(t)) for t in tensors]
    ref = next((lay for lay in layouts if lay.ndim > 1 or lay.shape != (0,)), layouts[0])
    dim %= ref.ndim
    target: list[Placement] = []
    for placement in ref.placements:
        if placement == Shard(dim) or not (isinstance(placement, (Shard, Replicate))):
            target.append(Replicate())
        else:
            target.append(placement)
    inputs = {
        call.position_of(t): tuple(target)
        for t, lay in zip(tensors, layouts, strict=True)
        if lay.ndim == ref.ndim
    }
    return Decision(inputs=inputs, outputs=[tuple(target)])


@register(aten.stack.default)
def stack_rule(call: OpCall) -> Decision:
    """Stack along a new dim: every input takes the first's cut of the existing dims, which keep it.

    Stacking moves no element across ranks: a shard of dim ``d`` stays a shard
    of the same rows, at ``d + 1`` when the new dim comes before it. Partial
    terms are summed first (as for ``cat``), so the output is whole there.
    """
    tensors = list(call.args[0])
    layouts = [call.layout(call.position_of(t)) for t in tensors]
    ref = layouts[0]
    dim = int(call.args[1]) if len(call.args) > 1 else int(call.kwargs.get("dim", 0))
    dim %= ref.ndim + 1
    target = tuple(p if isinstance(p, (Shard, Replicate)) else Replicate() for p in ref.placements)
    out = tuple(Shard(p.dim + (p.dim >= dim)) if isinstance(p, Shard) else p for p in target)
    return Decision(inputs={call.position_of(t): target for t in tensors}, outputs=[out])


@register(aten.slice.Tensor, aten.select.int, aten.narrow.default)
def slice_rule(call: OpCall) -> Decision:
    """Take part of one dim: that dim must be whole; other shards carry over (select drops the dim)."""
    layout = call.layout(call.positions[0])
    dim = (int(call.args[1]) if len(call.args) > 1 else int(call.kwargs.get("dim", 0))) % max(layout.ndim, 1)
    dropped = call.func is aten.select.int
    mapping: list[int | None] = []
    for d in range(layout.ndim):
        if d == dim:
            mapping.append(None)
        else:
            mapping.append(d - 1 if dropped and d > dim else d)
    return _map_dims(call, mapping, layout.ndim - (1 if dropped else 0))
