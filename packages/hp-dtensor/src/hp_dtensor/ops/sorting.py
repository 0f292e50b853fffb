"""Sorting and arg-reductions: sort (argsort), topk, kthvalue, argmax, argmin.

Each works along one dim, and rows of the other dims are independent, so a
shard of any other dim stays where it is and the op runs locally (values and
indices both keep it; ``keepdim=False`` renumbers the dims after ``dim``).
A shard of ``dim`` itself: [Note: sorting along a sharded dim].
Partial inputs are reduced first (the order of a sum is not the sum of orders).
"""

from __future__ import annotations

from typing import Any

import hp_core.collectives as hc
import torch
from hp_core.distributed import mesh_group

from hp_dtensor.ops.dispatch import Decision, LocalCall, OpCall, register
from hp_dtensor.ops.reductions import _select_kernel
from hp_dtensor.placements import Partial, Placement, Replicate, Shard

__all__ = ["along_dim_order_rule", "arg_reduction_rule"]

aten = torch.ops.aten
R = Replicate()
_MAX_INDEX = torch.iinfo(torch.int64).max


def _argument(call: OpCall, index: int, name: str, default: Any) -> Any:
    """A schema argument given by position or by keyword."""
    if len(call.args) > index:
        return call.args[index]
    return call.kwargs.get(name, default)


def _keep_other_dims(
    placements: tuple[Placement, ...], dim: int, keepdim: bool, gather_dim: bool
) -> tuple[list[Placement], list[Placement], bool]:
    """(input, output) placements and whether ``dim`` stays sharded (only when not ``gather_dim``)."""
    inputs: list[Placement] = []
    out: list[Placement] = []
    sharded = False
    for placement in placements:
        if isinstance(placement, Shard) and placement.dim != dim:
            inputs.append(placement)
            out.append(Shard(placement.dim - (0 if keepdim or placement.dim < dim else 1)))
        elif isinstance(placement, Shard) and not gather_dim:
            sharded = True
            inputs.append(placement)
            out.append(R)
        else:
            inputs.append(R)
            out.append(R)
    return inputs, out, sharded


# op -> (index of the dim argument, its default, index of keepdim or None when the dim stays)
_ORDER_OPS = {
    aten.sort.default: (1, -1, None),
    aten.sort.stable: (2, -1, None),  # sort.stable(self, *, stable, dim, descending): keyword-only
    aten.topk.default: (2, -1, None),
    aten.kthvalue.default: (2, -1, 3),
}


# [Note: sorting along a sharded dim]
# - ``sort`` / ``topk`` / ``kthvalue`` gather that mesh dim only (as torch's
#   DTensor does): the order of a row needs the whole row.
# - ``argmax`` / ``argmin`` keep it: each rank reduces its piece and two
#   all-reduces pick the winner, the smallest global index among ranks holding
#   the extreme value, which is PyTorch's first occurrence (see [Note: max with
#   indices] in ``ops/reductions.py``, whose kernel this reuses). Without
#   ``dim`` (the flat index of the extreme of the whole tensor) every sharded
#   mesh dim takes part: each rank turns its local winner's position into a
#   global flat index, and the same two all-reduces run over each of those
#   mesh dims (see [Note: flat arg-reduction]).
@register(*_ORDER_OPS)
def along_dim_order_rule(call: OpCall) -> Decision:
    """sort / topk / kthvalue: local along an unsharded dim; that mesh dim gathered otherwise."""
    position = call.positions[0]
    layout = call.layout(position)
    dim_index, default, keep_index = _ORDER_OPS[call.func]
    dim = int(_argument(call, dim_index, "dim", default)) % max(layout.ndim, 1)
    keepdim = True if keep_index is None else bool(_argument(call, keep_index, "keepdim", False))
    inputs, out, _ = _keep_other_dims(layout.placements, dim, keepdim, gather_dim=True)
    return Decision(inputs={position: tuple(inputs)}, outputs=[tuple(out), tuple(out)])


def _dim_arg_kernel(kind: str) -> Any:
    """``argmax(x, dim)`` with ``dim`` sharded: the values-and-indices kernel of ``max(x, dim)``."""
    select = _select_kernel(kind)
    paired = aten.max.dim if kind == "max" else aten.min.dim

    def run(call: LocalCall) -> torch.Tensor:
        x = call.args[0]
        dim = int(_local_argument(call, 1, "dim"))
        keepdim = bool(_local_argument(call, 2, "keepdim", False))
        inner = LocalCall(paired, (x, dim, keepdim), {}, (call.layout(0), None, None), {}, call.mesh)
        return select(inner)[1]

    return run


def _local_argument(call: LocalCall, index: int, name: str, default: Any = None) -> Any:
    if len(call.args) > index:
        return call.args[index]
    return call.kwargs.get(name, default)


# [Note: flat arg-reduction]
# ``argmax(x)`` is the first flat position of the maximum. A rank's local
# winner at local coordinates ``c`` sits at global coordinates ``c + offset``,
# whose row-major flat index in the global shape orders positions as PyTorch
# does; the winner over ranks is the largest value and, among ties, the
# smallest flat index. An empty piece offers the lowest value and an index
# larger than any, so it never wins.
def _flat_arg_kernel(kind: str) -> Any:
    """``argmax(x)`` / ``argmin(x)`` of a sharded ``x`` (see [Note: flat arg-reduction])."""

    def run(call: LocalCall) -> torch.Tensor:
        x = call.args[0]
        keepdim = bool(_local_argument(call, 2, "keepdim", False))
        layout = call.layout(0)
        if x.numel() == 0:
            info = torch.finfo(x.dtype) if x.is_floating_point() else torch.iinfo(x.dtype)
            value = torch.tensor(info.min if kind == "max" else info.max, dtype=x.dtype, device=x.device)
            flat = torch.tensor(_MAX_INDEX, dtype=torch.int64, device=x.device)
        else:
            local = call.func(x)
            value = x.reshape(-1)[local].clone()
            coords = torch.unravel_index(local, x.shape)
            flat = torch.zeros((), dtype=torch.int64, device=x.device)
            for size, offset, coord in zip(layout.shape, layout.local_offset(), coords, strict=True):
                flat = flat * size + coord + offset
        groups = [mesh_group(layout.mesh, m) for m, p in enumerate(layout.placements) if isinstance(p, Shard)]
        best = value.clone()
        for group in groups:
            hc.all_reduce(best, kind, group)
        candidate = torch.where(value == best, flat, torch.full_like(flat, _MAX_INDEX))
        for group in groups:
            hc.all_reduce(candidate, "min", group)
        return candidate.reshape([1] * layout.ndim) if keepdim else candidate

    return run


def arg_reduction_rule(call: OpCall) -> Decision:
    """argmax / argmin: local along an unsharded dim; a sharded dim (or none) all-reduces."""
    position = call.positions[0]
    layout = call.layout(position)
    kind = "max" if call.func is aten.argmax.default else "min"
    dim = _argument(call, 1, "dim", None)
    keepdim = bool(_argument(call, 2, "keepdim", False))
    if dim is None or layout.ndim == 0:
        inputs = [R if isinstance(p, Partial) else p for p in layout.placements]
        sharded = any(isinstance(p, Shard) for p in inputs)
        return Decision(
            inputs={position: tuple(inputs)},
            outputs=[(R,) * layout.mesh.ndim],
            kernel=_flat_arg_kernel(kind) if sharded else None,
        )
    dim = int(dim) % layout.ndim
    inputs, out, sharded = _keep_other_dims(layout.placements, dim, keepdim, gather_dim=False)
    kernel = _dim_arg_kernel(kind) if sharded else None
    return Decision(inputs={position: tuple(inputs)}, outputs=[tuple(out)], kernel=kernel)


register(aten.argmax.default, aten.argmin.default)(arg_reduction_rule)
