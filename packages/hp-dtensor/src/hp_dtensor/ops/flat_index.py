"""``take`` and ``put`` / ``put_``: indexing into the flattened tensor, on a cut tensor.

See [Note: flat index plans].
"""

from __future__ import annotations

import functools
import math

import torch

from hp_dtensor.layout import Layout
from hp_dtensor.ops.dispatch import Decision, LocalCall, OpCall, register
from hp_dtensor.placements import Partial, Placement, Replicate, Shard

__all__ = ["put_rule", "take_rule"]


# [Note: flat index plans]
# Both read ``index`` as positions in ``x.flatten()`` (negative ones count
# from the end). A rank holding a piece of ``x`` owns the positions whose
# multi-index falls inside its piece, wherever the cut is (any dim, uneven
# pieces, several mesh dims): it unravels each position against the global
# shape, tests it against its piece's start and size, and ravels the local
# multi-index against its piece's shape ([Note: owned positions]). So, with
# the index (and ``put``'s source) whole:
#
# * ``take`` reads its owned positions and writes zeros elsewhere: the ranks'
#   results sum to the answer, ``Partial("sum")`` with no communication (as
#   the row-wise embedding lookup);
# * ``put`` writes (or, with ``accumulate``, adds) the source values of its
#   owned positions into its piece: the result keeps ``x``'s cut.
#
# A cut index with ``x`` whole is local too: ``take``'s output has the
# index's shape and cut, and an accumulating ``put`` of a cut index and
# source is a partial sum ([Note: put partials]). Positions out of range raise, on every
# rank, as the op does. ``take``'s gradient is a ``put`` of zeros and
# ``put``'s a ``take``, so the backward is local as well. torch's DTensor
# gathers ``take`` (one all-gather) and has no rule for ``put``.

aten = torch.ops.aten
R = Replicate()


# [Note: owned positions]
# ``index`` is whole on every rank, so every rank checks the same positions
# and raises the same error for one out of range. A position ``i`` (after
# adding ``numel`` to a negative one) has the global multi-index
# ``unravel(i, shape)``; the rank owns it when, in every dim, ``start <= c
# < start + size`` for its piece, and then finds it at ``ravel(c - start,
# piece shape)`` in its piece. An empty piece owns nothing.
# [Note: range check without a host sync]
# Reading the index on the host to test its range waits, on an accelerator,
# for everything queued before it, on every call (and ``take``'s backward is a
# ``put``). On the CPU the read costs nothing, so there the check names the
# first bad position, as torch's CPU ``take`` does; elsewhere it is a
# device-side assert (``torch._assert_async``), as torch's own CUDA ``take``
# makes: the error surfaces at the program's next sync, without the value.
def _check_range(flat: torch.Tensor, numel: int, shape: tuple[int, ...]) -> None:
    """Raise unless each position is in ``[-numel, numel)`` ([Note: range check without a host sync])."""
    fix = f"use indices in [-{numel}, {numel})"
    if flat.device.type != "cpu":
        inside = ((flat < numel) & (flat >= -numel)).all()
        message = f"take/put: an index is out of range for a tensor of {numel} elements; {fix}"
        torch._assert_async(inside, message)
        return
    if flat.numel() and (bool((flat >= numel).any()) or bool((flat < -numel).any())):
        bad = flat[(flat >= numel) | (flat < -numel)][0].item()
        raise IndexError(
            f"take/put: index {bad} is out of range for a tensor of {numel} elements (shape {shape}); {fix}."
        )


def _owned(index: torch.Tensor, layout: Layout) -> tuple[torch.Tensor, torch.Tensor]:
    """(whether this rank owns each position, its flat position in the piece, 0 where not owned)."""
    numel = math.prod(layout.shape)
    flat = index.reshape(-1)
    _check_range(flat, numel, tuple(layout.shape))
    flat = torch.where(flat < 0, flat + numel, flat)
    start, sizes = layout.local_offset(), layout.local_shape()
    if not layout.shape:  # a 0-d tensor: position 0 is the value
        return torch.ones_like(flat, dtype=torch.bool), torch.zeros_like(flat)
    coords = torch.stack(torch.unravel_index(flat, tuple(layout.shape)), -1) if flat.numel() else None
    if coords is None:
        return torch.zeros_like(flat, dtype=torch.bool), flat
    low = torch.tensor(start, dtype=coords.dtype, device=coords.device)
    size = torch.tensor(sizes, dtype=coords.dtype, device=coords.device)
    local = coords - low
    inside = ((local >= 0) & (local < size)).all(-1)
    strides = [math.prod(sizes[d + 1 :]) for d in range(len(sizes))]
    position = (local * torch.tensor(strides, dtype=coords.dtype, device=coords.device)).sum(-1)
    return inside, torch.where(inside, position, torch.zeros_like(position))


def _take_kernel(call: LocalCall) -> torch.Tensor:
    """This rank's owned positions of ``x``, zeros elsewhere ([Note: owned positions])."""
    x, index = call.args[0], call.args[1]
    inside, position = _owned(index, call.layout(0))
    if x.numel() == 0:
        return x.new_zeros(index.shape)
    values = x.reshape(-1)[position]
    return torch.where(inside, values, torch.zeros_like(values)).reshape(index.shape)


def _put_kernel(summed: tuple[int, ...], call: LocalCall) -> torch.Tensor:
    """The source values of this rank's owned positions written into its piece ([Note: put partials])."""
    x, index, source = call.args[0], call.args[1], call.args[2]
    accumulate = bool(call.args[3]) if len(call.args) > 3 else bool(call.kwargs.get("accumulate", False))
    layout = call.layout(0)
    inside, position = _owned(index, layout)
    coord = layout.my_coordinate()
    if any(coord[m] != 0 for m in summed):  # one rank per summed line keeps x, the others add to zeros
        out = torch.zeros_like(x)
    else:
        out = x if call.func is aten.put_.default else x.clone()
    if x.numel() == 0:
        return out
    # No mask selection: its size depends on the data, a host sync on an accelerator
    # ([Note: range check without a host sync]). Positions this rank does not own add a zero
    # (-0.0 leaves every float as it is, -0.0 included) or write to a spare slot past the piece.
    values = source.reshape(-1)
    if accumulate:
        zero = torch.zeros_like(values)
        zero = zero.neg() if zero.is_floating_point() or zero.is_complex() else zero
        out.view(-1).index_put_((position,), torch.where(inside, values, zero), accumulate=True)
        return out
    n = out.numel()
    spare = torch.cat([out.reshape(-1), out.new_zeros(1)])
    spare.index_put_((torch.where(inside, position, torch.full_like(position, n)),), values)
    out.view(-1).copy_(spare[:n])
    return out


def _linear(p: Placement) -> bool:
    return isinstance(p, Partial) and p.reduce_op in ("sum", "avg")


@register(aten.take.default)
def take_rule(call: OpCall) -> Decision:
    """A cut ``x`` gives a partial sum; a cut index (``x`` whole) keeps its cut."""
    x_pos, i_pos = call.position_of(call.args[0]), call.position_of(call.args[1])
    x, index = call.layout(x_pos), call.layout(i_pos)
    rows: list[tuple[Placement, Placement, Placement]] = []  # per mesh dim: (x, index, output)
    for p, q in zip(x.placements, index.placements, strict=True):
        if isinstance(p, Shard):
            rows.append((p, R, Partial("sum")))
        elif isinstance(q, Shard):
            rows.append((R, q, q))
        elif _linear(p):
            rows.append((p, R, p))
        else:
            rows.append((R, R, R))
    xs, ids, out = (tuple(column) for column in zip(*rows, strict=True))
    cut = any(isinstance(p, Shard) for p in xs)
    return Decision(
        inputs={x_pos: xs, i_pos: ids},
        outputs=[out],
        kernel=_take_kernel if cut else None,
    )


# [Note: put partials]
# ``put(x, index, source, accumulate=True)`` adds each source value at its
# position. With the index and source cut alike on a mesh dim and ``x``
# whole there, each rank adds its own values: if one rank of the line (the
# first) starts from ``x`` and the others from zeros, the ranks' results sum
# to the answer, ``Partial("sum")`` with no communication (``x`` already a
# ``Partial("sum")`` keeps its terms). ``take``'s backward (a ``put`` of its
# gradient into zeros) with a cut index is this case. Without
# ``accumulate`` a later write replaces an earlier one, so the index and
# source are gathered instead; an in-place ``put_`` keeps its argument's
# layout, so it gathers them too.
@register(aten.put.default, aten.put_.default)
def put_rule(call: OpCall) -> Decision:
    """``x`` keeps its cut with the index and source whole; an accumulating put of cut values sums."""
    positions = [call.position_of(a) for a in call.args[:3]]
    x, index, source = (call.layout(p) for p in positions)
    inplace = call.func is aten.put_.default
    accumulate = bool(call.args[3]) if len(call.args) > 3 else bool(call.kwargs.get("accumulate", False))
    alike = index.shape == source.shape and accumulate and not inplace
    rows: list[tuple[Placement, ...]] = []  # per mesh dim: (x, index, source, output)
    summed: list[int] = []
    for m, (p, q, r) in enumerate(zip(x.placements, index.placements, source.placements, strict=True)):
        cut = q if isinstance(q, Shard) else r if isinstance(r, Shard) else None
        if isinstance(p, Shard):
            rows.append((p, R, R, p))
        elif alike and cut is not None:
            keeps = isinstance(p, Partial) and p.reduce_op == "sum"
            if not keeps:
                summed.append(m)
            rows.append((p if keeps else R, cut, cut, Partial("sum")))
        else:
            rows.append((R, R, R, R))
    xs, ids, src, out = (tuple(column) for column in zip(*rows, strict=True))
    local = any(isinstance(p, Shard) for p in xs) or any(isinstance(p, Shard) for p in ids)
    return Decision(
        inputs=dict(zip(positions, (xs, ids, src), strict=True)),
        outputs=[out],
        inplace=inplace,
        kernel=functools.partial(_put_kernel, tuple(summed)) if local else None,
    )
