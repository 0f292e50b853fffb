"""Upsampling (nearest, nearest-exact, (bi/tri)linear, bicubic) of an input cut along a spatial dim.

With an integer scale ``s`` the output row ``o`` reads input rows near
``o / s``, the same rule everywhere along the dim, so a rank upsampling its
piece extended by a row or two of each neighbour gets exactly its own
output rows, which stay cut ([Note: upsampling on extended pieces]). The
backward sums the halo rows' gradients back to their owners, as pooling's
does. Linear upsampling with ``align_corners=True`` (whose scale ``(L - 1)
/ (n - 1)`` is no shift of one rule) is computed by hand from the two rows
each output reads, any output size ([Note: aligned corners on a cut dim]);
bicubic with aligned corners, a non-integer scale of the others and the
antialiased ops have no plan and are gathered.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hp_dtensor.layout import Layout
from hp_dtensor.ops.dispatch import LocalCall, OpCall
from hp_dtensor.ops.halo import (
    HaloDim,
    Window,
    extend,
    fold_back,
    full_args,
    line_reads,
    narrow_output,
    pad_output_grad,
)
from hp_dtensor.placements import Shard

__all__ = [
    "UPSAMPLE_OPS",
    "corner_taps",
    "plan_corners",
    "plan_upsample",
    "upsample_halos",
    "upsample_kernel",
]

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
    if scale < 1:
        return None

    def reads(first: int, stop: int) -> tuple[int, int]:
        return max(0, first // scale - margin), min(length, -(-stop // scale) + margin)

    line = line_reads(length, ranks, length * scale, reads)
    if line is None:
        return None
    shift = tuple(scale * e0 for e0, _ in line.ends)
    return HaloDim(line.starts, line.ends, line.outs, shift, window=Window(scale, scale, 0, transposed=True))


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
    corners = any(bool(value) for _, value in _named(call.func, args, "align_corners"))
    if corners and margin != 1:
        return {}  # bicubic with aligned corners: see the module docstring
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
        if corners:  # [Note: aligned corners on a cut dim]
            found = plan_corners(length, layout.mesh.shape[m], out)
            if found is not None:
                plans[m] = HaloDim(found.starts, found.ends, found.outs, found.shift, m, p.dim, found.window)
            continue
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
        if any(bool(value) for _, value in _named(call.func, args, "align_corners")):
            return _corners(args[0], layout, plans, lead, out_size, None if not backward else args[2])
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


# [Note: aligned corners on a cut dim]
# With ``align_corners=True`` linear upsampling of ``L`` rows to ``n`` makes
# output ``o`` read the input at ``src = o (L - 1) / (n - 1)``: rows ``i0 =
# floor(src)`` and ``i0 + 1`` (clamped to ``L - 1``), weighted ``1 - t`` and
# ``t`` with ``t = src - i0``. The step ``(L - 1) / (n - 1)`` is not ``1 /
# s``, so the op on a piece of rows (whose own step is ``(e1 - e0 - 1) /
# (n' - 1)``) gives other sample points, whatever the scale: the local op
# cannot be reused as the ``align_corners=False`` plan does. The two taps are
# computed here instead, in integers (``i0 = o (L - 1) // (n - 1)``, exact,
# so the plan and the kernel agree on every row), and each rank blends the
# rows ``index_select`` picks from its piece extended by the rows it reads
# of its neighbours: ``[i0(O_r), i0(O_r+1 - 1) + 2)`` clamped, at most a row
# or two, any output size. Dims that are not cut are blended the same way
# over their whole length (linear interpolation is separable, so dim by dim
# is the op; the values match PyTorch's to rounding). The backward adds each
# output gradient onto its two rows (``index_add_``) and sends the halo
# rows' sums home. Bicubic with aligned corners reads four rows with cubic
# weights and is gathered.
def corner_taps(
    first: int, stop: int, length: int, out: int, dtype: torch.dtype, device: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows ``i0``, ``i1`` and weights ``t`` of outputs ``[first, stop)``.

    See [Note: aligned corners on a cut dim]; integer arithmetic for the rows,
    so the plan and every kernel agree on them exactly.
    """
    scaled = torch.arange(first, stop, device=device) * (length - 1)
    steps = max(out - 1, 1)
    i0 = torch.div(scaled, steps, rounding_mode="floor")
    t = (scaled - i0 * steps).to(dtype) / steps
    return i0, (i0 + 1).clamp(max=length - 1), t


def plan_corners(length: int, ranks: int, out: int) -> HaloDim | None:
    """The halo of an ``align_corners=True`` linear upsampling of a cut dim of ``length`` rows to ``out``."""
    if out < 2:
        return None

    def reads(first: int, stop: int) -> tuple[int, int]:
        return first * (length - 1) // (out - 1), min(length, (stop - 1) * (length - 1) // (out - 1) + 2)

    line = line_reads(length, ranks, out, reads)
    return None if line is None else HaloDim(line.starts, line.ends, line.outs, line.shift)


def _corners(
    x: torch.Tensor,
    layout: Layout,
    plans: list[HaloDim],
    lead: int,
    out_size: list[int],
    in_size: list[int] | None,
) -> torch.Tensor:
    """Aligned-corner linear upsampling (``in_size`` None) or its backward, dim by dim on extended pieces."""
    cut = {p.dim: p for p in plans}
    if in_size is None:
        for p in plans:
            x = extend(x, layout, p)
    shape = list(x.shape)
    for i, out in enumerate(out_size):
        dim = lead + i
        plan = cut.get(dim)
        first, stop, e0, e1 = 0, out, 0, layout.shape[dim] if in_size is None else int(in_size[dim])
        if plan is not None:
            r = layout.my_coordinate()[plan.mesh_dim]
            first, stop, (e0, e1) = plan.outs[r], plan.outs[r + 1], plan.ends[r]
        length = plan.starts[-1] if plan is not None else e1
        i0, i1, t = corner_taps(first, stop, length, out, x.dtype, x.device)
        i0, i1 = i0 - e0, i1 - e0
        t = t.reshape([-1] + [1] * (x.ndim - 1 - dim))
        if in_size is None:
            x = x.index_select(dim, i0) * (1 - t) + x.index_select(dim, i1) * t
        else:
            shape[dim] = e1 - e0
            x = x.new_zeros(shape).index_add_(dim, i0, x * (1 - t)).index_add_(dim, i1, x * t)
    if in_size is not None:
        for p in reversed(plans):
            x = fold_back(x, layout, p)
    return x
