"""Average and max pooling (2-D and 3-D, so 1-D too; adaptive ones too) on an input cut along a spatial dim.

The pooling rules of :mod:`hp_dtensor.ops.spatial` keep batch and channel
cuts; a mesh dim that cuts a spatial dim asks here for a halo plan
(:mod:`hp_dtensor.ops.halo`) and, when one exists, the output stays cut on
that dim: each rank pools its piece extended by its neighbours' border rows
([Note: pooling on extended pieces]). The backward ops need no exchange of
the input's values, only the reverse halo of the input gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hp_dtensor.ops.dispatch import LocalCall, OpCall
from hp_dtensor.ops.halo import (
    HaloDim,
    Window,
    extend,
    extended_shape,
    fold_back,
    full_args,
    global_indices,
    local_indices,
    narrow_output,
    pad_output_grad,
    per_dim,
    plan_halos,
)

__all__ = ["pool_halos", "pool_kernel"]

aten = torch.ops.aten

# op -> (kind, index of self, kernel_size, stride, padding, dilation or None, ceil_mode)
_AVG = (1, 2, 3, None, 4)
_MAX = (1, 2, 3, 4, 5)
_AVG_BACKWARD = (2, 3, 4, None, 5)
_MAX_BACKWARD = (2, 3, 4, 5, 6)
_POOLS: dict[Any, tuple[str, int, tuple[int, int, int, int | None, int]]] = {
    aten.avg_pool2d.default: ("avg", 0, _AVG),
    aten.avg_pool3d.default: ("avg", 0, _AVG),
    aten.max_pool2d_with_indices.default: ("max", 0, _MAX),
    aten.max_pool3d_with_indices.default: ("max", 0, _MAX),
    aten.avg_pool2d_backward.default: ("avg_backward", 1, _AVG_BACKWARD),
    aten.avg_pool3d_backward.default: ("avg_backward", 1, _AVG_BACKWARD),
    aten.max_pool2d_with_indices_backward.default: ("max_backward", 1, _MAX_BACKWARD),
    aten.max_pool3d_with_indices_backward.default: ("max_backward", 1, _MAX_BACKWARD),
}


# adaptive op -> (kind, index of self); a max backward's indices are its third argument
_ADAPTIVE: dict[Any, tuple[str, int]] = {
    aten._adaptive_avg_pool2d.default: ("adaptive", 0),
    aten._adaptive_avg_pool3d.default: ("adaptive", 0),
    aten.adaptive_max_pool2d.default: ("adaptive_max", 0),
    aten.adaptive_max_pool3d.default: ("adaptive_max", 0),
    aten._adaptive_avg_pool2d_backward.default: ("avg_backward", 1),
    aten._adaptive_avg_pool3d_backward.default: ("avg_backward", 1),
    aten.adaptive_max_pool2d_backward.default: ("max_backward", 1),
    aten.adaptive_max_pool3d_backward.default: ("max_backward", 1),
}


# [Note: adaptive pools that line up]
# An adaptive pool of ``L`` rows to ``n`` outputs pools output ``o`` over the
# rows ``[floor(o L / n), ceil((o + 1) L / n))``. When ``n`` divides ``L``
# those are the windows of a plain pool with kernel and stride ``k = L / n``,
# so the halo plan is that pool's, every extended piece starts and ends on a
# window's edge, and the adaptive op on it with ``(e1 - e0) / k`` outputs
# pools the same windows. Other sizes (windows of varying length that
# overlap) are gathered.
def _adaptive_halos(call: OpCall, lead: int) -> dict[int, HaloDim]:
    _, self_at = _ADAPTIVE[call.func]
    args = full_args(call.func, call.args, call.kwargs)
    layout = call.layout(call.position_of(args[self_at]))
    if self_at == 0:
        out_size = [int(v) for v in args[1]]
    else:
        out_size = list(call.layout(call.position_of(args[0])).shape[lead:])
    sizes = layout.shape[lead:]
    if len(out_size) != len(sizes):
        return {}  # malformed sizes: the local op raises its own error on whole tensors
    aligned = [n > 0 and length % n == 0 for length, n in zip(sizes, out_size, strict=True)]
    windows = [
        Window(length // n, length // n, 0) if ok else Window(1, 1, 0)
        for length, n, ok in zip(sizes, out_size, aligned, strict=True)
    ]
    plans = plan_halos(layout, list(range(lead, layout.ndim)), windows)
    return {m: plan for m, plan in plans.items() if aligned[plan.dim - lead]}


def pool_halos(call: OpCall, lead: int) -> dict[int, HaloDim]:
    """Halo plans of the mesh dims cutting a spatial dim of the pooled input (none for other ops)."""
    if call.func in _ADAPTIVE:
        return _adaptive_halos(call, lead)
    spec = _POOLS.get(call.func)
    if spec is None:
        return {}
    _, self_at, (kernel_at, stride_at, padding_at, dilation_at, ceil_at) = spec
    args = full_args(call.func, call.args, call.kwargs)
    layout = call.layout(call.position_of(args[self_at]))
    k = layout.ndim - lead
    kernel = per_dim(args[kernel_at], k)
    stride = per_dim(args[stride_at], k, kernel)
    padding = per_dim(args[padding_at], k)
    dilation = per_dim(args[dilation_at], k) if dilation_at is not None else [1] * k
    if not len(kernel) == len(stride) == len(padding) == len(dilation) == k:
        return {}  # malformed sizes: the local op raises its own error on whole tensors
    ceil_mode = bool(args[ceil_at])
    windows = [Window(dilation[i] * (kernel[i] - 1) + 1, stride[i], padding[i], ceil_mode) for i in range(k)]
    return plan_halos(layout, list(range(lead, layout.ndim)), windows)


# [Note: pooling on extended pieces]
# Forward: the input piece is extended ([Note: halo exchange] in
# :mod:`hp_dtensor.ops.halo`), pooled with the op's own arguments, and this
# rank's outputs are kept; max pooling's indices count positions in the
# extended plane and are moved to the whole plane, as the op on the whole
# tensor gives them. Backward: the output gradient (and the indices, moved
# back) are placed among the extended piece's outputs with zeros elsewhere,
# the op's backward runs on a zero stand-in of the extended input (these
# backward ops read only its shape), and the input gradient's halo rows are
# summed back to their owners.
def pool_kernel(func: Any, plans: list[HaloDim], lead: int) -> Callable[[LocalCall], Any]:
    """The local pooling op (or its backward) on halo-extended pieces ([Note: pooling on extended pieces]).

    ``lead`` counts the dims before the pooled ones (batch and channel).
    """
    kind, self_at = _ADAPTIVE[func] if func in _ADAPTIVE else _POOLS[func][:2]
    indices_at = 2 if func in _ADAPTIVE else 7

    def run(call: LocalCall) -> Any:
        args = full_args(call.func, call.args, call.kwargs)
        layout = call.layout(self_at)
        if kind in ("avg", "max", "adaptive", "adaptive_max"):
            for plan in plans:
                args[0] = extend(args[0], layout, plan)
            plane = list(args[0].shape[lead:])
            if kind.startswith("adaptive"):  # [Note: adaptive pools that line up]
                out_size = [int(v) for v in args[1]]
                for plan in plans:
                    out_size[plan.dim - lead] = plan.local_outputs(layout.my_coordinate()[plan.mesh_dim])
                args[1] = out_size
            result = call.func(*args)
            if kind in ("avg", "adaptive"):
                for plan in plans:
                    result = narrow_output(result, layout, plan)
                return result
            values, indices = result
            for plan in plans:
                values, indices = narrow_output(values, layout, plan), narrow_output(indices, layout, plan)
            return values, global_indices(indices, plane, layout, plans)
        shape = extended_shape(args[1].shape, layout, plans)
        plane = shape[lead:]
        if kind == "max_backward":
            args[indices_at] = local_indices(args[indices_at], plane, layout, plans)
        for plan in plans:
            args[0] = pad_output_grad(args[0], layout, plan)
            if kind == "max_backward":
                args[indices_at] = pad_output_grad(args[indices_at], layout, plan)
        args[1] = args[1].new_zeros(shape)
        grad = call.func(*args)
        for plan in reversed(plans):
            grad = fold_back(grad, layout, plan)
        return grad

    return run
