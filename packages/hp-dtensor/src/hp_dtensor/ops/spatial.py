"""Spatial ops: pooling, upsampling, padding, pixel / channel shuffles, grid sampling.

These ops treat every ``(n, c)`` plane of a ``(N, C, *spatial)`` (or
``(C, *spatial)``) tensor on its own, so a shard of a batch or channel dim is
the answer for its own planes: each rank runs the op on its piece, forward
and backward, with no communication (the backward's gradient, input and max
pooling indices are cut alike; the indices count positions inside a plane,
so they need no offset). A shard of a spatial dim needs the neighbours'
border rows: average and max pooling (adaptive ones whose windows line up
too; :mod:`hp_dtensor.ops.pool_halo`), upsampling by an integer scale
(:mod:`hp_dtensor.ops.upsample_halo`) and reflection / replication padding
(:mod:`hp_dtensor.ops.pad_halo`) take a halo exchange and stay cut; the other
ops, and cuts without a halo plan, gather that mesh dim (a redistribution,
not the fallback). The shuffles, the grid sampler and linear partials: [Note:
spatial ops one by one], [Note: grid sampler gradients], [Note: grid sampler pieces].
"""

from __future__ import annotations

from typing import Any

import torch

from hp_dtensor.layout import Layout
from hp_dtensor.ops.dispatch import Decision, OpCall, register
from hp_dtensor.ops.halo import HaloDim
from hp_dtensor.ops.holding import first_that_holds
from hp_dtensor.ops.pad_halo import INDEX_PAD_OPS, index_pad_halos, index_pad_kernel
from hp_dtensor.ops.pool_halo import pool_halos, pool_kernel
from hp_dtensor.ops.upsample_halo import UPSAMPLE_OPS, upsample_halos, upsample_kernel
from hp_dtensor.placements import Partial, Placement, Replicate, Shard

__all__ = ["grid_sampler_rule", "plane_rule", "shuffle_rule"]

aten = torch.ops.aten
R = Replicate()


def _returns(func: Any) -> int:
    """How many tensors the op returns (max pooling returns values and indices)."""
    tensor = torch._C.TensorType.get()
    return sum(1 for r in func._schema.returns if r.type.isSubtypeOf(tensor))


def _linear_partial(placement: Placement, linear: bool) -> bool:
    return linear and isinstance(placement, Partial) and placement.reduce_op in ("sum", "avg")


# op -> (number of spatial dims, positional index of the output's global size or None, linear)
_PLANE_OPS: dict[Any, tuple[int, int | None, bool]] = {}


def _planes(names: str, k: int, size_arg: int | None = None, linear: bool = False) -> None:
    for name in names.split():
        packet = getattr(aten, name, None)
        if packet is None:  # an op this torch does not have
            continue
        for overload in ("default", "vec"):
            op = getattr(packet, overload, None)
            if op is not None:
                _PLANE_OPS[op] = (k, size_arg, linear)


_planes("upsample_nearest1d _upsample_nearest_exact1d upsample_linear1d", 1, linear=True)
_planes("upsample_nearest2d _upsample_nearest_exact2d upsample_bilinear2d upsample_bicubic2d", 2, linear=True)
_planes("_upsample_bilinear2d_aa _upsample_bicubic2d_aa _upsample_lanczos2d_aa", 2, linear=True)
_planes("upsample_nearest3d _upsample_nearest_exact3d upsample_trilinear3d", 3, linear=True)
_planes(
    "upsample_nearest1d_backward _upsample_nearest_exact1d_backward upsample_linear1d_backward",
    1,
    size_arg=2,
    linear=True,
)
_planes(
    "upsample_nearest2d_backward _upsample_nearest_exact2d_backward upsample_bilinear2d_backward "
    "upsample_bicubic2d_backward _upsample_bilinear2d_aa_backward _upsample_bicubic2d_aa_backward "
    "_upsample_lanczos2d_aa_backward",
    2,
    size_arg=2,
    linear=True,
)
_planes(
    "upsample_nearest3d_backward _upsample_nearest_exact3d_backward upsample_trilinear3d_backward",
    3,
    size_arg=2,
    linear=True,
)
_planes("avg_pool1d adaptive_avg_pool1d", 1, linear=True)
_planes("avg_pool2d _adaptive_avg_pool2d", 2, linear=True)
_planes("avg_pool3d _adaptive_avg_pool3d", 3, linear=True)
_planes("max_pool1d max_pool1d_with_indices adaptive_max_pool1d reflection_pad1d replication_pad1d", 1)
_planes("max_pool2d max_pool2d_with_indices adaptive_max_pool2d max_unpool2d", 2)
_planes("reflection_pad2d replication_pad2d", 2)
_planes("max_pool3d max_pool3d_with_indices adaptive_max_pool3d max_unpool3d", 3)
_planes("reflection_pad3d replication_pad3d", 3)
# backward ops whose tensors are (grad_output, self[, indices]): every one cut alike on the leading dims
_planes("avg_pool2d_backward _adaptive_avg_pool2d_backward max_pool2d_with_indices_backward", 2)
_planes("adaptive_max_pool2d_backward reflection_pad2d_backward replication_pad2d_backward", 2)
_planes("avg_pool3d_backward _adaptive_avg_pool3d_backward max_pool3d_with_indices_backward", 3)
_planes("adaptive_max_pool3d_backward reflection_pad3d_backward replication_pad3d_backward", 3)
_planes("reflection_pad1d_backward replication_pad1d_backward", 1)


def _halo_kernel(func: Any, plans: list[HaloDim], lead: int) -> Any:
    """The local op on halo-extended pieces: upsampling's, padding's or pooling's."""
    if func in UPSAMPLE_OPS:
        return upsample_kernel(func, plans, lead)
    if func in INDEX_PAD_OPS:
        return index_pad_kernel(func, plans)
    return pool_kernel(func, plans, lead)


def _halos(call: OpCall, lead: int) -> dict[int, HaloDim]:
    """The halo plans of whichever windowed op ``call`` is (none for the others)."""
    return pool_halos(call, lead) or upsample_halos(call, lead) or index_pad_halos(call, lead)


@register(*_PLANE_OPS)
def plane_rule(call: OpCall) -> Decision:
    """Leading (batch, channel) shards pass on every tensor; spatial shards take a halo or are gathered."""
    k, size_arg, linear = _PLANE_OPS[call.func]
    positions = call.positions
    layouts = [call.layout(p) for p in positions]
    lead = layouts[0].ndim - k
    alike = all(
        layout.ndim - k == lead and layout.shape[:lead] == layouts[0].shape[:lead] for layout in layouts
    )
    mesh = layouts[0].mesh
    single = len(positions) == 1
    returns = max(_returns(call.func), 1)
    halos = _halos(call, lead) if alike else {}

    def build(gathered: frozenset[int]) -> Decision:
        targets: list[Placement] = []
        used: list[HaloDim] = []
        for m in range(mesh.ndim):
            current = [layout.placements[m] for layout in layouts]
            cut = next((p for p in current if isinstance(p, Shard) and p.dim < lead), None)
            if cut is not None and alike and m not in gathered:
                targets.append(cut)
            elif m in halos and m not in gathered:
                targets.append(Shard(halos[m].dim))
                used.append(halos[m])
            elif single and _linear_partial(current[0], linear):
                targets.append(current[0])
            else:
                targets.append(R)
        placements = tuple(targets)
        return Decision(
            inputs={p: placements for p in positions},
            outputs=[placements] * returns,
            size_arg=size_arg,
            kernel=_halo_kernel(call.func, used, lead) if used else None,
        )

    # see [Note: empty pieces]: no channel is refused on CPU, no batch only by some meta kernels
    return first_that_holds(call, build, nonempty=True, empty_batch_ok=lead >= 2)


# [Note: spatial ops one by one]
# Per op:
#
# - ``pixel_shuffle`` / ``pixel_unshuffle`` move elements between the channel
#   dim and blocks of ``r`` rows and columns: channel ``c`` of the output
#   reads channels ``c * r * r ...`` of the input, row ``h`` the rows ``h * r
#   ...``. Each is a contiguous block, so *every* dim keeps its shard when
#   each rank's pieces hold whole blocks (the sizes divide); a mesh dim whose
#   cut does not is gathered (see :mod:`hp_dtensor.ops.holding`).
# - ``channel_shuffle`` permutes the channels: only the channel dim must be
#   whole; batch and spatial dims keep their shards.
# - ``grid_sampler_2d`` / ``_3d`` read ``input`` ``(N, C, *in)`` at the points
#   of ``grid`` ``(N, *out, k)``: the batch keeps its shard on both; a cut
#   channel dim of ``input`` stays cut with a replicated grid; a cut output
#   point dim of ``grid`` stays cut with a replicated input (each rank samples
#   its own points). See [Note: grid sampler gradients] for the backward.
# - Linear ops of one tensor (average pooling, every upsampling mode, and
#   their backward ops) keep a ``Partial("sum")`` / ``Partial("avg")`` input
#   partial; everything else reduces a partial first.
def _keep_shards_but(call: OpCall, whole: set[int], nonempty: bool) -> Decision:
    """The input's shards pass to the output, but dims in ``whole``, and cuts that do not hold."""
    position = call.positions[0]
    layout = call.layout(position)

    def build(gathered: frozenset[int]) -> Decision:
        placements = tuple(
            p if isinstance(p, Shard) and p.dim not in whole and m not in gathered else R
            for m, p in enumerate(layout.placements)
        )
        return Decision(inputs={position: placements}, outputs=[placements])

    return first_that_holds(call, build, nonempty=nonempty)


@register(aten.pixel_shuffle.default, aten.pixel_unshuffle.default)
def shuffle_rule(call: OpCall) -> Decision:
    """Every dim keeps its shard where each rank's piece holds whole ``r x r`` blocks."""
    return _keep_shards_but(call, set(), nonempty=True)  # see [Note: empty pieces]


@register(aten.channel_shuffle.default, aten.native_channel_shuffle.default)
def channel_shuffle_rule(call: OpCall) -> Decision:
    """Channels are permuted: only dim 1 must be whole."""
    return _keep_shards_but(call, {1}, nonempty=False)


def _grid_cut(inp: Layout, grid: Layout, m: int) -> str | None:
    """Which cut mesh dim ``m`` keeps: "batch", "channel", "points" or None (gathered)."""
    for layout, channel_ok in ((inp, True), (grid, False)):
        p = layout.placements[m]
        if isinstance(p, Shard):
            if p.dim == 0:
                return "batch"
            if p.dim == 1 and channel_ok:
                return "channel"
            if not channel_ok and p.dim < grid.ndim - 1:
                return "points"
    return None


def _columns(rows: list[tuple[Placement, ...]]) -> list[tuple[Placement, ...]]:
    """Per-mesh-dim rows of placements (one per tensor) turned into one placement tuple per tensor."""
    return [tuple(column) for column in zip(*rows, strict=True)]


# [Note: grid sampler pieces]
# The grid sampler takes any piece, empty ones included (no batch, no
# channel, no point), so its rules keep every cut without asking
# :func:`first_that_holds`, whose meta runs would cost here: torch's meta
# kernel for these ops is a Python decomposition (about a second per call for
# bicubic on the 2-core machine).
@register(aten.grid_sampler_2d.default, aten.grid_sampler_3d.default)
def grid_sampler_rule(call: OpCall) -> Decision:
    """Batch cut on both; channel cut with the grid whole; point cut with the input whole."""
    inp_pos, grid_pos = call.position_of(call.args[0]), call.position_of(call.args[1])
    inp, grid = call.layout(inp_pos), call.layout(grid_pos)

    def build(gathered: frozenset[int]) -> Decision:
        rows: list[tuple[Placement, ...]] = []  # per mesh dim: (input, grid, output)
        for m in range(inp.mesh.ndim):
            cut = None if m in gathered else _grid_cut(inp, grid, m)
            point = grid.placements[m]
            if cut == "batch":
                rows.append((Shard(0), Shard(0), Shard(0)))
            elif cut == "channel":
                rows.append((Shard(1), R, Shard(1)))
            elif cut == "points" and isinstance(point, Shard):
                rows.append((R, point, Shard(point.dim + 1)))
            else:
                rows.append((R, R, R))
        i_t, g_t, out = _columns(rows)
        return Decision(inputs={inp_pos: i_t, grid_pos: g_t}, outputs=[out])

    return build(frozenset())  # see [Note: grid sampler pieces]


# [Note: grid sampler gradients]
# ``grid_sampler_*_backward(grad_output, input, grid)`` returns the input's
# and the grid's gradients. With the channels cut, each rank's grid gradient
# sums over its own channels only: the grid gradient is ``Partial("sum")``.
# With the output points cut, each rank scatters into the whole input from its
# own points: the input gradient is ``Partial("sum")``. Both are exact and
# cost nothing until read (autograd accumulates partials as they are).
@register(aten.grid_sampler_2d_backward.default, aten.grid_sampler_3d_backward.default)
def grid_sampler_backward_rule(call: OpCall) -> Decision:
    """The forward's cuts; the other operand's gradient is a partial sum ([Note: grid sampler gradients])."""
    go_pos, inp_pos, grid_pos = (call.position_of(a) for a in call.args[:3])
    grad_out, inp, grid = (call.layout(p) for p in (go_pos, inp_pos, grid_pos))
    k = grid.ndim - 2
    summed = Partial("sum")

    def cut_of(m: int) -> tuple[str | None, int]:
        """The cut of mesh dim ``m`` and, for a point cut, the grid dim it cuts."""
        p, q = grad_out.placements[m], grid.placements[m]
        if isinstance(p, Shard):
            return ("batch" if p.dim == 0 else "channel" if p.dim == 1 else "points"), p.dim - 1
        return _grid_cut(inp, grid, m), q.dim if isinstance(q, Shard) else 1

    def build(gathered: frozenset[int]) -> Decision:
        # per mesh dim: (grad_output, input, grid, grad_input, grad_grid)
        rows: list[tuple[Placement, ...]] = []
        for m in range(inp.mesh.ndim):
            cut, dim = (None, 0) if m in gathered else cut_of(m)
            if cut == "points" and 1 <= dim <= k:
                rows.append((Shard(dim + 1), R, Shard(dim), summed, Shard(dim)))
            elif cut == "batch":
                rows.append((Shard(0),) * 5)
            elif cut == "channel":
                rows.append((Shard(1), Shard(1), R, Shard(1), summed))
            else:
                rows.append((R,) * 5)
        go_t, i_t, g_t, gi, gg = _columns(rows)
        return Decision(inputs={go_pos: go_t, inp_pos: i_t, grid_pos: g_t}, outputs=[gi, gg])

    return build(frozenset())  # see [Note: grid sampler pieces]
