"""Advanced indexing: ``x[idx]`` (``aten.index.Tensor``) and ``x[idx] = v`` (``index_put``).

Per mesh dim the placement of ``x`` and of the indices decides who reads or
writes what ([Note: placements of advanced indexing]); the cheapest
applicable option wins and the last resort gathers that mesh dim only. A
boolean-mask write whose values do not depend on the number of selected
elements is a ``where`` and moves nothing ([Note: boolean-mask writes as
where]); a boolean-mask read has a data-dependent shape and stays on the
replicated fallback.
"""

from __future__ import annotations

import math

import torch

from hp_dtensor.layout import Layout
from hp_dtensor.ops.dispatch import Decision, LocalCall, OpCall, register
from hp_dtensor.ops.indexing import cheapest, functional_of, is_inplace, masked_positions, spare_slot_write
from hp_dtensor.placements import Partial, Placement, Replicate, Shard

__all__ = ["index_put_rule", "index_rule"]

aten = torch.ops.aten
R = Replicate()
SUM = Partial("sum")


# [Note: placements of advanced indexing]
# ``indices`` holds one entry per leading dim of ``x``: an integer tensor or
# None (``:``). The integer tensors broadcast to one shape B; the result has
# B in place of the indexed dims when those are consecutive, else B first,
# then the dims that were not indexed. Per mesh dim, by the placement of ``x``:
#
# =============  ======================  ===============  =======================================
# ``x``          indices (values)        output           how
# =============  ======================  ===============  =======================================
# S(d), d free   R (values cut on d)     S(d's place)     each rank its slice
# S(d) indexed   R (values R)            S(d) (writes)    [Note: masked writes] in ``indexing``
# R              S on a dim of B         S(B's dim)       reads: each rank its indices
# R              S on a dim of B         P(sum)           accumulating writes (the backward of a
#                                                         read with a sharded index)
# P(op)          R                       P(op)            reads of each term; P(sum) for
#                                                         accumulating writes with values P(sum)
# =============  ======================  ===============  =======================================
#
# The cheapest applicable row wins (``indexing.cheapest``); the last resort
# gathers that mesh dim only.
class _Indexing:
    """Where each dim of ``x`` lands in the result of ``x[indices]``."""

    def __init__(self, call: OpCall, x: Layout) -> None:
        from hp_dtensor.dtensor import DTensor

        self.entries = list(call.args[1])
        self.indexed = [d for d, t in enumerate(self.entries) if t is not None]
        self.tensors = [t for t in self.entries if t is not None]
        self.positions = [call.position_of(t) if isinstance(t, DTensor) else None for t in self.tensors]
        self.layouts = [call.layout(p) if p is not None else None for p in self.positions]
        shapes = [tuple(t.shape) for t in self.tensors]
        self.broadcast = tuple(torch.broadcast_shapes(*shapes)) if shapes else ()
        self.boolean = any(t.dtype in (torch.bool, torch.uint8) for t in self.tensors)
        consecutive = all(b - a == 1 for a, b in zip(self.indexed, self.indexed[1:], strict=False))
        self.insert = self.indexed[0] if consecutive and self.indexed else 0
        self.ndim = x.ndim

    def out_dim(self, d: int) -> int:
        """The result dim of a dim of ``x`` that is not indexed."""
        if d < self.insert:
            return d
        return d - sum(1 for i in self.indexed if i < d) + len(self.broadcast)

    def result_ndim(self) -> int:
        return self.ndim - len(self.indexed) + len(self.broadcast)

    def cuts(self, b: int) -> list[Placement]:
        """Each index tensor's placement when B is cut on its dim ``b``."""
        out: list[Placement] = []
        for tensor in self.tensors:
            own = b - (len(self.broadcast) - tensor.dim())
            out.append(Shard(own) if own >= 0 and tensor.shape[own] > 1 else R)
        return out


def _index_options(ix: _Indexing, px: Placement, pis: list[Placement]) -> list[tuple[Placement, ...]]:
    """(x, *indices, output) candidates for one mesh dim of a read."""
    none = [R] * len(ix.tensors)
    options: list[tuple[Placement, ...]] = []
    for d in range(ix.ndim):
        if d not in ix.indexed:
            options.append((Shard(d), *none, Shard(ix.out_dim(d))))
    for b in range(len(ix.broadcast)):
        if ix.broadcast[b] > 1:
            options.append((R, *ix.cuts(b), Shard(ix.insert + b)))
    if isinstance(px, Partial):
        options.append((px, *none, px))
    options.append((R, *none, R))
    return options


@register(aten.index.Tensor)
def index_rule(call: OpCall) -> Decision | None:
    """``x[indices]`` (the table in the module docstring); boolean masks take the fallback."""
    x = call.layout(call.positions[0])
    ix = _Indexing(call, x)
    if ix.boolean or not ix.tensors:
        return None
    sizes = [math.prod(x.shape), *(math.prod(tuple(t.shape)) for t in ix.tensors)]
    xs: list[Placement] = []
    per_index: list[list[Placement]] = [[] for _ in ix.tensors]
    out: list[Placement] = []
    for m in range(x.mesh.ndim):
        px = x.placements[m]
        pis = [lay.placements[m] if lay is not None else R for lay in ix.layouts]
        best = cheapest(_index_options(ix, px, pis), (px, *pis), sizes)
        xs.append(best[0])
        for k in range(len(ix.tensors)):
            per_index[k].append(best[1 + k])
        out.append(best[-1])
    inputs = {call.positions[0]: tuple(xs)}
    for position, placements in zip(ix.positions, per_index, strict=True):
        if position is not None:
            inputs[position] = tuple(placements)
    return Decision(inputs=inputs, outputs=[tuple(out)])


def _values_dim(ix: _Indexing, result_dim: int, values: Layout | None) -> Placement:
    """The placement of ``values`` that lines it up with a cut of result dim ``result_dim``."""
    if values is None:
        return R
    own = result_dim - (ix.result_ndim() - values.ndim)
    return Shard(own) if own >= 0 and values.shape[own] > 1 else R


# [Note: boolean-mask writes as where]
# A boolean mask whose values do not depend on
# the number of selected elements (``x[x > 0] = v`` with one value, or
# ``x[row_mask] = row`` with values along the dims after the mask) is a
# ``where``: the mask is cut like ``x``, the values like the dims after the
# mask, and nothing moves. A read with a boolean mask has a data-dependent shape and
# stays on the replicated fallback.
def _mask_values_fit(ix: _Indexing, value_shape: tuple[int, ...]) -> bool:
    """Whether ``x[mask] = values`` is a ``where``: values do not depend on how many elements are selected.

    ``x[mask]`` has one dim for the selected elements, then the dims after the
    mask; values broadcast to it from the right. A single value, or values
    with no more dims than those after the mask, are the same for every
    selected element (``x[rows] = row_values``), so each rank writes its own
    piece; values with one entry per selected element need the whole mask.
    """
    after = ix.ndim - ix.indexed[0] - ix.tensors[0].dim()
    return math.prod(value_shape) == 1 or len(value_shape) <= after


def _masked_put_kernel(call: LocalCall) -> torch.Tensor:
    """``index_put`` of this rank's positions only, on every sharded indexed dim (spare slots)."""
    x = call.args[0]
    layout = call.layout(0)
    entries = list(call.args[1])
    offsets = layout.local_offset()
    dims = [
        d
        for d, t in enumerate(entries)
        if t is not None and any(isinstance(p, Shard) and p.dim == d for p in layout.placements)
    ]
    for d in dims:
        entries[d] = masked_positions(entries[d], offsets[d], x.shape[d], layout.shape[d], wrap=True)
    functional = functional_of(call.func)
    if functional is aten._index_put_impl_.default:
        functional = aten.index_put.default
    rest = call.args[2:]
    out = spare_slot_write(x, dims, lambda padded: functional(padded, entries, *rest, **call.kwargs))
    if is_inplace(call.func):
        return x.copy_(out)
    return out


@register(aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default)
def index_put_rule(call: OpCall) -> Decision | None:
    """``x[indices] = values`` (``accumulate=True``: ``+=``); the table in the module docstring."""
    from hp_dtensor.dtensor import DTensor

    x = call.layout(call.positions[0])
    ix = _Indexing(call, x)
    value_arg = call.args[2]
    vpos = call.position_of(value_arg) if isinstance(value_arg, DTensor) else None
    values = call.layout(vpos) if vpos is not None else None
    accumulate = bool(call.args[3]) if len(call.args) > 3 else bool(call.kwargs.get("accumulate", False))
    inplace = is_inplace(call.func)
    if not ix.tensors:
        return None
    value_shape = tuple(value_arg.shape) if isinstance(value_arg, torch.Tensor) else ()
    mask_like = ix.boolean and len(ix.tensors) == 1 and _mask_values_fit(ix, value_shape)
    if ix.boolean and not mask_like:
        ix.tensors = []  # a mask with one value per selected element: every mesh dim gathered below
    none = [R] * len(ix.tensors)
    sizes = [
        math.prod(x.shape),
        *(math.prod(tuple(t.shape)) for t in ix.tensors),
        math.prod(values.shape) if values else 0,
    ]
    xs: list[Placement] = []
    per_index: list[list[Placement]] = [[] for _ in ix.tensors]
    vs: list[Placement] = []
    masked = False
    for m in range(x.mesh.ndim):
        px = x.placements[m]
        pis = [lay.placements[m] if lay is not None else R for lay in ix.layouts[: len(ix.tensors)]]
        pv = values.placements[m] if values is not None else R
        options: list[tuple[Placement, ...]] = []
        if ix.boolean and not mask_like:
            options = []
        elif mask_like:
            start = ix.indexed[0]
            span = ix.tensors[0].dim()
            for d in range(x.ndim):
                inside = start <= d < start + span
                cut = Shard(d - start) if inside else R
                own = d - (x.ndim - len(value_shape))  # the values' dim lined up with d, if any
                value_cut: Placement = Shard(own) if not inside and own >= 0 and value_shape[own] > 1 else R
                if value_cut != R and values is None:
                    continue  # a plain values tensor cannot be cut
                options.append((Shard(d), cut, value_cut, Shard(d)))
        else:
            for d in range(x.ndim):
                if d not in ix.indexed:
                    options.append((Shard(d), *none, _values_dim(ix, ix.out_dim(d), values), Shard(d)))
                elif px == Shard(d):
                    options.append((px, *none, R, px))
            if accumulate and not inplace:
                for b in range(len(ix.broadcast)):
                    if ix.broadcast[b] > 1:
                        options.append((SUM, *ix.cuts(b), _values_dim(ix, ix.insert + b, values), SUM))
            if accumulate and px == SUM:
                options.append((SUM, *none, SUM if values is not None else R, SUM))
        options.append((R, *none, R, R))
        best = cheapest(options, (px, *pis, pv), sizes)
        masked = masked or (not mask_like and isinstance(best[0], Shard) and best[0].dim in ix.indexed)
        xs.append(best[0])
        for k in range(len(ix.tensors)):
            per_index[k].append(best[1 + k])
        vs.append(best[-2])
    inputs = {call.positions[0]: tuple(xs)}
    for k, position in enumerate(ix.positions):
        if position is not None:
            inputs[position] = tuple(per_index[k]) if k < len(ix.tensors) else (R,) * x.mesh.ndim
    if vpos is not None:
        inputs[vpos] = tuple(vs)
    return Decision(
        inputs=inputs,
        outputs=[tuple(xs)],
        inplace=inplace,
        kernel=_masked_put_kernel if masked else None,
    )
