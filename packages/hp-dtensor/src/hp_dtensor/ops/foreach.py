"""``_foreach_*`` ops: a rule per element, then one local foreach call over all elements.

Why elements may live on different meshes: [Note: foreach over meshes] (above
:func:`dispatch_foreach`); how torch's optimizers find these paths:
[Note: DTensor as a foreach type].
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from hp_dtensor.dtensor import DTensor
from hp_dtensor.layout import Layout
from hp_dtensor.ops.dispatch import SPECIAL, Decision, OpCall, Rule, _distinct
from hp_dtensor.ops.meshes import common_mesh
from hp_dtensor.ops.pointwise import pointwise_rule
from hp_dtensor.ops.strided import decide, elementwise, reads_strided
from hp_dtensor.placements import Replicate
from hp_dtensor.redistribute import keep_destination_layout, redistribute_local

__all__ = ["dispatch_foreach", "element_positions", "foreach_run"]

aten = torch.ops.aten

# Global (shape, stride) of element output ``i`` given its first DTensor's layout.
OutputShape = Callable[[Layout], tuple[tuple[int, ...], tuple[int, ...]]]
LocalRun = Callable[[Any, tuple[Any, ...], dict[str, Any]], Any]


def element_positions(args: tuple[Any, ...]) -> tuple[list[list[int]], set[int]]:
    """Flat positions per element (by place, one list per element) and the positions inside the lists.

    By place rather than identity: the same tensor may be in two lists
    (AdamW's ``addcmul_(exp_avg_sq, grads, grads)``) and each place is moved
    on its own.
    """
    lists: list[list[int]] = []
    start = 0
    for arg in args:
        count = len(pytree.tree_leaves(arg))
        if isinstance(arg, (list, tuple)) and arg and any(isinstance(x, torch.Tensor) for x in arg):
            lists.append(list(range(start, start + count)))
        start += count
    if not lists:
        return [], set()
    elements = [[lst[i] for lst in lists if i < len(lst)] for i in range(len(lists[0]))]
    return elements, {p for lst in lists for p in lst}


def _is_inplace(func: Any) -> bool:
    return torch.Tag.inplace in func.tags or str(func).split(".")[1].endswith("_")


@elementwise
def _element_rule(call: OpCall) -> Decision:
    """The pointwise rule over one element's DTensors (``call.positions``)."""
    return pointwise_rule(call, inplace=_is_inplace(call.func))


@reads_strided
def _foreach_rule(call: OpCall) -> Decision:
    """Each element asks :func:`decide` on its own, so a strided element keeps its cut.

    Marked :func:`reads_strided` because it hands every element to
    :func:`decide` itself: one element's ``StridedShard`` says nothing about
    another's.
    """
    inplace = _is_inplace(call.func)
    elements, _ = element_positions(call.args)
    decision = Decision(inplace=inplace)
    for element in elements:
        positions = [p for p in element if isinstance(call.flat[p], DTensor)]
        if not positions:
            decision.outputs.append(None)
            continue
        sub = decide(_element_rule, dataclasses.replace(call, positions=positions))
        assert sub is not None
        decision.inputs.update(sub.inputs)
        decision.outputs.extend(sub.outputs)
    return decision


def foreach_run(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Foreach ops: one rule per element, then one local foreach call over all elements."""
    return dispatch_foreach(func, args, kwargs, _foreach_rule)


# [Note: foreach over meshes]
# A foreach op zips its lists: element ``i`` is ``(params[i], grads[i],
# exp_avgs[i], ...)``, and only the tensors of one element meet. So the
# DTensors of one element must share a mesh (or a permutation of it, re-expressed
# without communication, see [Note: permuted meshes] in
# :mod:`hp_dtensor.ops.meshes`), but different elements may live on different
# meshes: FSDP x TP parameters on ``("dp", "tp")`` and ``("tp", "dp")``, or a
# model whose parameters span several meshes. The local kernel does not care
# about meshes, so after each element is moved to its rule's placements the op
# still runs once over every element's local tensor (one kernel launch, as
# torch's DTensor does per mesh group), and each output is wrapped on its own
# element's mesh. A tensor passed outside the lists (``_foreach_mul_(grads,
# clip_coef)``) meets every element: it is taken whole (replicated).
def dispatch_foreach(
    func: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    rule: Rule,
    output_shape: OutputShape | None = None,
    local_run: LocalRun | None = None,
) -> Any:
    """``_foreach_*`` ops: ``rule`` decides per element; the op runs once over all local elements.

    ``output_shape`` gives an element's global output shape and stride from
    its input layout (default: the input's, for elementwise ops);
    ``local_run(func, args, kwargs)`` replaces the local call (default:
    ``func`` itself). See [Note: foreach over meshes].
    """
    flat, spec = pytree.tree_flatten((args, kwargs))
    positions = [i for i, v in enumerate(flat) if isinstance(v, DTensor)]
    flat = _distinct(flat, positions)
    elements, listed = element_positions(args)
    meshes: list[Any] = []
    for element in elements:
        dts = [p for p in element if isinstance(flat[p], DTensor)]
        if dts:
            mesh, flat = common_mesh(flat, dts, func)
            meshes.append(mesh)
        else:
            meshes.append(None)
    a, k = pytree.tree_unflatten(flat, spec)
    # Through decide: a rule that never heard of StridedShard sees such an element replicated.
    decision = decide(rule, OpCall(func, a, k, flat, positions))
    assert decision is not None
    for p in positions:
        if p not in listed:  # a tensor outside the lists meets every element: whole
            decision.inputs[p] = (Replicate(),) * flat[p]._layout.mesh.ndim
    local_flat = list(flat)
    written: list[tuple[DTensor, torch.Tensor, Layout]] = []
    for p in positions:
        dt = flat[p]
        target = decision.inputs.get(p)
        if target is not None and target != dt._layout.placements:
            local, layout = redistribute_local(dt._local, dt._layout, target)
            if decision.inplace and _is_first_list_member(args, dt):
                written.append((dt, dt._local, dt._layout))  # moved back after the op
                dt._local, dt._layout = local, layout
            local_flat[p] = local
        else:
            local_flat[p] = dt._local
    local_args, local_kwargs = pytree.tree_unflatten(local_flat, spec)
    result = (local_run or _call)(func, local_args, local_kwargs)
    for dt, local, layout in written:  # see [Note: an in-place op keeps its destination's layout]
        keep_destination_layout(dt, local, layout)
    if decision.inplace:
        return None if result is None else args[0]
    wrapped = []
    for index, value in enumerate(result):
        element = elements[index]
        placements = decision.outputs[index]
        first = next((flat[p] for p in element if isinstance(flat[p], DTensor)), None)
        if first is None or placements is None:
            wrapped.append(value)
            continue
        layout = first._layout
        if output_shape is not None:
            shape, stride = output_shape(layout)
            layout = Layout(meshes[index], placements, shape, stride)
        elif placements != layout.placements or layout.mesh is not meshes[index]:
            layout = Layout(meshes[index], placements, layout.shape, layout.stride)
        wrapped.append(DTensor(value, layout))
    return wrapped


def _call(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return func(*args, **kwargs)


def _is_first_list_member(args: tuple[Any, ...], dt: Any) -> bool:
    return isinstance(args[0], (list, tuple)) and any(x is dt for x in args[0])


def _foreach_mm(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """``_foreach_mm(selves, mat2s)``: a list of matrix products, each placed by the ``mm`` rule.

    Its elements are not pointwise (element ``i``'s output is ``selves[i] @
    mat2s[i]``, a contraction), so each product is dispatched as ``aten.mm``:
    the contraction rule of :mod:`hp_dtensor.ops.matrix` keeps a shard of the
    rows or columns, or makes a partial sum, instead of gathering.
    """
    named = dict(zip(("self", "mat2"), args, strict=False)) | kwargs
    selves, mats = named["self"], named["mat2"]
    if len(selves) != len(mats):
        raise ValueError(
            f"_foreach_mm got {len(selves)} left and {len(mats)} right matrices; "
            "pass two lists of equal length."
        )
    return [aten.mm.default(a, b) for a, b in zip(selves, mats, strict=True)]


SPECIAL[aten._foreach_mm.default] = _foreach_mm


# [Note: DTensor as a foreach type]
# torch's ``clip_grad_norm_`` and optimizers use foreach only for tensor types
# they list as supported; DTensor is listed at import (as torch lists its own
# DTensor), so ``clip_grad_norm_`` and ``foreach=None`` optimizers on a
# foreach-capable device take these one-launch paths.
def _list_as_foreach_capable() -> None:
    """Let torch's foreach paths take DTensor lists (see [Note: foreach over meshes])."""
    from torch.optim import optimizer
    from torch.utils import _foreach_utils

    for supported in (optimizer._foreach_supported_types, _foreach_utils._foreach_supported_types):
        if DTensor not in supported:
            supported.append(DTensor)


_list_as_foreach_capable()
