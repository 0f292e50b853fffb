"""Losses: negative log-likelihood (so cross-entropy) cut by batch, space or class; elementwise losses.

``F.cross_entropy`` is ``log_softmax`` (in :mod:`hp_dtensor.ops.softmax`)
then ``nll_loss``, which this module places for ``(C,)``, ``(N, C)`` and
spatial ``(N, C, H, W)`` inputs (``nll_loss2d``). Each mesh dim is a batch
or a class dim ([Note: roles of the mesh dims in nll]); a class cut needs no
communication ([Note: vocab-parallel nll]), and a replicated target or
weight stays whole so a mean needs no collective ([Note: whole targets]).
Elementwise losses are placed as pointwise ops and divide by the global
count ([Note: elementwise losses]).
"""

from __future__ import annotations

import math
from typing import Any

import hp_core.collectives as hc
import torch
from hp_core.distributed import mesh_group

from hp_dtensor.layout import Layout
from hp_dtensor.ops.dispatch import Decision, LocalCall, OpCall, register
from hp_dtensor.ops.pointwise import pointwise_rule
from hp_dtensor.placements import Partial, Placement, Replicate, Shard

__all__ = ["Role", "nll_roles"]

aten = torch.ops.aten
R = Replicate()
SUM = Partial("sum")
_LOCAL_IGNORE = -1
_NONE, _MEAN, _SUM = 0, 1, 2

Role = tuple[str, int]  # ("batch", input dim) or ("class", class dim)


def _class_dim(ndim: int) -> int:
    return 0 if ndim == 1 else 1


def _target_dim(dim: int, ndim: int) -> int:
    """The target's dim for input dim ``dim`` (the target has every input dim but the class dim)."""
    return dim if dim < _class_dim(ndim) else dim - 1


# [Note: roles of the mesh dims in nll]
# Each mesh dim plays one of two roles, read from the input's placement:
#
# * batch: the input is cut along a dim that is not the class dim (the batch
#   dim, or a spatial one) and the target is cut along the same dim (the
#   target has the input's dims without the class dim); every sample, every
#   pixel, is whole on one rank;
# * class (vocab-parallel): the input is cut along its class dim and the
#   target is replicated; see [Note: vocab-parallel nll].
#
# Mesh dims with neither keep both replicated. The outputs: the loss per sample
# (``reduction="none"``) is cut like the target along batch mesh dims; a summed
# or averaged loss is ``Partial("sum")`` along both kinds; along class mesh
# dims the per-sample loss is ``Partial("sum")`` too. ``total_weight`` (the
# denominator of the mean) is complete on every rank.
def nll_roles(layout: Layout, target_layout: Layout | None) -> list[Role | None]:
    """Per mesh dim: ("batch", d), ("class", c) or None, for an input ``(C,)`` or ``(N, C, ...)``."""
    class_dim = _class_dim(layout.ndim)
    roles: list[Role | None] = []
    for m, placement in enumerate(layout.placements):
        target = target_layout.placements[m] if target_layout is not None else R
        if isinstance(placement, Shard) and placement.dim == class_dim:
            roles.append(("class", class_dim))
        elif isinstance(placement, Shard):
            roles.append(("batch", placement.dim))
        elif placement == R and isinstance(target, Shard) and layout.ndim > 1:
            dim = target.dim if target.dim < class_dim else target.dim + 1
            roles.append(("batch", dim))
        else:
            roles.append(None)
    return roles


def _layout_of(call: OpCall, value: Any) -> Layout | None:
    from hp_dtensor.dtensor import DTensor

    return call.layout(call.position_of(value)) if isinstance(value, DTensor) else None


def _targets(roles: list[Role | None], ndim: int) -> dict[str, tuple[Placement, ...]]:
    def pick(role: Role | None, batch: bool, cls: bool, target: bool) -> Placement:
        if role is not None and role[0] == "batch" and batch:
            return Shard(_target_dim(role[1], ndim) if target else role[1])
        if role is not None and role[0] == "class" and cls:
            return Shard(0 if target else role[1])
        return R

    return {
        "x": tuple(pick(r, True, True, False) for r in roles),
        "target": tuple(pick(r, True, False, True) for r in roles),
        "weight": tuple(pick(r, False, True, True) for r in roles),
    }


def _set(
    inputs: dict[int, tuple[Placement, ...]], call: OpCall, value: Any, placements: tuple[Placement, ...]
) -> None:
    from hp_dtensor.dtensor import DTensor

    if isinstance(value, DTensor):
        inputs[call.position_of(value)] = placements


def _has(roles: list[Role | None], kind: str) -> bool:
    return any(r is not None and r[0] == kind for r in roles)


def _localize(
    target: torch.Tensor, ignore_index: int, layout: Layout, roles: list[Role | None]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Targets shifted into this rank's class range, ``_LOCAL_IGNORE`` elsewhere; and the in-range mask."""
    class_dim = _class_dim(layout.ndim)
    keep = target != ignore_index
    if _has(roles, "class"):
        low = layout.local_offset()[class_dim]
        high = low + layout.local_shape()[class_dim]
        keep = keep & (target >= low) & (target < high)
        shifted = target - low
    else:
        shifted = target
    return torch.where(keep, shifted, torch.full_like(shifted, _LOCAL_IGNORE)), keep


def _groups(layout: Layout, roles: list[Role | None], wanted: tuple[str, ...]) -> list[Any]:
    return [mesh_group(layout.mesh, m) for m, r in enumerate(roles) if r is not None and r[0] in wanted]


def _whole(layout: Layout | None) -> bool:
    """Whether every rank holds all of a tensor (a plain tensor, or a replicated DTensor)."""
    return layout is None or all(isinstance(p, Replicate) for p in layout.placements)


# [Note: whole targets]
# The denominator of a mean is the total weight of every target not ignored,
# over the whole batch. A batch cut of the input usually comes with a
# replicated target (the labels of the whole batch on every rank): then the
# forward keeps the target whole, each rank reads its own samples' targets as
# a view (the rows of its batch cut) for its local sum, and counts the total
# from the whole target, with no collective. The class weights likewise stay
# whole when they are replicated (each rank narrows them to its classes). Only
# a target or weight that is itself cut needs the scalar all-reduce.
def _own_rows(target: torch.Tensor, layout: Layout, roles: list[Role | None]) -> torch.Tensor:
    """This rank's samples of a whole target: the rows of the input's batch cut ([Note: whole targets])."""
    offsets, sizes = layout.local_offset(), layout.local_shape()
    for dim in sorted({r[1] for r in roles if r is not None and r[0] == "batch"}):
        target = target.narrow(_target_dim(dim, layout.ndim), offsets[dim], sizes[dim])
    return target


def _forward_kernel(call: LocalCall) -> tuple[torch.Tensor, torch.Tensor]:
    x, target, weight, reduction, ignore_index = call.args[:5]
    layout = call.layout(0)
    target_layout = call.layouts[1] if isinstance(call.layouts[1], Layout) else None
    weight_layout = call.layouts[2] if isinstance(call.layouts[2], Layout) else None
    roles = nll_roles(layout, target_layout)
    # Whole target and weight: the total weight is counted here (see [Note: whole targets]).
    whole = _whole(target_layout) and (weight is None or _whole(weight_layout))
    everything = target
    if _whole(target_layout) and _has(roles, "batch"):
        target = _own_rows(target, layout, roles)
    local_weight = weight
    if weight is not None and weight.numel() and _whole(weight_layout) and _has(roles, "class"):
        class_dim = _class_dim(layout.ndim)
        local_weight = weight.narrow(0, layout.local_offset()[class_dim], layout.local_shape()[class_dim])
    local_target, keep = _localize(target, int(ignore_index), layout, roles)
    local_reduction = _NONE if reduction == _NONE else _SUM  # a sum, divided by the global total below
    if x.shape[_class_dim(x.dim())] == 0:  # an empty piece of the classes (uneven cut): no target is here
        out = x.new_zeros(target.shape if reduction == _NONE else ())
    else:
        out, _ = call.func(x, local_target, local_weight, local_reduction, _LOCAL_IGNORE)
    if reduction == _NONE:
        return out, x.new_zeros(())
    groups: list[Any] = []
    if whole:
        counted = everything != int(ignore_index)
        if weight is None:
            total = counted.sum().to(x.dtype)
        elif weight.numel() == 0:
            total = x.new_zeros(())
        else:
            picked = weight[torch.where(counted, everything, torch.zeros_like(everything))]
            total = torch.where(counted, picked, torch.zeros_like(picked)).sum().to(x.dtype)
    elif weight is None:
        # Every rank of a class line counts the same targets: only batch lines add up.
        total = (target != int(ignore_index)).sum().to(x.dtype)
        groups = _groups(layout, roles, ("batch",))
    else:
        if weight.numel() == 0:
            total = x.new_zeros(())
        else:
            picked = local_weight[local_target.clamp(min=0)]
            total = torch.where(keep, picked, torch.zeros_like(picked)).sum().to(x.dtype)
        groups = _groups(layout, roles, ("batch", "class"))
    total = total.contiguous()
    for group in groups:
        hc.all_reduce(total, "sum", group)
    if reduction == _MEAN:
        out = out / total
    return out, total


def _backward_kernel(call: LocalCall) -> torch.Tensor:
    grad, x, target, weight, reduction, ignore_index, total = call.args[:7]
    layout = call.layout(1)
    target_layout = call.layouts[2] if isinstance(call.layouts[2], Layout) else None
    roles = nll_roles(layout, target_layout)
    local_target, _ = _localize(target, int(ignore_index), layout, roles)
    if x.shape[_class_dim(x.dim())] == 0:
        return torch.zeros_like(x)
    return call.func(grad, x, local_target, weight, reduction, _LOCAL_IGNORE, total)


def _nll_inputs(
    call: OpCall, x: Any, target: Any, weight: Any
) -> tuple[Layout, Any, dict[str, Any], dict[int, tuple[Placement, ...]]] | None:
    """Input layout, roles, target placements and input placements shared by the nll rules."""
    layout = _layout_of(call, x)
    if layout is None or layout.ndim == 0:
        return None
    roles = nll_roles(layout, _layout_of(call, target))
    targets = _targets(roles, layout.ndim)
    inputs: dict[int, tuple[Placement, ...]] = {}
    _set(inputs, call, x, targets["x"])
    _set(inputs, call, target, targets["target"])
    _set(inputs, call, weight, targets["weight"])
    return layout, roles, targets, inputs


# [Note: vocab-parallel nll]
# The loss of sample ``i`` is ``-w[t_i] * x[i, t_i]``, one element of the row.
# A rank holding classes ``[lo, hi)`` looks up the samples whose target falls
# in its range (shifted by ``lo``) and contributes 0 for the others, so the
# per-rank terms sum to the loss: ``Partial("sum")`` with no communication.
# Targets outside the range, and ignored targets, are given a local ignore
# index (-1, never a valid local class) so the local kernel skips them. The
# mean divides the local sum by the global total weight: without class
# weights that is the number of targets not ignored, which every rank of a
# class line can count from its replicated targets; with class weights kept
# whole every rank adds them up over the whole target too; with cut class
# weights each rank adds up the weights it owns and one ``all_reduce(sum)`` of
# that scalar completes it. Batch mesh dims add one ``all_reduce(sum)`` of the
# scalar only when the target itself is cut (see [Note: whole targets]). The
# backward writes ``-w[t] * grad / total_weight`` at the local target
# positions, again without communication.
@register(aten.nll_loss_forward.default, aten.nll_loss2d_forward.default)
def nll_loss_forward_rule(call: OpCall) -> Decision | None:
    """Batch, spatial and class (vocab-parallel) shards stay put; see the module docstring for the outputs."""
    x, target, weight, reduction = call.args[0], call.args[1], call.args[2], call.args[3]
    setup = _nll_inputs(call, x, target, weight)
    if setup is None:
        return None
    _, roles, targets, inputs = setup
    if reduction == _NONE:
        per_sample = zip(roles, targets["target"], strict=True)
        out = tuple(SUM if r is not None and r[0] == "class" else p for r, p in per_sample)
    else:
        out = tuple(SUM if r is not None else R for r in roles)
    if reduction != _NONE:  # whole targets and weights stay whole: see [Note: whole targets]
        for value in (target, weight):
            if _whole(_layout_of(call, value)):
                _set(inputs, call, value, (R,) * len(roles))
    kernel = _forward_kernel if any(r is not None for r in roles) else None
    return Decision(inputs=inputs, outputs=[out, (R,) * len(roles)], kernel=kernel)


@register(aten.nll_loss_backward.default, aten.nll_loss2d_backward.default)
def nll_loss_backward_rule(call: OpCall) -> Decision | None:
    """The gradient takes the input's shards; the local kernel writes only this rank's classes."""
    grad, x, target, weight, reduction, _, total = call.args[:7]
    setup = _nll_inputs(call, x, target, weight)
    if setup is None:
        return None
    layout, roles, targets, inputs = setup
    per_sample = reduction == _NONE and layout.ndim >= 2
    _set(inputs, call, grad, targets["target"] if per_sample else (R,) * len(roles))
    _set(inputs, call, total, (R,) * len(roles))
    kernel = _backward_kernel if any(r is not None for r in roles) else None
    return Decision(inputs=inputs, outputs=[targets["x"]], kernel=kernel)


# [Note: elementwise losses]
# ``mse_loss``, ``smooth_l1_loss``, ``huber_loss``, ``soft_margin_loss``,
# ``binary_cross_entropy`` and ``binary_cross_entropy_with_logits`` are a
# pointwise function of their operands followed by a reduction. Their operands
# are placed as a pointwise op's (:func:`hp_dtensor.ops.pointwise.pointwise_rule`:
# any shard of the broadcast shape, target, weight and ``pos_weight`` cut to
# match; partial terms summed first, the loss is not linear). With
# ``reduction="none"`` the loss is cut like that; with ``"sum"`` each rank sums
# its piece (``Partial("sum")`` along cut mesh dims); with ``"mean"`` each rank
# divides its piece's sum by the *global* element count, so the terms add up to
# the mean however unevenly the rows are cut (averaging local means would
# weigh a rank holding 2 rows like one holding 3). The backward is the
# ``"sum"`` backward divided by the same global count. No communication either
# way.
# -- elementwise losses (see [Note: elementwise losses]) ---------------------------------------

_ELEMENTWISE = (
    aten.mse_loss.default,
    aten.smooth_l1_loss.default,
    aten.huber_loss.default,
    aten.soft_margin_loss.default,
    aten.binary_cross_entropy.default,
    aten.binary_cross_entropy_with_logits.default,
)
_ELEMENTWISE_BACKWARD = (
    aten.mse_loss_backward.default,
    aten.smooth_l1_loss_backward.default,
    aten.huber_loss_backward.default,
    aten.soft_margin_loss_backward.default,
    aten.binary_cross_entropy_backward.default,
)


def _reduction_index(func: Any) -> int:
    return [a.name for a in func._schema.arguments].index("reduction")


def _reduction(call: OpCall | LocalCall) -> int:
    index = _reduction_index(call.func)
    if len(call.args) > index:
        return int(call.args[index])
    return int(call.kwargs.get("reduction", _MEAN))


def _summed_kernel(count: int, mean: bool) -> Any:
    """Run the op with ``reduction="sum"`` on the local pieces; a mean divides by the global ``count``."""

    def run(call: LocalCall) -> torch.Tensor:
        args, kwargs = list(call.args), dict(call.kwargs)
        index = _reduction_index(call.func)
        if len(args) > index:
            args[index] = _SUM
        else:
            kwargs["reduction"] = _SUM
        out = call.func(*args, **kwargs)
        return out / count if mean else out

    return run


@register(*_ELEMENTWISE, *_ELEMENTWISE_BACKWARD)
def elementwise_loss_rule(call: OpCall) -> Decision:
    """Operands placed as a pointwise op's; a reduced loss is a partial sum over a global count."""
    reduction = _reduction(call)
    backward = call.func in _ELEMENTWISE_BACKWARD
    grad = call.position_of(call.args[0]) if backward and reduction != _NONE else None
    operands = [p for p in call.positions if p != grad]
    decision = pointwise_rule(call, positions=operands, inplace=False)
    out = decision.outputs[0]
    assert out is not None
    mesh_ndim = len(out)
    if grad is not None:
        decision.inputs[grad] = (R,) * mesh_ndim  # the gradient of a reduced loss: one number
    shape = torch.broadcast_shapes(*(call.layout(p).shape for p in operands))
    if reduction != _NONE:
        decision.kernel = _summed_kernel(math.prod(shape), reduction == _MEAN)
        if not backward:
            out = tuple(SUM if isinstance(p, Shard) else p for p in out)
    decision.outputs = [out]
    return decision


@register(aten.log_sigmoid_forward.default)
def log_sigmoid_forward_rule(call: OpCall) -> Decision:
    """``log_sigmoid_forward`` (``F.logsigmoid``, the ``pos_weight`` form of BCE with logits): pointwise.

    Its second output, a buffer for the backward, has the input's shape on
    CPU but is empty on CUDA, where the backward does not read it; the
    kernel then hands back zeros broadcast to the shape (no memory), so the
    buffer's layout is the output's on every device.
    """
    decision = pointwise_rule(call, inplace=False)
    out = decision.outputs[0]
    decision.outputs = [out, out]
    decision.kernel = _log_sigmoid_kernel
    return decision


def _log_sigmoid_kernel(call: LocalCall) -> tuple[torch.Tensor, torch.Tensor]:
    out, buffer = call.func(*call.args, **call.kwargs)
    if buffer.shape != out.shape:
        buffer = out.new_zeros(()).expand_as(out)
    return out, buffer


register(aten.log_sigmoid_backward.default)(pointwise_rule)
