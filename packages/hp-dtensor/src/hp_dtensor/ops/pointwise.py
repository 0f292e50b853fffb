"""Pointwise ops, in-place pointwise ops, ``_foreach_*`` ops, ``*_like`` factories and RNG fills.

Pointwise ops (every aten op tagged ``pointwise``, found by tag on first
use) compute each element from the elements at the same index, so any shard
works as long as all inputs are cut the same way. Per mesh dim: if some input
is ``Shard(d)``, every input takes the same cut (a broadcast input that has
size 1 there, or lacks the dim, stays replicated); otherwise partial inputs
are reduced unless the op is linear in them (see [Note: linear partials]).
In-place ops keep their first argument's placements (see [Note: in-place
pointwise ops keep their placements]).
"""

from __future__ import annotations

from typing import Any

import torch

from hp_dtensor.dtensor import DTensor
from hp_dtensor.layout import Layout
from hp_dtensor.ops.dispatch import (
    LAYOUT_PRESERVING,
    RULES,
    SCALAR_BLIND,
    SPECIAL,
    Decision,
    LocalCall,
    OpCall,
    register,
)
from hp_dtensor.ops.random_agreement import ensure_rng_agreement
from hp_dtensor.ops.strided import elementwise
from hp_dtensor.placements import Partial, Placement, Replicate, Shard
from hp_dtensor.redistribute import slice_for_layout

__all__ = ["pointwise_rule", "resolve_by_tag"]

aten = torch.ops.aten

_LINEAR_UNARY = {
    aten.neg.default,
    aten.neg_.default,
    aten.clone.default,
    aten._to_copy.default,
    aten.mul.Scalar,
    aten.div.Scalar,
    aten.mul_.Scalar,
    aten.div_.Scalar,
    aten.zero_.default,
    aten.copy_.default,
}
_LINEAR_ADD = {aten.add.Tensor, aten.sub.Tensor, aten.add_.Tensor, aten.sub_.Tensor}
_LINEAR_MUL = {aten.mul.Tensor, aten.div.Tensor, aten.mul_.Tensor, aten.div_.Tensor}
_ZERO_FILLS = {aten.masked_fill.Scalar, aten.masked_fill_.Scalar}


# [Note: linear partials]
# A ``Partial(sum)`` value is a sum of terms, so ``f(sum x_r) = sum f(x_r)``
# only for linear ``f``: negation, scaling by a replicated value or scalar,
# casts, zeroing masked elements (``masked_fill(mask, 0)``, as cross-entropy's
# label smoothing does to ignored rows), and adding partials of the same op. A
# replicated (or plain) operand of an add or sub is made a partial of that op
# first, locally: for a sum one rank keeps the value and the others hold
# zeros, so ``partial + replicated`` costs no reduction (the mixed losses of
# label smoothing add a partial nll to a replicated smoothing term). A product
# or quotient of two partials reduces only the second factor (the divisor) and
# keeps the first one's terms: one reduction instead of two. Those
# keep the partial (and save a reduction); every other op reduces first. A
# number operand (``x + 1.0``, or a 0-d plain tensor) has no placement to make
# partial, so it reduces. Max/min partials are reduced before any pointwise op.
def _keeps_partial(
    func: Any,
    placements: list[Placement],
    first_partial: int,
    n_plain: int,
    n_scalar: int = 0,
    zero_fill: bool = False,
) -> bool:
    """Whether ``func`` is linear in its partial inputs on this mesh dim ([Note: linear partials])."""
    partials = [p for p in placements if isinstance(p, Partial)]
    op = partials[0]
    if not isinstance(op, Partial) or op.reduce_op not in ("sum", "avg") or any(p != op for p in partials):
        return False
    if func in _LINEAR_UNARY:
        # copy_ keeps its destination's terms only when the source holds terms of the same sum.
        return len(placements) == 1 or (func is aten.copy_.default and len(partials) == len(placements))
    if func in _LINEAR_ADD:
        # A number operand is a whole value with no placement: adding it to every rank's term
        # would count it once per rank. Replicated operands are made partial (see the note).
        others_whole = all(isinstance(p, (Partial, Replicate)) for p in placements)
        return others_whole and n_plain == 0 and n_scalar == 0
    if func in _LINEAR_MUL:
        # Linear in one factor: a second partial factor is reduced, the first keeps its terms
        # (a divisor never does: ``a / sum(b_r)`` is not ``sum(a / b_r)``).
        return func not in (aten.div.Tensor, aten.div_.Tensor) or first_partial == 0
    if func in _ZERO_FILLS:
        return zero_fill and len(partials) == 1 and first_partial == 0
    return False


# [Note: in-place pointwise ops keep their placements]
# In-place ops keep their first argument's placements (the optimizer's
# parameters stay sharded) and move the other arguments to match, which is how
# ``torch.optim.AdamW`` with ``foreach=True`` steps sharded parameters without
# gathering them: a partial gradient is reduced, a matching shard is used as is.
@elementwise
def pointwise_rule(call: OpCall, positions: list[int] | None = None, inplace: bool | None = None) -> Decision:
    """Placements for a pointwise op over the DTensors at ``positions`` (default: all of them)."""
    func = call.func
    positions = call.positions if positions is None else positions
    if inplace is None:
        inplace = torch.Tag.inplace in func.tags
    layouts = [call.layout(p) for p in positions]
    mesh = layouts[0].mesh
    if inplace:
        out_shape = layouts[0].shape
    else:
        out_shape = tuple(torch.broadcast_shapes(*(layout.shape for layout in layouts)))
    n_plain = sum(1 for v in call.flat if isinstance(v, torch.Tensor) and not isinstance(v, DTensor))
    # Positional numbers are operands (add(x, 1.0)); keyword numbers (alpha=) only scale one.
    n_scalar = sum(1 for v in call.args if isinstance(v, (int, float, complex)) and not isinstance(v, bool))
    zero_fill = func in _ZERO_FILLS and _arg(call, 2, "value", None) == 0  # the value is in the cache key
    out_ndim = len(out_shape)
    targets: list[list[Placement]] = [list(layout.placements) for layout in layouts]
    out: list[Placement] = []

    def aligned(layout: Layout, out_dim: int) -> int | None:
        dim = out_dim - (out_ndim - layout.ndim)
        # A dim of global size 1 (or 0) is cut like any other: pieces may be empty, and the op
        # maps an empty piece to an empty piece, so no rank needs another's elements.
        if dim < 0 or layout.shape[dim] != out_shape[out_dim]:
            return None
        return dim

    for m in range(mesh.ndim):
        current = [layout.placements[m] for layout in layouts]
        shard_out: int | None = None
        order = [0] if inplace else range(len(layouts))
        for i in order:
            placement = current[i]
            if isinstance(placement, Shard):
                candidate = placement.dim + out_ndim - layouts[i].ndim
                if aligned(layouts[i], candidate) is not None:
                    shard_out = candidate
                    break
        if inplace and not isinstance(current[0], (Shard, Partial)):
            shard_out = None
        if shard_out is not None:
            for i, layout in enumerate(layouts):
                dim = aligned(layout, shard_out)
                targets[i][m] = Shard(dim) if dim is not None else Replicate()
            out.append(Shard(shard_out))
            continue
        if any(isinstance(p, Partial) for p in current):
            first = next(i for i, p in enumerate(current) if isinstance(p, Partial))
            keep = _keeps_partial(func, current, first, n_plain, n_scalar, zero_fill)
            if inplace and not isinstance(current[0], Partial):
                keep = False
            if keep:
                # The partial terms are scaled by the other operands' values, which must be whole
                # here: a shard that set no output shard (an in-place op's other operand, a
                # broadcast dim) is gathered, or each term would meet only a piece of it.
                for i, placement in enumerate(current):
                    if isinstance(placement, Shard):
                        targets[i][m] = Replicate()
                    elif func in _LINEAR_ADD and isinstance(placement, Replicate):
                        targets[i][m] = current[first]  # a whole addend made terms: see the note
                    elif func in _LINEAR_MUL and isinstance(placement, Partial) and i != first:
                        targets[i][m] = Replicate()  # the other factor, whole: see the note
                out.append(current[first])
                continue
        for i in range(len(layouts)):
            targets[i][m] = Replicate()
        out.append(Replicate())
    inputs = {p: tuple(t) for p, t in zip(positions, targets, strict=True)}
    # Every tensor the op returns is cut like the inputs (frexp's mantissa and exponent).
    returns = sum(1 for r in call.func._schema.returns if r.type.isSubtypeOf(torch._C.TensorType.get()))
    return Decision(inputs=inputs, outputs=[tuple(out)] * max(returns, 1), inplace=inplace)


def _out_of_place_is_pointwise(func: Any) -> bool:
    """In-place ops (``masked_fill_``) are often tagged only ``inplace``: ask their out-of-place form."""
    if torch.Tag.inplace not in func.tags:
        return False
    packet_name = func.name().split("::")[-1].split(".")[0]
    if not packet_name.endswith("_"):
        return False
    packet = getattr(aten, packet_name[:-1], None)
    overload = getattr(packet, func._overloadname, None) if packet is not None else None
    return overload is not None and torch.Tag.pointwise in overload.tags


def resolve_by_tag(func: Any) -> Any:
    """Find a rule for an op not registered by name, from its tags (called once per op)."""
    packet = str(func).rsplit(".", 1)[0]
    # _foreach_norm and _foreach_max reduce (their rules are elsewhere); _foreach_maximum is pointwise.
    if packet.startswith("aten._foreach_") and packet not in ("aten._foreach_norm", "aten._foreach_max"):
        from hp_dtensor.ops.foreach import foreach_run

        SPECIAL[func] = lambda args, kwargs: foreach_run(func, args, kwargs)
        return SPECIAL[func]
    if torch.Tag.pointwise in func.tags or _out_of_place_is_pointwise(func):
        RULES[func] = pointwise_rule
        LAYOUT_PRESERVING.add(func)
        # pointwise_rule never reads a scalar's value; see [Note: scalar-blind ops] in ops.dispatch
        SCALAR_BLIND.add(func)
        return pointwise_rule
    if torch.Tag.nondeterministic_seeded in func.tags and torch.Tag.inplace in func.tags:
        SPECIAL[func] = lambda args, kwargs: _random_fill(func, args, kwargs)
        return SPECIAL[func]
    return None


register(aten.copy_.default, aten.fill_.Scalar, aten.fill_.Tensor, aten.zero_.default, keeps_layout=True)(
    elementwise(lambda call: pointwise_rule(call, inplace=True))
)
# The .Scalar forms are registered by name so their value is part of the decision's key (a fill
# with 0 keeps a partial, see [Note: linear partials]), which a rule found by tag would not be.
register(aten.masked_fill.Tensor, aten.masked_fill.Scalar, keeps_layout=True)(
    elementwise(lambda call: pointwise_rule(call, inplace=False))
)
register(aten.masked_fill_.Tensor, aten.masked_fill_.Scalar, keeps_layout=True)(
    elementwise(lambda call: pointwise_rule(call, inplace=True))
)
register(aten._to_copy.default, keeps_layout=True)(
    elementwise(lambda call: pointwise_rule(call, inplace=False))
)


@register(
    aten.empty_like.default,
    aten.zeros_like.default,
    aten.ones_like.default,
    aten.full_like.default,
    keeps_layout=True,
)
@elementwise
def like_rule(call: OpCall) -> Decision:
    """``*_like`` factories: the input's cut, no communication; partial inputs give replicated values."""
    layout = call.layout(call.positions[0])
    out = tuple(Replicate() if isinstance(p, Partial) else p for p in layout.placements)
    return Decision(outputs=[out])


@register(
    aten.new_empty.default,
    aten.new_zeros.default,
    aten.new_ones.default,
    aten.new_full.default,
    aten.new_empty_strided.default,
)
def new_factory_rule(call: OpCall) -> Decision:
    """``new_*`` factories: cut like ``self`` on the dims they share with it, else whole on every rank.

    A new tensor with ``self``'s number of dims takes ``self``'s shard of
    every dim whose size it shares (each rank builds only its piece, from the
    local size): as in torch's DTensor for a tensor of ``self``'s shape,
    which autograd fills at once with a cut source (``new_empty_strided``
    then ``copy_``, in the backward of ``matrix_exp`` and many others), where
    a replicated destination would gather that source. A constant may be cut
    any way, so a column of ones beside a cut matrix (``linalg.vander``'s
    ``cat``) is cut like it too. Other sizes, and a partial ``self``, give a
    replicated tensor built whole.
    """
    layout = call.layout(call.positions[0])
    whole = (Replicate(),) * layout.mesh.ndim
    size = _arg(call, 1, "size", None)
    if not isinstance(size, (list, tuple)) or len(size) != layout.ndim:
        return Decision(outputs=[whole])
    sizes = tuple(int(s) for s in size)
    out = tuple(
        p if isinstance(p, Shard) and sizes[p.dim] == layout.shape[p.dim] else Replicate()
        for p in layout.placements
    )
    if out == whole:
        return Decision(outputs=[whole])
    if call.func is aten.new_empty_strided.default:
        return Decision(outputs=[out], kernel=_new_empty_strided_piece(out))
    return Decision(outputs=[out], size_arg=1)


def _arg(call: OpCall, index: int, name: str, default: Any) -> Any:
    if len(call.args) > index:
        return call.args[index]
    return call.kwargs.get(name, default)


def _new_empty_strided_piece(placements: tuple[Placement, ...]) -> Any:
    """``new_empty_strided`` of this rank's piece: the local size, strides in the global dims' order."""

    def run(call: LocalCall) -> torch.Tensor:
        self, size, stride = call.args[:3]
        local = Layout(call.mesh, placements, tuple(size)).local_shape()
        order = sorted(range(len(local)), key=lambda d: (stride[d], local[d]))  # innermost first
        local_stride = [0] * len(local)
        step = 1
        for d in order:
            local_stride[d] = step
            step *= max(local[d], 1)
        return call.func(self, list(local), local_stride, *call.args[3:], **call.kwargs)

    return run


def _random_fill(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """In-place RNG fills (dropout's ``bernoulli_``): draw the full tensor, keep this rank's piece.

    Every rank draws the same full tensor from the same generator state, so
    the values equal a single process's draw on the global tensor, whatever
    the placements; the price is a full-size temporary.
    """
    target = args[0]
    layout: Layout = target._layout
    ensure_rng_agreement(layout.mesh, target._local.device, kwargs.get("generator"))  # [Note: RNG agreement]
    full = torch.empty(layout.shape, dtype=target.dtype, device=target._local.device)
    rest = tuple(a.full_tensor().detach() if isinstance(a, DTensor) else a for a in args[1:])
    func(full, *rest, **kwargs)
    target._local.copy_(slice_for_layout(full, layout))
    return target


# Elementwise ops that torch does not tag ``pointwise`` (so resolve_by_tag misses them): each output
# element reads the inputs' elements at its own (broadcast) index. prelu's kernel takes the weight
# already viewed to broadcast against the channel dim, so a cut channel dim cuts the weight alike;
# its backward returns the input's gradient and the weight's unreduced one, both of the broadcast
# shape (the sum to the weight's shape follows as its own op).
_UNTAGGED_POINTWISE = (
    aten.hardswish.default,
    aten.hardswish_backward.default,
    aten.floor_divide.default,
    aten.floor_divide.Scalar,
    aten.rsub.Tensor,
    aten._prelu_kernel.default,
    aten._prelu_kernel_backward.default,
    # activation backward ops (grad_output, self or result, scalars): the gradient at each element
    aten.hardsigmoid_backward.default,
    aten.hardtanh_backward.default,
    aten.mish_backward.default,
    aten.elu_backward.default,
    aten.leaky_relu_backward.default,
    aten.softplus_backward.default,
    aten.softshrink_backward.default,
    aten.hardshrink_backward.default,
)
register(*_UNTAGGED_POINTWISE)(elementwise(lambda call: pointwise_rule(call, inplace=False)))
register(aten.hardswish_.default, aten.floor_divide_.Tensor, aten.floor_divide_.Scalar, keeps_layout=True)(
    elementwise(lambda call: pointwise_rule(call, inplace=True))
)


@register(aten.fill.Scalar, aten.fill.Tensor, keeps_layout=True)
@elementwise
def fill_rule(call: OpCall) -> Decision:
    """``fill(x, v)``: ``x``'s cut, no communication; its values are never read, so a partial is not summed.

    A partial ``x`` gives a replicated result (every rank writes the whole
    value). A tensor ``v`` (0-d) must be whole: a partial one is summed.
    """
    position = call.positions[0]
    layout = call.layout(position)
    out = tuple(Replicate() if isinstance(p, Partial) else p for p in layout.placements)
    whole: tuple[Placement, ...] = (Replicate(),) * layout.mesh.ndim
    inputs = {p: whole for p in call.positions[1:]}
    return Decision(inputs=inputs, outputs=[out])


@register(aten.isin.Tensor_Tensor, aten.isin.Tensor_Scalar, aten.isin.Scalar_Tensor)
def isin_rule(call: OpCall) -> Decision:
    """``isin(elements, test_elements)``: each element is tested on its own, against the whole test set.

    The elements keep their shards (a partial is summed: membership of a sum
    is not a sum of memberships); the test set is gathered whole. A scalar
    element gives a replicated 0-d result.
    """
    elements = call.args[0]
    test = call.args[1]  # both operands are positional in every overload
    mesh = call.layout(call.positions[0]).mesh
    whole: tuple[Placement, ...] = (Replicate(),) * mesh.ndim
    inputs: dict[int, tuple[Placement, ...]] = {}
    out = whole
    if isinstance(elements, DTensor):
        position = call.position_of(elements)
        out = tuple(Replicate() if isinstance(p, Partial) else p for p in call.layout(position).placements)
        inputs[position] = out
    if isinstance(test, DTensor):
        inputs[call.position_of(test)] = whole
    return Decision(inputs=inputs, outputs=[out])
