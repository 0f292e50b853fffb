"""Upsampling (nearest, nearest-exact, (bi/tri)linear, bicubic) of an input cut along a spatial dim.

With an integer scale ``s`` the output row ``o`` reads input rows near
``o / s``, the same rule everywhere along the dim, so a rank upsampling its
piece extended by a row or two of each neighbour gets exactly its own
output rows, which stay cut ([Note: upsampling on extended pieces]). The
backward sums the halo rows' gradients back to their owners, as pooling's
does. ``align_corners=True`` (whose scale is ``(L - 1) / (sL - 1)``, not a
shift of one rule), a non-integer scale and the antialiased ops have no plan
and are gathered.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hp_dtensor.layout import Layout, chunk_sizes
from hp_dtensor.ops.dispatch import LocalCall, OpCall
from hp_dtensor.ops.halo import HaloDim, Window, extend, fold_back, full_args, narrow_output, pad_output_grad
from hp_dtensor.placements import Shard

__all__ = ["UPSAMPLE_OPS", "plan_upsample", "upsample_halos", "upsample_kernel"]

aten = torch.ops.aten

# op -> (rows of context each side an output reads beyond o / s, backward)
UPSAMPLE_OPS: dict[Any, tuple[int, bool]] = {}
for _names, _margin in (
    ("upsample_nearest1d upsample_nearest2d upsample_nearest3d", 0),
    ("_upsample_nearest_exact1d _upsample_nearest_exact2d _upsample_nearest_exact3d", 0),
    ("upsample_linear1d upsample_bilinear2d upsample_trilinear3d", 1),
    ("upsample_bicubic2d", 2),
):
    for _name in _names.split():
        for _backward, _suffix in ((False, ""), (True, "_backward")):
            _packet = getattr(aten, _name + _suffix, None)
            if _packet is not None:
                UPSAMPLE_OPS[_packet.default] = (_margin, _backward)


# [Note: upsampling on extended pieces]
# With ``align_corners=False`` and a scale ``s`` (the output is ``sL`` rows)
# output ``o`` reads the input at ``src = (o + 1/2) / s - 1/2`` (nearest:
# ``o / s``, nearest-exact: ``(o + 1/2) / s``): rows ``floor(src)`` and the
# next for linear, ``floor(src) - 1 ... floor(src) + 2`` for bicubic, clamped
# to the input. The rule is the same at every output once ``o`` is shifted by
# ``s * e0`` and the input by ``e0``: the op on input rows ``[e0, e1)`` gives
# the outputs ``[s * e0, s * e1)`` exactly, wherever their reads stay inside
# ``[e0, e1)`` or meet the tensor's own ends (the local op clamps at the
# piece's ends as the whole op does at the tensor's). Rank ``r`` owns outputs
# ``[O_r, O_r+1)`` by ``torch.chunk``, so it reads ``[floor(O_r / s) - m,
# ceil(O_r+1 / s) + m)`` clamped, ``m`` rows of context (0 nearest, 1
# linear, 2 bicubic), a few rows of its neighbours, and keeps its outputs
# ``[O_r - s * e0, O_r+1 - s * e0)``. The plan is a halo
# (:class:`~hp_dtensor.ops.halo.HaloDim`) whose window is a transposed one of
# stride and extent ``s`` (each input row gives ``s`` outputs), which is what
# the backward's output-gradient placement reads. The backward op runs with
# the extended piece's sizes on the output gradient placed among the extended
# piece's outputs, and the input gradient's halo goes home by
# :func:`~hp_dtensor.ops.halo.fold_back`.
def plan_upsample(length: int, ranks: int, scale: int, margin: int) -> HaloDim | None:
    """The halo of upsampling ``length`` cut rows by ``scale`` ([Note: upsampling on extended pieces])."""
    sizes, out_sizes = chunk_sizes(length, ranks), chunk_sizes(length * scale, ranks)
    if ranks < 2 or scale < 1 or min(sizes) == 0 or min(out_sizes) == 0:
        return None
    starts = tuple(sum(sizes[:r]) for r in range(ranks + 1))
    outs = tuple(sum(out_sizes[:r]) for r in range(ranks + 1))
    ends: list[tuple[int, int]] = []
    for r in range(ranks):
        e0 = max(0, outs[r] // scale - margin)
        e1 = min(length, -(-outs[r + 1] // scale) + margin)
        if e0 < starts[max(r - 1, 0)] or e1 > starts[min(r + 2, ranks)]:
            return None  # rows from beyond a neighbour: gather instead
        if max(e0, starts[r]) >= min(e1, starts[r + 1]):
            return None  # reads none of its own rows: gather instead
        ends.append((e0, e1))
    shift = tuple(scale * e0 for e0, _ in ends)
    return HaloDim(starts, tuple(ends), outs, shift, window=Window(scale, scale, 0, transposed=True))


def _named(func: Any, args: list[Any], prefix: str) -> list[tuple[int, Any]]:
    """``(index, value)`` of the schema arguments whose names start with ``prefix``."""
    return [(i, args[i]) for i, a in enumerate(func._schema.arguments) if a.name.startswith(prefix)]


def upsample_halos(call: OpCall, lead: int) -> dict[int, HaloDim]:
    """Halo plans of the mesh dims cutting a spatial dim of an upsampling op (or its backward)."""
    spec = UPSAMPLE_OPS.get(call.func)
    if spec is None:
        return {}
    margin, backward = spec
    args = full_args(call.func, call.args, call.kwargs)
    layout: Layout = call.layout(call.position_of(args[0]))
    if any(bool(value) for _, value in _named(call.func, args, "align_corners")):
        return {}  # see the module docstring
    out_size = [int(v) for v in args[1]]
    in_size = [int(v) for v in args[2]][lead:] if backward else list(layout.shape[lead:])
    scales = [value for _, value in _named(call.func, args, "scales")]
    plans: dict[int, HaloDim] = {}
    for m, p in enumerate(layout.placements):
        if not isinstance(p, Shard) or p.dim < lead:
            continue
        if sum(1 for q in layout.placements if isinstance(q, Shard) and q.dim == p.dim) != 1:
            continue
        i = p.dim - lead
        length, out = in_size[i], out_size[i]
        scale = out // length if length else 0
        if scale < 1 or out != scale * length:
            continue
        if i < len(scales) and scales[i] is not None and float(scales[i]) != float(scale):
            continue
        plan = plan_upsample(length, layout.mesh.shape[m], scale, margin)
        if plan is not None:
            plans[m] = HaloDim(plan.starts, plan.ends, plan.outs, plan.shift, m, p.dim, plan.window)
    return plans


def upsample_kernel(func: Any, plans: list[HaloDim], lead: int) -> Callable[[LocalCall], Any]:
    """The local upsampling op (or its backward) on halo-extended pieces."""
    _, backward = UPSAMPLE_OPS[func]

    def run(call: LocalCall) -> Any:
        args = full_args(call.func, call.args, call.kwargs)
        layout = call.layout(0)
        out_size = [int(v) for v in args[1]]
        if not backward:
            for plan in plans:
                args[0] = extend(args[0], layout, plan)
                e0, e1 = plan.ends[layout.my_coordinate()[plan.mesh_dim]]
                out_size[plan.dim - lead] = plan.window.count(e1 - e0)
            args[1] = out_size
            result = call.func(*args)
            for plan in plans:
                result = narrow_output(result, layout, plan)
            return result
        in_size = [int(v) for v in args[2]]
        for plan in plans:
            e0, e1 = plan.ends[layout.my_coordinate()[plan.mesh_dim]]
            in_size[plan.dim] = e1 - e0
            out_size[plan.dim - lead] = plan.window.count(e1 - e0)
            args[0] = pad_output_grad(args[0], layout, plan)
        args[1], args[2] = out_size, in_size
        grad = call.func(*args)
        for plan in reversed(plans):
            grad = fold_back(grad, layout, plan)
        return grad

    return run
