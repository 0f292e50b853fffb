"""Negative log-likelihood (and thus cross-entropy), forward and backward, sharded by batch or by class.

``F.cross_entropy`` is ``log_softmax`` then ``nll_loss``; the first is in
:mod:`hp_dtensor.ops.softmax`, this module is the second. Each mesh dim
plays one of two roles, read from the input's placement:

* batch: the input is cut along its batch dim (dim 0 of ``(N, C)``) and the
  target is cut the same way; every sample is whole on one rank;
* class (vocab-parallel): the input is cut along its class dim and the
  target is replicated; see [Note: vocab-parallel nll].

Mesh dims with neither keep both replicated. The outputs: the loss per sample
(``reduction="none"``) is ``Shard(0)`` along batch mesh dims; a summed or
averaged loss is ``Partial("sum")`` along both kinds; along class mesh dims
the per-sample loss is ``Partial("sum")`` too. ``total_weight`` (the
denominator of the mean) is complete on every rank.

[Note: vocab-parallel nll]
The loss of sample ``i`` is ``-w[t_i] * x[i, t_i]``, one element of the row.
A rank holding classes ``[lo, hi)`` looks up the samples whose target falls
in its range (shifted by ``lo``) and contributes 0 for the others, so the
per-rank terms sum to the loss: ``Partial("sum")`` with no communication.
Targets outside the range, and ignored targets, are given a local ignore
index (-1, never a valid local class) so the local kernel skips them. The
mean divides the local sum by the global total weight: without class
weights that is the number of targets not ignored, which every rank of a
class line can count from its replicated targets; with class weights each
rank adds up the weights it owns and one ``all_reduce(sum)`` of that scalar
completes it. Batch mesh dims add one ``all_reduce(sum)`` of the scalar as
well. The backward writes ``-w[t] * grad / total_weight`` at the local
target positions, again without communication.
"""

from __future__ import annotations

from typing import Any

import hp_core.collectives as hc
import torch
from hp_core.distributed import mesh_group

from hp_dtensor.layout import Layout
from hp_dtensor.ops.dispatch import Decision, LocalCall, OpCall, register
from hp_dtensor.placements import Partial, Placement, Replicate, Shard

__all__ = ["nll_roles"]

aten = torch.ops.aten
R = Replicate()
SUM = Partial("sum")
_LOCAL_IGNORE = -1
_NONE, _MEAN = 0, 1


def nll_roles(layout: Layout, target_layout: Layout | None) -> list[str | None]:
    """Per mesh dim: "batch", "class" or None for an input of ``layout`` (``(N, C)`` or ``(C,)``)."""
    class_dim = 1 if layout.ndim == 2 else 0
    roles: list[str | None] = []
    for m, placement in enumerate(layout.placements):
        target = target_layout.placements[m] if target_layout is not None else R
        if layout.ndim == 2 and (placement == Shard(0) or (placement == R and target == Shard(0))):
            roles.append("batch")
        elif placement == Shard(class_dim):
            roles.append("class")
        else:
            roles.append(None)
    return roles


def _layout_of(call: OpCall, value: Any) -> Layout | None:
    from hp_dtensor.dtensor import DTensor

    return call.layout(call.position_of(value)) if isinstance(value, DTensor) else None


def _targets(roles: list[str | None], ndim: int) -> dict[str, tuple[Placement, ...]]:
    class_dim = 1 if ndim == 2 else 0
    x = tuple(Shard(0) if r == "batch" else Shard(class_dim) if r == "class" else R for r in roles)
    target = tuple(Shard(0) if r == "batch" else R for r in roles)
    weight = tuple(Shard(0) if r == "class" else R for r in roles)
    return {"x": x, "target": target, "weight": weight}


def _set(
    inputs: dict[int, tuple[Placement, ...]], call: OpCall, value: Any, placements: tuple[Placement, ...]
) -> None:
    from hp_dtensor.dtensor import DTensor

    if isinstance(value, DTensor):
        inputs[call.position_of(value)] = placements


def _localize(
    target: torch.Tensor, ignore_index: int, layout: Layout, roles: list[str | None]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Targets shifted into this rank's class range, ``_LOCAL_IGNORE`` elsewhere; and the in-range mask."""
    class_dim = 1 if layout.ndim == 2 else 0
    keep = target != ignore_index
    if "class" in roles:
        low = layout.local_offset()[class_dim]
        high = low + layout.local_shape()[class_dim]
        keep = keep & (target >= low) & (target < high)
        shifted = target - low
    else:
        shifted = target
    return torch.where(keep, shifted, torch.full_like(shifted, _LOCAL_IGNORE)), keep


def _groups(layout: Layout, roles: list[str | None], wanted: tuple[str, ...]) -> list[Any]:
    return [mesh_group(layout.mesh, m) for m, role in enumerate(roles) if role in wanted]


def _forward_kernel(call: LocalCall) -> tuple[torch.Tensor, torch.Tensor]:
    x, target, weight, reduction, ignore_index = call.args[:5]
    layout = call.layout(0)
    target_layout = call.layouts[1] if isinstance(call.layouts[1], Layout) else None
    roles = nll_roles(layout, target_layout)
    local_target, keep = _localize(target, int(ignore_index), layout, roles)
    local_reduction = _NONE if reduction == _NONE else 2  # sum, divided by the global total below
    if x.shape[-1] == 0:  # an empty piece of the classes (uneven cut): no sample's target is here
        out = x.new_zeros(target.shape if reduction == _NONE else ())
    else:
        out, _ = aten.nll_loss_forward.default(x, local_target, weight, local_reduction, _LOCAL_IGNORE)
    if reduction == _NONE:
        return out, x.new_zeros(())
    if weight is None:
        # Every rank of a class line counts the same targets: only batch lines add up.
        total = (target != int(ignore_index)).sum().to(x.dtype)
        groups = _groups(layout, roles, ("batch",))
    else:
        if weight.numel() == 0:
            total = x.new_zeros(())
        else:
            picked = weight[local_target.clamp(min=0)]
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
    if x.shape[-1] == 0:
        return torch.zeros_like(x)
    return aten.nll_loss_backward.default(grad, x, local_target, weight, reduction, _LOCAL_IGNORE, total)


def _nll_inputs(
    call: OpCall, x: Any, target: Any, weight: Any
) -> tuple[Layout, Any, dict[str, Any], dict[int, tuple[Placement, ...]]] | None:
    """Input layout, roles, target placements and input placements shared by the nll rules."""
    layout = _layout_of(call, x)
    if layout is None or layout.ndim not in (1, 2):
        return None
    roles = nll_roles(layout, _layout_of(call, target))
    targets = _targets(roles, layout.ndim)
    inputs: dict[int, tuple[Placement, ...]] = {}
    _set(inputs, call, x, targets["x"])
    _set(inputs, call, target, targets["target"])
    _set(inputs, call, weight, targets["weight"])
    return layout, roles, targets, inputs


@register(aten.nll_loss_forward.default)
def nll_loss_forward_rule(call: OpCall) -> Decision | None:
    """Batch and class (vocab-parallel) shards stay put; see the module docstring for the outputs."""
    x, target, weight, reduction = call.args[0], call.args[1], call.args[2], call.args[3]
    setup = _nll_inputs(call, x, target, weight)
    if setup is None:
        return None
    _, roles, _, inputs = setup
    if reduction == _NONE:
        out = tuple(Shard(0) if r == "batch" else SUM if r == "class" else R for r in roles)
    else:
        out = tuple(SUM if r is not None else R for r in roles)
    kernel = _forward_kernel if any(r is not None for r in roles) else None
    return Decision(inputs=inputs, outputs=[out, (R,) * len(roles)], kernel=kernel)


@register(aten.nll_loss_backward.default)
def nll_loss_backward_rule(call: OpCall) -> Decision | None:
    """The gradient takes the input's shards; the local kernel writes only this rank's classes."""
    grad, x, target, weight, reduction, _, total = call.args[:7]
    setup = _nll_inputs(call, x, target, weight)
    if setup is None:
        return None
    layout, roles, targets, inputs = setup
    per_sample = reduction == _NONE and layout.ndim == 2
    _set(inputs, call, grad, tuple(Shard(0) if r == "batch" and per_sample else R for r in roles))
    _set(inputs, call, total, (R,) * len(roles))
    kernel = _backward_kernel if any(r is not None for r in roles) else None
    return Decision(inputs=inputs, outputs=[targets["x"]], kernel=kernel)
