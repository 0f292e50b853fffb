"""``embedding_bag`` (``_embedding_bag`` and its backward ops) on a table cut by columns or by rows.

A column cut gives each rank its columns of every bag ([Note: column-wise
bags]); a row (vocabulary) cut gives each rank the pooling of its rows,
combined across ranks without gathering the table ([Note: vocab-cut bags]).
The indices, offsets and per-sample weights are whole on every rank.
"""

from __future__ import annotations

import functools
from typing import Any

import hp_core.collectives as hc
import torch
from hp_core.distributed import mesh_group
from torch.utils.weak import WeakIdKeyDictionary

from hp_dtensor.layout import Layout
from hp_dtensor.ops.dispatch import Decision, LocalCall, OpCall, register
from hp_dtensor.placements import Partial, Placement, Replicate, Shard

__all__ = ["embedding_bag_backward_rule", "embedding_bag_rule"]

aten = torch.ops.aten
R = Replicate()
SUM = Partial("sum")
_SUM, _MEAN, _MAX = 0, 1, 2

# argument names by position, and the defaults of those that have one, per op
_FORWARD = (
    "weight",
    "indices",
    "offsets",
    "scale_grad_by_freq",
    "mode",
    "sparse",
    "per_sample_weights",
    "include_last_offset",
    "padding_idx",
)
_SAVED = ("offset2bag", "bag_size", "maximum_indices", "num_weights", "scale_grad_by_freq", "mode")
_BACKWARD = {
    aten._embedding_bag_backward.default: (
        "grad",
        "indices",
        "offsets",
        *_SAVED,
        "sparse",
        "per_sample_weights",
        "padding_idx",
    ),
    aten._embedding_bag_dense_backward.default: (
        "grad",
        "indices",
        *_SAVED,
        "per_sample_weights",
        "padding_idx",
    ),
}
_WEIGHTS_BACKWARD = ("grad", "weight", "indices", "offsets", "offset2bag", "mode", "padding_idx")
_DEFAULTS = {
    "scale_grad_by_freq": False,
    "mode": _SUM,
    "sparse": False,
    "per_sample_weights": None,
    "include_last_offset": False,
    "padding_idx": -1,
}


def _options(call: OpCall | LocalCall, names: tuple[str, ...]) -> dict[str, Any]:
    """The call's arguments by name, defaults filled in."""
    bound = {**_DEFAULTS, **dict(zip(names, call.args, strict=False))}
    bound.update(call.kwargs)
    return bound


# [Note: column-wise bags]
# ``_embedding_bag(weight, indices, offsets, ..., mode, ...)`` pools the
# rows of each bag (sum, mean or max), column by column, so a table cut on
# its columns gives each rank its columns of every bag, with no
# communication: the pooled output (and, for ``max``, the ``(bags, dim)``
# arg-max indices) keep the column cut; ``offset2bag`` and ``bag_size`` are
# the same on every rank. The table's gradient keeps the cut too, and the
# per-sample weights' gradient (a dot product over the columns) is a partial
# sum.
#
# The dispatcher shapes outputs by the op's meta kernel, and for ``sum`` /
# ``mean`` the CPU kernel returns two auxiliary outputs in other shapes: an
# empty ``offset2bag`` for ``sum`` (the meta kernel: one bag index per
# index) and a ``(bags,)`` ``max_indices`` (the meta kernel: empty); with
# ``include_last_offset`` its ``bag_size`` has one entry per bag where the
# meta kernel's has one per offset. The kernel below returns them in the
# meta shapes: the bag of each index (what the backward otherwise rebuilds
# from the offsets when it finds ``offset2bag`` empty), an empty
# ``max_indices``, which only ``max`` reads, and ``bag_size`` padded with a
# zero, which the backward reads only at the bags' indices.
def _meta_shaped(
    outputs: tuple[torch.Tensor, ...], indices: torch.Tensor, offsets: torch.Tensor, mode: int
) -> tuple[torch.Tensor, ...]:
    """The op's outputs with its auxiliary ones in the meta kernel's shapes ([Note: column-wise bags])."""
    output, offset2bag, bag_size, max_indices = outputs
    if bag_size.numel() < offsets.numel():  # include_last_offset: the meta kernel counts every offset
        bag_size = torch.cat([bag_size, bag_size.new_zeros(offsets.numel() - bag_size.numel())])
    if offset2bag.numel() == 0 and indices.numel() > 0:
        positions = torch.arange(indices.numel(), device=indices.device, dtype=offsets.dtype)
        offset2bag = torch.searchsorted(offsets, positions, right=True) - 1
    if mode != _MAX:
        max_indices = max_indices.new_empty(0)
    return output, offset2bag, bag_size, max_indices


def _bag_kernel(call: LocalCall) -> tuple[torch.Tensor, ...]:
    """The op on this rank's columns ([Note: column-wise bags])."""
    options = _options(call, _FORWARD)
    return _meta_shaped(
        call.func(*call.args, **call.kwargs), options["indices"], options["offsets"], options["mode"]
    )


# [Note: vocab-cut bags]
# A rank holding rows ``[lo, hi)`` of the table pools only the ids in that
# range (shifted by ``lo``; padding and the other ids weigh nothing), with
# the indices and offsets whole. For ``sum`` that is a partial sum of the
# bags: ``Partial("sum")``, no communication. ``mean`` is the same sum
# divided by the bag's whole count of ids (torch's ``bag_size``, the same on
# every rank), still a partial sum. ``max`` is not a sum: each rank takes, per
# bag and column, its largest value and the first position in the bag that
# holds it; one all-gather of those (two numbers per bag and column, exact in
# float64) lets every rank pick the largest value and, among equal values,
# the first position, as one process does; the output is replicated, and so
# are the arg-max ids (``indices`` at the winning positions). A bag with no
# id to pool (empty, or padding only) gives zeros and arg-max 0, as torch's
# kernel does. ``offset2bag`` and ``bag_size`` are computed from the indices
# and offsets alone, the same on every rank, in the meta kernel's shapes.
#
# The backward ops do not see the table. As for the row-wise embedding
# ([Note: row-wise backward] in :mod:`hp_dtensor.ops.embedding`), the forward
# records the table's layout against the ``offset2bag`` it returns (weakly,
# by identity: autograd hands that very tensor to the backward), and the
# backward rule (``cached=False``) computes only this rank's rows from it:
# each id's bag gradient, weighted as the forward weighed it, added to its
# row; for ``max`` each column's gradient goes to the recorded arg-max row
# when this rank holds it. The per-sample weights' gradient (a dot product
# of the bag's gradient with the id's row) sees the table, and is a partial
# sum over the rows. ``sparse=True`` and ``scale_grad_by_freq`` (whose CPU
# backward scales by counts this plan would not reproduce) gather the table
# as before.
_VOCAB_TABLES: Any = WeakIdKeyDictionary()  # offset2bag (local tensor) -> the vocab-cut table's layout


def _vocab_ok(options: dict[str, Any]) -> bool:
    """Whether this call takes [Note: vocab-cut bags]."""
    return not options["sparse"] and not options["scale_grad_by_freq"]


def _local_ids(
    indices: torch.Tensor, padding_idx: int, low: int, rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(whether each id is pooled here, its row in this rank's piece or 0)."""
    keep = (indices >= low) & (indices < low + rows)
    if padding_idx >= 0:
        keep &= indices != padding_idx
    return keep, torch.where(keep, indices - low, torch.zeros_like(indices))


def _vocab_groups(layout: Layout) -> list[tuple[Any, int]]:
    """(process group, size) of each mesh dim cutting the table's rows."""
    return [
        (mesh_group(layout.mesh, m), layout.mesh.size(m))
        for m, p in enumerate(layout.placements)
        if p == Shard(0)
    ]


def _bags(
    indices: torch.Tensor, offsets: torch.Tensor, include_last_offset: bool, padding_idx: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``offset2bag`` (each id's bag) and ``bag_size`` (each bag's ids, padding not counted), meta-shaped.

    The meta kernel's ``bag_size`` has one entry per offset, the last offset
    included (the CPU kernel's has one per bag): the extra entry is 0.
    """
    positions = torch.arange(indices.numel(), device=indices.device, dtype=offsets.dtype)
    offset2bag = (torch.searchsorted(offsets, positions, right=True) - 1).to(indices.dtype)
    counted = offset2bag if padding_idx < 0 else offset2bag[indices != padding_idx]
    # every id's bag is below the bag count, so an entry for the last offset stays 0
    bag_size = torch.bincount(counted.long(), minlength=offsets.numel())[: offsets.numel()]
    return offset2bag, bag_size.to(indices.dtype)


def _vocab_kernel(call: LocalCall) -> tuple[torch.Tensor, ...]:
    """See [Note: vocab-cut bags]."""
    o = _options(call, _FORWARD)
    table, indices, offsets, mode = o["weight"], o["indices"], o["offsets"], o["mode"]
    layout = call.layout(0)
    offset2bag, bag_size = _bags(indices, offsets, o["include_last_offset"], o["padding_idx"])
    bags = offsets.numel() - 1 if o["include_last_offset"] else offsets.numel()
    low, rows = layout.local_offset()[0], table.shape[0]
    keep, local = _local_ids(indices, o["padding_idx"], low, rows)
    if mode == _MAX:
        output, max_indices = _vocab_max(table, indices, local, keep, offset2bag, bags, _vocab_groups(layout))
    else:
        weights = keep.to(table.dtype)
        if o["per_sample_weights"] is not None:
            weights = weights * o["per_sample_weights"]
        if rows == 0:
            output = table.new_zeros((bags, table.shape[1]))
        else:
            pooled = aten._embedding_bag.default(
                table, local, offsets, False, _SUM, False, weights, o["include_last_offset"], -1
            )
            output = pooled[0]
        if mode == _MEAN:
            output = output / bag_size[:bags].clamp(min=1).unsqueeze(1).to(output.dtype)
        max_indices = indices.new_empty(0)
    _VOCAB_TABLES[offset2bag] = layout
    return output, offset2bag, bag_size, max_indices


def _vocab_max(
    table: torch.Tensor,
    indices: torch.Tensor,
    local: torch.Tensor,
    keep: torch.Tensor,
    offset2bag: torch.Tensor,
    bags: int,
    groups: list[tuple[Any, int]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each bag's largest value per column over all ranks' rows, and its first id ([Note: vocab-cut bags])."""
    count, width = indices.numel(), table.shape[1]
    values = table.index_select(0, local) if table.shape[0] else table.new_zeros((count, width))
    values = values.masked_fill(~keep.unsqueeze(1), -torch.inf)
    target = offset2bag.long().unsqueeze(1).expand(count, width)
    best = values.new_full((bags, width), -torch.inf).scatter_reduce(0, target, values, "amax")
    holds = keep.unsqueeze(1) & (values == best.gather(0, target))
    position = torch.arange(count, device=values.device).unsqueeze(1).expand(count, width)
    first = torch.where(holds, position, count)
    first = position.new_full((bags, width), count).scatter_reduce(0, target, first, "amin")
    best, first = best.to(torch.float64), first.to(torch.float64)  # the exchange: both exact in float64
    for group, size in groups:
        mine = torch.stack([best, first]).contiguous()
        gathered = mine.new_empty((size * 2, bags, width))
        hc.all_gather_into_tensor(gathered, mine, group)
        bests, firsts = gathered.view(-1, 2, bags, width).unbind(1)
        best = bests.max(0).values
        first = torch.where(bests == best, firsts, float(count)).min(0).values
    found = first < count
    output = torch.where(found, best, 0.0).to(table.dtype)
    picked = first.clamp(max=max(count - 1, 0)).long()
    ids = indices[picked] if count else torch.zeros_like(picked, dtype=indices.dtype)
    return output, torch.where(found, ids, torch.zeros_like(ids))


def _cuts(layout: Layout, vocab: bool) -> tuple[Placement, ...]:
    """The table's kept cut per mesh dim: columns always, rows when [Note: vocab-cut bags] applies."""
    return tuple(p if p == Shard(1) or (vocab and p == Shard(0)) else R for p in layout.placements)


def _columns(cut: tuple[Placement, ...]) -> tuple[Placement, ...]:
    """A ``(bags, dim)`` tensor of this table: cut where the table's columns are."""
    return tuple(Shard(1) if p == Shard(1) else R for p in cut)


@register(aten._embedding_bag.default, aten._embedding_bag_forward_only.default)
def embedding_bag_rule(call: OpCall) -> Decision:
    """Column cuts pass to the pooled output; row cuts pool locally ([Note: vocab-cut bags])."""
    o = _options(call, _FORWARD)
    w_pos = call.position_of(o["weight"])
    cut = _cuts(call.layout(w_pos), _vocab_ok(o))
    whole: tuple[Placement, ...] = (R,) * len(cut)
    inputs = {p: whole for p in call.positions}
    inputs[w_pos] = cut
    rows = SUM if o["mode"] != _MAX else R
    pooled = tuple(rows if p == Shard(0) else p for p in cut)
    max_indices = _columns(cut) if o["mode"] == _MAX else whole
    kernel = _vocab_kernel if Shard(0) in cut else _bag_kernel
    return Decision(inputs=inputs, outputs=[pooled, whole, whole, max_indices], kernel=kernel)


def _vocab_backward_kernel(table: Layout, call: LocalCall) -> torch.Tensor:
    """This rank's rows of the table's gradient ([Note: vocab-cut bags])."""
    o = _options(call, _BACKWARD[call.func])
    grad, indices, offset2bag, bag_size, mode = (
        o["grad"],
        o["indices"],
        o["offset2bag"],
        o["bag_size"],
        o["mode"],
    )
    low, rows = table.local_offset()[0], table.local_shape()[0]
    result = grad.new_zeros((rows, grad.shape[1]))
    if mode == _MAX:
        arg_max = o["maximum_indices"]
        filled = bag_size[: arg_max.shape[0]] > 0
        mine = filled.unsqueeze(1) & (arg_max >= low) & (arg_max < low + rows)
        columns = torch.arange(grad.shape[1], device=grad.device).expand_as(arg_max)
        result.index_put_((arg_max[mine] - low, columns[mine]), grad[mine], accumulate=True)
        return result
    keep, local = _local_ids(indices, o["padding_idx"], low, rows)
    weights = keep.to(grad.dtype)
    if o["per_sample_weights"] is not None:
        weights = weights * o["per_sample_weights"]
    if mode == _MEAN:
        weights = weights / bag_size.index_select(0, offset2bag).clamp(min=1).to(grad.dtype)
    contributions = grad.index_select(0, offset2bag) * weights.unsqueeze(1)
    return result.index_add_(0, local[keep], contributions[keep])


def _recorded_table(call: OpCall) -> Layout | None:
    """The vocab-cut table the forward recorded for this call's ``offset2bag`` ([Note: vocab-cut bags])."""
    o = _options(call, _BACKWARD[call.func])
    offset2bag = o["offset2bag"]
    table = _VOCAB_TABLES.get(getattr(offset2bag, "_local", offset2bag))
    grad = call.layout(call.position_of(o["grad"]))
    if table is None or table.mesh is not grad.mesh or o.get("sparse"):
        return None
    return table


@register(*_BACKWARD, cached=False)
def embedding_bag_backward_rule(call: OpCall) -> Decision:
    """Column cuts of the gradient stay; a recorded row cut gives the rank's rows ([Note: vocab-cut bags])."""
    grad = call.layout(call.position_of(call.args[0]))
    # the gradient and max mode's arg-max indices have the column dim
    columns = [p for p in call.positions if call.layout(p).shape[1:] == grad.shape[1:]]
    table = _recorded_table(call)
    if table is not None:
        cut = _cuts(table, vocab=True)
    else:
        cut = tuple(
            Shard(1) if any(call.layout(p).placements[m] == Shard(1) for p in columns) else R
            for m in range(grad.mesh.ndim)
        )
    whole: tuple[Placement, ...] = (R,) * len(cut)
    inputs = {p: _columns(cut) if p in columns else whole for p in call.positions}
    kernel = functools.partial(_vocab_backward_kernel, table) if table is not None else None
    return Decision(inputs=inputs, outputs=[cut], kernel=kernel)


def _weights_backward_kernel(call: LocalCall) -> torch.Tensor:
    """Each id's dot product with this rank's row of it, zero for rows elsewhere ([Note: vocab-cut bags])."""
    o = _options(call, _WEIGHTS_BACKWARD)
    table, indices = o["weight"], o["indices"]
    low = call.layout(1).local_offset()[0]
    keep, local = _local_ids(indices, o["padding_idx"], low, table.shape[0])
    if table.shape[0] == 0:
        return o["grad"].new_zeros(indices.shape)
    grads = call.func(o["grad"], table, local, o["offsets"], o["offset2bag"], o["mode"], -1)
    return grads * keep.to(grads.dtype)


@register(aten._embedding_bag_per_sample_weights_backward.default)
def embedding_bag_weights_backward_rule(call: OpCall) -> Decision:
    """A partial sum over the table's cut, columns or rows."""
    w_pos = call.position_of(call.args[1])
    cut = _cuts(call.layout(w_pos), vocab=True)
    whole: tuple[Placement, ...] = (R,) * len(cut)
    inputs = {p: whole for p in call.positions}
    inputs[w_pos] = cut
    inputs[call.position_of(call.args[0])] = _columns(cut)
    output = tuple(SUM if p != R else R for p in cut)
    kernel = _weights_backward_kernel if Shard(0) in cut else None
    return Decision(inputs=inputs, outputs=[output], kernel=kernel)
