"""Multi-class margin losses (``multi_margin_loss``, ``multilabel_margin_loss``) on a batch cut.

Both score each sample ``(N, C)`` row on its own, so a cut of the batch dim
(of the input or the target: the other is cut alike, a free local slice)
leaves every sample whole on one rank. Each rank runs the op on its samples:

* ``reduction="none"``: the per-sample loss keeps the batch cut;
* ``"sum"``: each rank's sum is a term of ``Partial("sum")``;
* ``"mean"``: each rank sums its samples and divides by the *global* batch
  size, a ``Partial("sum")`` too (a local mean would weigh the ranks' pieces
  equally, wrong for uneven cuts); the backward scales by the same count.

Nothing is communicated, forward or backward (``is_target`` of the
multilabel loss keeps the batch cut). The class dim compares each sample's
target score with all its others, so a class cut is gathered, as is a
one-sample ``(C,)`` input. torch's DTensor has no rule for these ops.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch

from hp_dtensor.ops.dispatch import Decision, LocalCall, OpCall, register
from hp_dtensor.placements import Partial, Placement, Replicate, Shard

__all__ = ["margin_loss_rule"]

aten = torch.ops.aten
R = Replicate()
S0 = Shard(0)
_NONE, _MEAN, _SUM = 0, 1, 2


class _Spec(NamedTuple):
    """Where an op's per-sample tensors, incoming gradient and reduction sit."""

    samples: tuple[int, ...]  # args cut with the batch (input, target, is_target)
    reduction: int  # the reduction's positional index
    grad: int | None  # the incoming gradient's index (backward ops)
    extra: tuple[int, ...]  # result tensors after the loss, cut with the batch whatever the reduction


_SPECS: dict[Any, _Spec] = {
    aten.multi_margin_loss.default: _Spec((0, 1), 5, None, ()),
    aten.multilabel_margin_loss_forward.default: _Spec((0, 1), 2, None, (1,)),
    aten.multi_margin_loss_backward.default: _Spec((1, 2), 6, 0, ()),
    aten.multilabel_margin_loss_backward.default: _Spec((1, 2, 4), 3, 0, ()),
}


# [Note: meta kernels for the margin losses' backward]
# The dispatcher runs each op on meta tensors for its output shapes, and
# this torch has no meta kernel for ``multi_margin_loss_backward`` or
# ``multilabel_margin_loss_backward`` (each result has the input's shape,
# dtype and layout; the input is their second argument). One is registered
# here for each that has none, so that the rule can serve the backward; a
# torch that has its own keeps it.
def _backward_meta(grad: torch.Tensor, x: torch.Tensor, *rest: Any) -> torch.Tensor:
    return torch.empty_like(x)


_LIBRARY = torch.library.Library("aten", "IMPL")
for _name in ("multi_margin_loss_backward", "multilabel_margin_loss_backward"):
    if not torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{_name}", "Meta"):
        _LIBRARY.impl(_name, _backward_meta, "Meta")


def _full_args(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """Every positional argument, the trailing defaults the dispatcher left out filled in from the schema."""
    full = list(args)
    for argument in func._schema.arguments[len(args) :]:
        if argument.kwarg_only:
            break
        full.append(kwargs.get(argument.name, argument.default_value))
    return full


def _summed_kernel(count: int, call: LocalCall) -> Any:
    """The op summed over this rank's samples, over ``count`` (the global batch for a mean, else 1)."""
    spec = _SPECS[call.func]
    args = _full_args(call.func, call.args, call.kwargs)
    args[spec.reduction] = _SUM
    first = args[spec.samples[0]]
    result = call.func(*args)
    if spec.grad is None:  # the loss (and is_target): an empty piece contributes zero
        loss = result[0] if isinstance(result, tuple) else result
        loss = loss / count if first.shape[0] else torch.zeros_like(loss)
        return (loss, *result[1:]) if isinstance(result, tuple) else loss
    return result / count


@register(*_SPECS)
def margin_loss_rule(call: OpCall) -> Decision:
    """A batch cut is local; a summed or averaged loss is a partial sum (see the module docstring)."""
    from hp_dtensor.dtensor import DTensor

    spec = _SPECS[call.func]
    args = _full_args(call.func, call.args, call.kwargs)
    reduction = args[spec.reduction]
    samples = [call.position_of(args[i]) for i in spec.samples]
    layouts = [call.layout(p) for p in samples]
    batched = layouts[0].ndim == 2
    cuts: list[Placement] = []
    for m in range(layouts[0].mesh.ndim):
        cut = batched and any(layout.placements[m] == S0 for layout in layouts)
        cuts.append(S0 if cut else R)
    placements = tuple(cuts)
    reduced = tuple(Partial("sum") if p == S0 else R for p in placements)
    inputs = {p: placements for p in samples}
    for position in call.positions:  # the class weight, a reduced loss's gradient: whole
        inputs.setdefault(position, (R,) * len(placements))
    if spec.grad is not None and reduction == _NONE and isinstance(args[spec.grad], DTensor):
        inputs[call.position_of(args[spec.grad])] = placements
    outputs: list[tuple[Placement, ...] | None]
    if spec.grad is None:
        outputs = [placements if reduction == _NONE else reduced, *(placements for _ in spec.extra)]
    else:
        outputs = [placements]
    kernel = None
    if reduction != _NONE and S0 in placements:  # a sum too: torch's sum over no sample is not 0
        kernel = functools.partial(_summed_kernel, layouts[0].shape[0] if reduction == _MEAN else 1)
    return Decision(inputs=inputs, outputs=outputs, kernel=kernel)
