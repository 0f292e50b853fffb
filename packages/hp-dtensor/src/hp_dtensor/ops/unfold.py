"""Sliding windows: ``Tensor.unfold`` (+ copy, backward), ``im2col`` (``F.unfold``), ``col2im`` (``F.fold``).

See [Note: unfold plans].
"""

from __future__ import annotations

import itertools
import math

import torch

from hp_dtensor.layout import Layout
from hp_dtensor.ops.dispatch import Decision, OpCall, register
from hp_dtensor.placements import Partial, Placement, Replicate, Shard

__all__ = ["col2im_rule", "im2col_rule", "unfold_backward_rule", "unfold_rule"]


# [Note: unfold plans]
# ``x.unfold(dim, size, step)`` replaces dim ``dim`` by the window index and
# appends the window's ``size`` elements as a new last dim. Every other dim is
# copied as it is, so a cut of any dim but ``dim`` stays local, with the same
# tensor dim cut in the output (and in ``unfold_backward``'s gradient, which
# puts the windows back). Windows cross a cut of ``dim`` itself, so that mesh
# dim is gathered. The ops are linear: a ``Partial("sum")`` / ``"avg"`` stays.
#
# ``im2col`` (``F.unfold``) turns ``(N, C, H, W)`` into ``(N, C * k, L)``
# (``k = kh * kw`` kernel offsets, ``L`` windows), channel-major: channel
# ``c`` fills rows ``[c * k, (c + 1) * k)``; ``col2im`` (``F.fold``) is the
# inverse (and each is the other's gradient). A batch cut stays local. A
# channel cut stays local when each rank's ``k``-row blocks are exactly its
# piece of the row dim, checked at every mesh coordinate ([Note: channel
# blocks]); spatial cuts (the windows cross them) are gathered. Unbatched
# inputs (``(C, H, W)`` / ``(C * k, L)``) have the channel dim first. torch's
# DTensor gathers every one of these cuts (one all-gather).

aten = torch.ops.aten
R = Replicate()


def _keep_but(placements: tuple[Placement, ...], dim: int) -> tuple[Placement, ...]:
    """Every cut but one of ``dim`` stays; linear partials stay; the rest is gathered."""
    linear = ("sum", "avg")
    return tuple(
        p
        if (isinstance(p, Shard) and p.dim != dim) or (isinstance(p, Partial) and p.reduce_op in linear)
        else R
        for p in placements
    )


@register(aten.unfold.default, aten.unfold_copy.default)
def unfold_rule(call: OpCall) -> Decision:
    """Cuts of every dim but the unfolded one stay, on the same dim of the output."""
    position = call.positions[0]
    layout = call.layout(position)
    placements = _keep_but(layout.placements, call.args[1] % max(layout.ndim, 1))
    return Decision(inputs={position: placements}, outputs=[placements])


@register(aten.unfold_backward.default)
def unfold_backward_rule(call: OpCall) -> Decision:
    """The windows' gradient keeps cuts of every dim but the window index and the window's elements."""
    position = call.positions[0]
    layout = call.layout(position)
    ndim = len(call.args[1])
    placements = _keep_but(layout.placements, call.args[2] % max(ndim, 1))
    placements = tuple(R if isinstance(p, Shard) and p.dim == layout.ndim - 1 else p for p in placements)
    return Decision(inputs={position: placements}, outputs=[placements], size_arg=1)


# [Note: channel blocks]
# Under a channel cut, a rank holding channels ``[c0, c1)`` of the image
# holds rows ``[c0 * k, c1 * k)`` of the columns. The columns' row dim is cut
# like ``torch.chunk`` of ``C * k`` rows, the image's channel dim like
# ``torch.chunk`` of ``C``: the two agree when, at every mesh coordinate, the
# rank's row count is ``k`` times its channel count (their starts are sums
# of the earlier ranks' counts, so they agree too). ``C = 4`` over 2 ranks
# agrees for any ``k``; ``C = 3`` (2 + 1 channels, but ``3 * k`` rows cut
# in halves) does not, and is gathered.
def _blocks_agree(image: Layout, columns: Layout, channel: int, k: int) -> bool:
    for coord in itertools.product(*(range(n) for n in image.mesh.shape)):
        if columns.local_shape_at(coord)[channel] != k * image.local_shape_at(coord)[channel]:
            return False
    return True


def _window_placements(
    layout: Layout, channel: int, image_shape: tuple[int, ...], columns_shape: tuple[int, ...], k: int
) -> tuple[Placement, ...]:
    """Batch cuts and agreeing channel cuts; everything else gathered."""
    placements = tuple(p if isinstance(p, Shard) and p.dim <= channel else R for p in layout.placements)
    if any(p == Shard(channel) for p in placements):
        image = Layout(layout.mesh, placements, image_shape)
        columns = Layout(layout.mesh, placements, columns_shape)
        if not _blocks_agree(image, columns, channel, k):
            placements = tuple(R if p == Shard(channel) else p for p in placements)
    return placements


@register(aten.im2col.default)
def im2col_rule(call: OpCall) -> Decision:
    """Batch cuts and channel cuts on whole ``k``-row blocks stay local ([Note: channel blocks])."""
    position = call.positions[0]
    layout = call.layout(position)
    channel = layout.ndim - 3
    k = math.prod(call.args[1])
    meta = torch.empty(layout.shape, dtype=call.flat[position].dtype, device="meta")
    columns = tuple(aten.im2col.default(meta, *call.args[1:5]).shape)
    placements = _window_placements(layout, channel, layout.shape, columns, k)
    return Decision(inputs={position: placements}, outputs=[placements])


@register(aten.col2im.default)
def col2im_rule(call: OpCall) -> Decision:
    """The inverse of :func:`im2col_rule`'s placements."""
    position = call.positions[0]
    layout = call.layout(position)
    channel = layout.ndim - 2
    k = math.prod(call.args[2])
    image = (*layout.shape[:channel], layout.shape[channel] // k, *call.args[1])
    placements = _window_placements(layout, channel, image, layout.shape, k)
    return Decision(inputs={position: placements}, outputs=[placements])
