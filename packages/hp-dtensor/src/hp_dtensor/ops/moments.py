"""Variance and standard deviation: ``var``, ``std``, ``var_mean``, ``std_mean`` (``.correction``).

Over dims that are not sharded each rank computes on its piece, and shards of
the other dims pass. A sharded reduced dim is not gathered: see [Note:
distributed variance]. Partial inputs are reduced first (a variance is not a
sum of terms).

[Note: distributed variance]
The variance over a dim cut across ranks is computed in two exact passes, as
on one process: one ``all_reduce(sum)`` of the local sums gives the mean
(the element count ``N`` is known from the global shape, so uneven cuts and
empty pieces need nothing more), and one ``all_reduce(sum)`` of the local
sums of ``|x - mean|^2`` gives ``M2``; the variance is
``M2 / max(N - correction, 0)``. Each all-reduce is of the output's size,
against gathering the whole dim (torch's DTensor). Low-precision inputs are
computed in float32, as torch's kernels accumulate.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import hp_core.collectives as hc
import torch
from hp_core.distributed import mesh_group

from hp_dtensor.ops.dispatch import Decision, LocalCall, OpCall, register
from hp_dtensor.ops.reductions import kernel_reduce_decision

if TYPE_CHECKING:
    from hp_dtensor.placements import Placement

__all__ = ["moments_rule"]

aten = torch.ops.aten
_LOW_PRECISION = (torch.float16, torch.bfloat16)
_WITH_MEAN = {aten.var_mean.correction, aten.std_mean.correction}
_ROOT = {aten.std.correction, aten.std_mean.correction}


def _dims(value: Any, ndim: int) -> list[int]:
    if value is None or (isinstance(value, (list, tuple)) and len(value) == 0):
        return list(range(ndim))
    if isinstance(value, int):
        value = [value]
    return sorted({int(d) % max(ndim, 1) for d in value})


def _options(call: OpCall | LocalCall, ndim: int) -> tuple[list[int], float, bool]:
    """(dims, correction, keepdim) of a ``.correction`` overload."""
    dim = call.args[1] if len(call.args) > 1 else call.kwargs.get("dim")
    correction = call.kwargs.get("correction")
    return (
        _dims(dim, ndim),
        1.0 if correction is None else float(correction),
        bool(call.kwargs.get("keepdim")),
    )


def _kernel(
    dims: list[int], correction: float, keepdim: bool, mesh_dims: list[int]
) -> Callable[[LocalCall], Any]:
    """See [Note: distributed variance]."""

    def run(call: LocalCall) -> Any:
        x = call.args[0]
        layout = call.layout(0)
        groups = [mesh_group(layout.mesh, m) for m in mesh_dims]
        work = x.float() if x.dtype in _LOW_PRECISION else x
        count = math.prod(layout.shape[d] for d in dims)
        total = work.sum(dims, keepdim=True).contiguous()
        for group in groups:
            hc.all_reduce(total, "sum", group)
        mean = total / count
        m2 = (work - mean).abs().square().sum(dims, keepdim=True).contiguous()
        for group in groups:
            hc.all_reduce(m2, "sum", group)
        result = m2 / max(count - correction, 0)
        if call.func in _ROOT:
            result = result.sqrt()
        real = x.abs().dtype if x.is_complex() else x.dtype
        if not keepdim:
            result, mean = result.squeeze(dims), mean.squeeze(dims)
        result = result.to(real)
        if call.func in _WITH_MEAN:
            return result, mean.to(x.dtype)
        return result

    return run


@register(aten.var.correction, aten.std.correction, aten.var_mean.correction, aten.std_mean.correction)
def moments_rule(call: OpCall) -> Decision:
    """Other dims' shards pass; sharded reduced dims use [Note: distributed variance]."""
    position = call.position_of(call.args[0])
    layout = call.layout(position)
    dims, correction, keepdim = _options(call, layout.ndim)
    inputs, out, cutting = kernel_reduce_decision(layout, dims, keepdim)
    kernel = _kernel(dims, correction, keepdim, cutting) if cutting else None
    outputs: list[tuple[Placement, ...] | None] = [out, out] if call.func in _WITH_MEAN else [out]
    return Decision(inputs={position: inputs}, outputs=outputs, kernel=kernel)
