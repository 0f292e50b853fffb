"""Fused optimizer kernels (``_fused_adam_``, ``_fused_adamw_``, ``_fused_sgd_``) on DTensor parameters.

``torch.optim.AdamW(params, fused=True)`` (torchtitan's default) steps every
parameter of a device and dtype in one kernel call: ``_fused_adamw_(params,
grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, *, lr, ...,
grad_scale=None, found_inf=None)``, in place, returning nothing. The update
of element ``i`` reads and writes only element ``i`` of each list, so it is
right on any piece as long as the parameter, its gradient and its states are
the same piece: each of them is taken to its parameter's placements (a
``Partial`` gradient is reduced, a state saved under other placements is
moved), on the parameter's mesh or a permutation of it (see [Note: permuted
meshes] in :mod:`hp_dtensor.ops.meshes`). The moved DTensors are updated
themselves, so the kernel's writes land in them. Then the kernel runs once
over every element's local tensor, whatever mesh each lives on.

The step counters, ``lr``, ``grad_scale`` and ``found_inf`` are scalars each
rank holds whole: plain tensors, or DTensors taken whole (replicated).
"""

from __future__ import annotations

from typing import Any

import torch

from hp_dtensor.dtensor import DTensor
from hp_dtensor.ops.dispatch import SPECIAL
from hp_dtensor.ops.meshes import on_mesh
from hp_dtensor.placements import Partial, Replicate
from hp_dtensor.redistribute import redistribute_local

__all__ = ["fused_step"]

aten = torch.ops.aten

# Per op: the positional lists that follow the parameter's placements, and those of scalars.
_ADAM = (range(1, 5), (5,))
_SGD = (range(1, 3), ())
_LISTS = {"_fused_adam_": _ADAM, "_fused_adamw_": _ADAM, "_fused_sgd_": _SGD}


def _whole(value: Any) -> Any:
    """A scalar operand's local value: a DTensor is taken whole (replicated)."""
    if isinstance(value, DTensor):
        local, _ = redistribute_local(value._local, value._layout, (Replicate(),) * value._layout.mesh.ndim)
        return local
    return value


def _follow(dt: DTensor, param: DTensor, func: Any) -> torch.Tensor:
    """``dt`` moved (itself) to ``param``'s mesh and placements; its local tensor."""
    layout = param._layout
    if dt._layout.mesh is not layout.mesh and dt._layout.mesh != layout.mesh:
        moved = on_mesh(dt, layout.mesh, func)
        dt._local, dt._layout = moved._local, moved._layout
    if dt._layout.placements != layout.placements:
        dt._local, dt._layout = redistribute_local(dt._local, dt._layout, layout.placements)
    return dt._local


def fused_step(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Run a fused optimizer kernel over DTensor parameters in place (see the module docstring)."""
    following, scalars = _LISTS[func._schema.name.split("::")[-1]]
    params = list(args[0])
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
            local_lists[index].append(_follow(value, param, func) if isinstance(value, DTensor) else value)
        for index in scalars:
            local_lists[index].append(_whole(args[index][i]))
    local_args = tuple(local_lists[i] if isinstance(a, (list, tuple)) else a for i, a in enumerate(args))
    local_kwargs = {k: _whole(v) for k, v in kwargs.items()}
    func(*local_args, **local_kwargs)
    return None


def _register() -> None:
    for name in _LISTS:
        packet = getattr(aten, name, None)
        if packet is None:  # an older torch without this kernel
            continue
        for overload in packet.overloads():
            op = getattr(packet, overload)
            # mypy cannot type a lambda with a bound default against SPECIAL's two-argument Callable.
            SPECIAL[op] = lambda args, kwargs, op=op: fused_step(op, args, kwargs)  # type: ignore[misc]


_register()
