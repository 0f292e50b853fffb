"""Layer norm forward and backward.

Normalising needs every element of the normalised (trailing) dims on one
rank, so those dims are gathered; leading dims (batch, sequence) stay sharded,
which is what sequence parallelism relies on. The weight and bias are
replicated; in the backward their gradients are sums over the leading dims,
so a sharded leading dim makes them ``Partial("sum")``.
(``rms_norm`` decomposes into pointwise ops and a mean, which have rules.)
"""

from __future__ import annotations

import torch

from hp_dtensor.ops.dispatch import Decision, OpCall, register
from hp_dtensor.placements import Partial, Placement, Replicate, Shard

__all__ = ["layer_norm_rule"]

aten = torch.ops.aten


def _leading_target(call: OpCall, input_index: int, normalized: int) -> tuple[Placement, ...]:
    layout = call.layout(call.position_of(call.args[input_index]))
    lead = layout.ndim - normalized
    return tuple(p if isinstance(p, Shard) and p.dim < lead else Replicate() for p in layout.placements)


@register(aten.native_layer_norm.default)
def layer_norm_rule(call: OpCall) -> Decision:
    """``(out, mean, rstd)`` keep the input's leading-dim shards."""
    target = _leading_target(call, 0, len(call.args[1]))
    inputs: dict[int, tuple[Placement, ...]] = {p: (Replicate(),) * len(target) for p in call.positions}
    inputs[call.position_of(call.args[0])] = target
    return Decision(inputs=inputs, outputs=[target, target, target])


@register(aten.native_layer_norm_backward.default)
def layer_norm_backward_rule(call: OpCall) -> Decision:
    """``grad_input`` like the input; weight and bias gradients partial where leading dims are cut."""
    target = _leading_target(call, 1, len(call.args[2]))
    inputs: dict[int, tuple[Placement, ...]] = {p: (Replicate(),) * len(target) for p in call.positions}
    for index in (0, 1, 3, 4):
        inputs[call.position_of(call.args[index])] = target
    param = tuple(Partial("sum") if isinstance(p, Shard) else Replicate() for p in target)
    return Decision(inputs=inputs, outputs=[target, param, param])
