"""``_foreach_*`` ops: the pointwise rule per element, then one local foreach call over all elements."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

from hp_dtensor.dtensor import DTensor
from hp_dtensor.layout import Layout
from hp_dtensor.ops.dispatch import Decision, OpCall, Rule, _distinct
from hp_dtensor.ops.meshes import common_mesh
from hp_dtensor.ops.pointwise import pointwise_rule
from hp_dtensor.redistribute import redistribute_local

__all__ = ["foreach_run"]


def _foreach_rule(call: OpCall) -> Decision:
    func = call.func
    inplace = torch.Tag.inplace in func.tags or str(func).split(".")[1].endswith("_")
    # Flat positions of every list's elements, by place rather than identity: the same tensor may
    # be in two lists (AdamW's addcmul_(exp_avg_sq, grads, grads)) and each place is moved on its own.
    lists: list[list[int]] = []
    start = 0
    for arg in call.args:
        count = len(pytree.tree_leaves(arg))
        if isinstance(arg, (list, tuple)) and arg and isinstance(arg[0], torch.Tensor):
            lists.append(list(range(start, start + count)))
        start += count
    decision = Decision(inplace=inplace)
    for index in range(len(lists[0])):
        positions = [lst[index] for lst in lists if isinstance(call.flat[lst[index]], DTensor)]
        sub = pointwise_rule(call, positions, inplace=inplace)
        decision.inputs.update(sub.inputs)
        decision.outputs.extend(sub.outputs)
    return decision


def foreach_run(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Foreach ops: one rule per element, then one local foreach call over all elements."""
    return dispatch_foreach(func, args, kwargs, _foreach_rule)


def dispatch_foreach(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], rule: Rule) -> Any:
    """``_foreach_*`` ops: ``rule`` decides per element; the op runs once over all local elements."""
    flat, spec = pytree.tree_flatten((args, kwargs))
    positions = [i for i, v in enumerate(flat) if isinstance(v, DTensor)]
    mesh = common_mesh(flat, positions, func)
    flat = _distinct(flat, positions)
    a, k = pytree.tree_unflatten(flat, spec)
    decision = rule(OpCall(func, a, k, flat, positions))
    assert decision is not None
    local_flat = list(flat)
    for p in positions:
        dt = flat[p]
        target = decision.inputs.get(p)
        if target is not None and target != dt._layout.placements:
            local, layout = redistribute_local(dt._local, dt._layout, target)
            if decision.inplace and _is_first_list_member(args, dt):
                dt._local, dt._layout = local, layout
            local_flat[p] = local
        else:
            local_flat[p] = dt._local
    local_args, local_kwargs = pytree.tree_unflatten(local_flat, spec)
    result = func(*local_args, **local_kwargs)
    if decision.inplace:
        return None if result is None else args[0]
    wrapped = []
    for index, value in enumerate(result):
        source = args[0][index]
        placements = decision.outputs[index]
        if not isinstance(source, DTensor) or placements is None:
            wrapped.append(value)
            continue
        layout = source._layout
        if placements != layout.placements:
            layout = Layout(mesh, placements, layout.shape, layout.stride)
        wrapped.append(DTensor(value, layout))
    return wrapped


def _is_first_list_member(args: tuple[Any, ...], dt: Any) -> bool:
    return isinstance(args[0], (list, tuple)) and any(x is dt for x in args[0])
