"""Fused optimizer kernels (Adam, AdamW, SGD, Adagrad; in place and functional) on DTensor parameters.

``torch.optim.AdamW(params, fused=True)`` (torchtitan's default) steps every
parameter of a device and dtype in one kernel call. Why that call is right on
each rank's pieces, and where each list is moved first:
[Note: fused steps on pieces] (above :func:`fused_step`); the functional
kernels ``torch.compile`` runs: [Note: functional fused kernels] (above
:func:`_wrap_outputs`); the ``.out`` overloads: [Note: the .out variants].
"""

from __future__ import annotations

from typing import Any

import torch

from hp_dtensor.dtensor import DTensor
from hp_dtensor.layout import Layout
from hp_dtensor.ops.dispatch import SPECIAL
from hp_dtensor.ops.meshes import on_mesh
from hp_dtensor.placements import Partial, Replicate
from hp_dtensor.redistribute import redistribute_local

__all__ = ["fused_step"]

aten = torch.ops.aten

# Per op: the positional lists that follow the parameter's placements, and those of scalars.
_ADAM = (range(1, 5), (5,))
_SGD = (range(1, 3), ())
_ADAGRAD = (range(1, 3), (3,))
_LISTS = {"_fused_adam": _ADAM, "_fused_adamw": _ADAM, "_fused_sgd": _SGD, "_fused_adagrad": _ADAGRAD}


def _whole(value: Any) -> Any:
    """A scalar operand's local value: a DTensor is taken whole (replicated)."""
    if isinstance(value, DTensor):
        local, _ = redistribute_local(value._local, value._layout, (Replicate(),) * value._layout.mesh.ndim)
        return local
    return value


def _follow(dt: DTensor, param: DTensor, func: Any, in_place: bool) -> torch.Tensor:
    """``dt``'s local tensor on ``param``'s mesh and placements; ``in_place``: ``dt`` itself is moved."""
    layout = param._layout
    local, current = dt._local, dt._layout
    if current.mesh is not layout.mesh and current.mesh != layout.mesh:
        moved = on_mesh(dt, layout.mesh, func)
        local, current = moved._local, moved._layout
    if current.placements != layout.placements:
        local, current = redistribute_local(local, current, layout.placements)
    if in_place:
        dt._local, dt._layout = local, current
    return local


# [Note: functional fused kernels]
# The functional kernels (``_fused_adam``, ``_fused_adamw``, ``_fused_sgd``,
# ``_fused_adagrad``: what functionalization turns the in-place ones into under
# ``torch.compile``) leave their arguments alone and return new lists in the
# order of the arguments. The same per-element moves apply, but to copies (the
# caller's gradient and states keep their placements), and output list ``k``
# element ``i`` takes argument ``k`` element ``i``'s place: the parameter's
# layout for the parameter-shaped lists, the step counter's own for the steps.
def _wrap_outputs(
    result: Any, args: tuple[Any, ...], params: list[DTensor], following: range
) -> tuple[list[Any], ...]:
    """A functional kernel's output lists, each element placed like its argument (see the note)."""
    wrapped: list[list[Any]] = []
    for k, values in enumerate(result):
        out: list[Any] = []
        for i, value in enumerate(values):
            source = args[k][i]
            if k == 0 or (k in following and isinstance(source, DTensor)):
                out.append(DTensor(value, params[i]._layout))
            elif isinstance(source, DTensor):  # a step counter: whole on its own mesh
                mesh = source._layout.mesh
                whole = (Replicate(),) * mesh.ndim
                out.append(DTensor(value, Layout(mesh, whole, tuple(value.shape), value.stride())))
            else:
                out.append(value)
        wrapped.append(out)
    return tuple(wrapped)


# [Note: fused steps on pieces]
# ``torch.optim.AdamW(params, fused=True)`` (torchtitan's default) steps every
# parameter of a device and dtype in one kernel call: ``_fused_adamw_(params,
# grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, *, lr, ...,
# grad_scale=None, found_inf=None)``, in place, returning nothing. The update
# of element ``i`` reads and writes only element ``i`` of each list, so it is
# right on any piece as long as the parameter, its gradient and its states are
# the same piece: each of them is taken to its parameter's placements (a
# ``Partial`` gradient is reduced, a state saved under other placements is
# moved), on the parameter's mesh or a permutation of it (see
# [Note: permuted meshes] in :mod:`hp_dtensor.ops.meshes`). The moved DTensors are updated
# themselves, so the kernel's writes land in them. Then the kernel runs once
# over every element's local tensor, whatever mesh each lives on.
#
# The step counters, ``lr``, ``grad_scale`` and ``found_inf`` are scalars each
# rank holds whole: plain tensors, or DTensors taken whole (replicated).
def fused_step(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run a fused optimizer kernel over DTensor parameters ([Note: fused steps on pieces]).

    In place for ``_fused_*_`` (returns ``None``); the functional kernels
    return their output lists as DTensors placed like their arguments.
    """
    name = func._schema.name.split("::")[-1]
    out_variant = func._overloadname.endswith("out")  # see [Note: the .out variants]
    functional = not name.endswith("_") and not out_variant
    following, scalars = _LISTS[name.rstrip("_")]
    params = list(args[0])
    if out_variant:
        _check_out(kwargs["out"], params, func)
    local_lists: list[list[Any]] = [[] for _ in args]
    for i, param in enumerate(params):
        if not isinstance(param, DTensor):
            raise TypeError(
                f"{func}: parameter {i} is a plain {type(param).__name__} among DTensor parameters; a fused "
                "step runs over one kind: put plain and DTensor parameters in separate optimizers (or "
                "distribute every parameter)."
            )
        if any(isinstance(p, Partial) for p in param._layout.placements):
            raise ValueError(
                f"{func}: parameter {i} has placements {list(param._layout.placements)}; an optimizer step "
                "on a Partial parameter would update each rank's term, not the value. Redistribute the "
                "parameter to Shard/Replicate placements first."
            )
        local_lists[0].append(param._local)
        for index in following:
            values = args[index]
            if len(values) == 0:  # max_exp_avg_sqs without amsgrad
                continue
            value = values[i]
            if isinstance(value, DTensor):
                value = _follow(value, param, func, in_place=not functional)
            local_lists[index].append(value)
        for index in scalars:
            local_lists[index].append(_whole(args[index][i]))
    local_args = tuple(local_lists[i] if isinstance(a, (list, tuple)) else a for i, a in enumerate(args))
    local_kwargs = {k: _whole(v) for k, v in kwargs.items() if k != "out"}
    if out_variant:
        local_kwargs["out"] = _out_locals(kwargs["out"], params, func)
    result = func(*local_args, **local_kwargs)
    if functional:
        return _wrap_outputs(result, args, params, following)
    return None


# [Note: the .out variants]
# ``_fused_adam.out`` and its kin (``tensor_lr_out`` too) are the overloads
# torch generates beside each functional kernel; torch's optimizers never call
# them (they call the in-place ``torch._fused_adam_``, and ``torch.compile``
# functionalizes that into ``_fused_adam``), so they are reached only by
# calling ``torch.ops.aten._fused_adam.out(...)`` by hand. They write each
# stepped parameter into ``out[i]`` (on CPU torch 2.13 leaves the parameters
# and the states as they were). Here the lists are placed as for the in-place
# kernel (their schema marks the states mutable), each ``out[i]`` is moved to
# its parameter's placements in place, and the kernel runs once over the
# local tensors: whatever it writes lands in the caller's DTensors.
def _check_out(out: Any, params: list[Any], func: Any) -> None:
    """``out`` holds one DTensor per parameter; checked before anything is moved."""
    if len(out) != len(params):
        raise ValueError(
            f"{func}: out has {len(out)} tensors for {len(params)} parameters; pass one output tensor per "
            "parameter, placed like it."
        )
    for i, target in enumerate(out):
        if not isinstance(target, DTensor):
            raise TypeError(
                f"{func}: out[{i}] is a plain {type(target).__name__} for a DTensor parameter; pass DTensors "
                "placed like the parameters (for example torch.empty_like(param))."
            )


def _out_locals(out: Any, params: list[DTensor], func: Any) -> list[torch.Tensor]:
    """The local tensors of ``out``, each moved (in place) to its parameter's placements."""
    return [_follow(target, param, func, in_place=True) for target, param in zip(out, params, strict=True)]


def _register() -> None:
    for name in [n + suffix for n in _LISTS for suffix in ("", "_")]:
        packet = getattr(aten, name, None)
        if packet is None:  # an older torch without this kernel
            continue
        for overload in packet.overloads():
            op = getattr(packet, overload)
            # mypy cannot type a lambda with a bound default against SPECIAL's two-argument Callable.
            SPECIAL[op] = lambda args, kwargs, op=op: fused_step(op, args, kwargs)  # type: ignore[misc]


_register()
