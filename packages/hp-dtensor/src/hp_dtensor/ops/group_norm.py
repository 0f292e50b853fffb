"""Group normalisation (``native_group_norm`` and its backward) on batch, channel and spatial cuts.

See [Note: group norm plans].
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import hp_core.collectives as hc
import torch
from hp_core.distributed import mesh_group

from hp_dtensor.layout import Layout
from hp_dtensor.ops.dispatch import Decision, LocalCall, OpCall, register
from hp_dtensor.placements import Partial, Placement, Replicate, Shard

__all__ = ["group_norm_backward_rule", "group_norm_rule"]


# [Note: group norm plans]
# ``group_norm`` normalises each ``(sample, group)`` block of a ``(N, C, *)``
# input over the group's ``C / group`` channels and every spatial position.
# A cut of the batch dim keeps whole blocks on each rank: every rank runs the
# op on its samples, and the statistics (``mean``, ``rstd``, ``(N, group)``)
# take the same cut. A cut of the channel dim keeps whole blocks only when
# each rank's channels start and end on group boundaries ([Note: whole groups
# per rank]); then the op runs on the rank's groups, with ``weight`` and
# ``bias`` cut alike and the statistics cut on their group dim. A cut spatial
# dim stays cut: the blocks' statistics are combined across ranks in one
# small all-gather forward and one all-reduce backward ([Note: group norm
# over a spatial cut]). Any other cut (channels across a group boundary, a
# partial) is gathered on that mesh dim, a redistribution rather than the
# fallback.
#
# The op takes ``N``, ``C``, ``HxW`` and ``group`` as numbers, so a kernel
# passes the local ones. In the backward the batch cut makes the weight and
# bias gradients partial sums (each rank sums over its own samples), as does
# a spatial cut; under a channel cut they keep the channel cut. torch's DTensor gathers the batch cut
# of this op (one all-gather each way), where this rule sends nothing.

aten = torch.ops.aten
R = Replicate()
SUM = Partial("sum")


# [Note: whole groups per rank]
# Channels ``[g * k, (g + 1) * k)`` form group ``g`` (``k = C / group``). A
# rank whose channel piece starts at a multiple of ``k`` and holds a
# non-zero multiple of ``k`` channels holds whole groups, and its statistics
# are its groups' rows. The statistics are ``(N, group)`` tensors cut on dim
# 1 like ``torch.chunk`` of ``group``, so that cut must give each rank
# exactly its channel count over ``k``: checked for every mesh coordinate,
# not assumed (``C = 6, group = 3`` over 2 ranks cuts channels 3 + 3, across
# the middle group, and is gathered).
def _coords(mesh: Any) -> list[tuple[int, ...]]:
    return list(itertools.product(*(range(n) for n in mesh.shape)))


def _whole_groups(inp: Layout, placements: tuple[Placement, ...], group: int) -> bool:
    """Whether the channel cut of ``placements`` gives every rank whole, non-empty groups."""
    channels = inp.shape[1]
    if group <= 0 or channels % group:
        return False
    per_group = channels // group
    cut = inp.with_placements(placements)
    stats = Layout(inp.mesh, [p if p == Shard(1) else R for p in placements], (inp.shape[0], group))
    for coord in _coords(inp.mesh):
        size, start = cut.local_shape_at(coord)[1], cut.local_offset_at(coord)[1]
        if size == 0 or size % per_group or start % per_group:
            return False
        if stats.local_shape_at(coord)[1] != size // per_group:
            return False
    return True


def _input_cuts(layouts: list[Layout], group: int) -> tuple[Placement, ...]:
    """Per mesh dim the cut kept: Shard(0), Shard(1) (whole groups), a spatial Shard or Replicate."""
    inp = layouts[0]
    cuts: list[Placement] = []
    for m in range(inp.mesh.ndim):
        seen = [layout.placements[m] for layout in layouts]
        spatial = [p for p in seen if isinstance(p, Shard) and p.dim >= 2]
        if Shard(0) in seen:
            cuts.append(Shard(0))
        elif Shard(1) in seen:
            cuts.append(Shard(1))
        elif spatial:
            cuts.append(spatial[0])
        else:
            cuts.append(R)
    kept = tuple(cuts)
    if Shard(1) in kept and not _whole_groups(inp, kept, group):
        kept = tuple(R if p == Shard(1) else p for p in kept)
    return kept


def _stat_placements(cuts: tuple[Placement, ...]) -> tuple[Placement, ...]:
    """``mean`` / ``rstd`` (``(N, group)``): the batch and channel cuts; whole over a spatial cut."""
    return tuple(p if p in (Shard(0), Shard(1)) else R for p in cuts)


def _param_placements(cuts: tuple[Placement, ...]) -> tuple[Placement, ...]:
    """``weight`` / ``bias`` (``(C,)``): cut with the channels, whole under a batch cut."""
    return tuple(Shard(0) if p == Shard(1) else R for p in cuts)


def _local_sizes(x: torch.Tensor, channels: int, group: int) -> tuple[int, int, int, int]:
    """This rank's ``(N, C, HxW, group)`` for an input piece of a tensor with ``channels`` / ``group``."""
    per_group = channels // group
    return x.shape[0], x.shape[1], math.prod(x.shape[2:]), x.shape[1] // per_group


def _spatial(layout: Layout) -> tuple[list[tuple[Any, int]], int]:
    """(process group, size) of each mesh dim cutting a spatial dim, and the global spatial size."""
    groups = [
        (mesh_group(layout.mesh, m), layout.mesh.size(m))
        for m, p in enumerate(layout.placements)
        if isinstance(p, Shard) and p.dim >= 2
    ]
    return groups, math.prod(layout.shape[2:])


def _merged_moments(blocks: torch.Tensor, groups: list[tuple[Any, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each block's mean and squared deviations summed over all ranks' parts (see the Note below)."""
    count = torch.full(blocks.shape[:2], float(blocks.shape[-1]), dtype=blocks.dtype, device=blocks.device)
    mean = blocks.mean(-1) if blocks.shape[-1] else torch.zeros_like(count)
    m2 = ((blocks - mean.unsqueeze(-1)) ** 2).sum(-1)
    for group, size in groups:
        mine = torch.stack([count, mean, m2]).contiguous()
        gathered = mine.new_empty((size * 3, *mine.shape[1:]))
        hc.all_gather_into_tensor(gathered, mine, group)
        counts, means, m2s = gathered.view(size, 3, *mine.shape[1:]).unbind(1)
        count = counts.sum(0)
        mean = (counts * means).sum(0) / count
        m2 = (m2s + counts * (means - mean) ** 2).sum(0)
    return mean, m2


def _summed(value: torch.Tensor, groups: list[tuple[Any, int]]) -> torch.Tensor:
    value = value.contiguous()
    for group, _ in groups:
        hc.all_reduce(value, "sum", group)
    return value


def _channel_view(t: torch.Tensor | None, ndim: int) -> torch.Tensor | float:
    """A ``(C,)`` parameter shaped to broadcast over ``(N, C, *)`` (1 when absent)."""
    return 1.0 if t is None else t.view(1, -1, *([1] * (ndim - 2)))


# [Note: group norm over a spatial cut]
# A cut spatial dim splits every ``(sample, group)`` block across ranks. In
# the forward each rank takes its part's count, mean and sum of squared
# deviations per block, one all-gather of those (three numbers per block and
# rank) gives every rank all of them, and each merges them exactly (Chan's
# pairwise formula: ``M2 = sum_k M2_k + n_k (mean_k - mean)^2``, as stable as
# the op's own one-pass moments); each rank then normalises its part, and the
# statistics are whole on every rank. The backward needs two sums per block,
# of ``dy * w`` and of ``dy * w * x``, stacked into one all-reduce, and
# computes ``dx = rstd * (dyw - mean(dyw) - xhat * mean(dyw * xhat))`` on its
# part; the weight and bias gradients are per-rank sums over its part, a
# ``Partial("sum")``. torch's DTensor gathers the input instead.
def _forward_kernel(call: LocalCall) -> Any:
    x, weight, bias = call.args[0], call.args[1], call.args[2]
    n, c, hxw, group = _local_sizes(x, call.args[4], call.args[6])
    groups, total = _spatial(call.layout(0))
    if not groups:
        return call.func(x, weight, bias, n, c, hxw, group, call.args[7])
    count = (c // group) * total
    compute = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    blocks = x.to(compute).reshape(n, group, -1)
    mean, m2 = _merged_moments(blocks, groups)
    rstd = (m2 / count + call.args[7]).rsqrt()
    y = ((blocks - mean.unsqueeze(-1)) * rstd.unsqueeze(-1)).reshape(x.shape)
    y = y * _channel_view(weight, x.dim()) + (0.0 if bias is None else _channel_view(bias, x.dim()))
    return y.to(x.dtype), mean.to(x.dtype), rstd.to(x.dtype)


def _positions(call: OpCall, args: list[Any]) -> list[int | None]:
    """Flat positions of the DTensor arguments among ``args`` (None for a missing one)."""
    from hp_dtensor.dtensor import DTensor

    return [call.position_of(a) if isinstance(a, DTensor) else None for a in args]


@register(aten.native_group_norm.default)
def group_norm_rule(call: OpCall) -> Decision:
    """Batch cuts and whole-group channel cuts stay, with the local ``N, C, HxW, group``."""
    x_pos, w_pos, b_pos = _positions(call, list(call.args[:3]))
    assert x_pos is not None
    cuts = _input_cuts([call.layout(x_pos)], call.args[6])
    params = _param_placements(cuts)
    stats = _stat_placements(cuts)
    inputs = {x_pos: cuts}
    for pos in (w_pos, b_pos):
        if pos is not None:
            inputs[pos] = params
    return Decision(inputs=inputs, outputs=[cuts, stats, stats], kernel=_forward_kernel)


def _backward_kernel(call: LocalCall) -> Any:
    grad, x, mean, rstd, weight = call.args[:5]
    n, c, hxw, group = _local_sizes(x, call.args[6], call.args[8])
    groups, total = _spatial(call.layout(1))
    mask = call.args[9]
    if not groups:
        return call.func(grad, x, mean, rstd, weight, n, c, hxw, group, mask)
    count = (c // group) * total  # see [Note: group norm over a spatial cut]
    compute = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    g, xs = grad.to(compute), x.to(compute)
    mu, r = mean.to(compute).unsqueeze(-1), rstd.to(compute).unsqueeze(-1)
    dyw = (g * _channel_view(None if weight is None else weight.to(compute), x.dim())).reshape(n, group, -1)
    blocks = xs.reshape(n, group, -1)
    sums = _summed(torch.stack([dyw.sum(-1), (dyw * blocks).sum(-1)]), groups)
    mean_dyw = sums[0].unsqueeze(-1) / count
    mean_dyw_xhat = r * (sums[1].unsqueeze(-1) - mu * sums[0].unsqueeze(-1)) / count
    xhat = (blocks - mu) * r
    dims = [0, *range(2, x.dim())]
    grad_input = r * (dyw - mean_dyw - xhat * mean_dyw_xhat) if mask[0] else None
    grad_input = None if grad_input is None else grad_input.reshape(x.shape).to(x.dtype)
    grad_weight = (g * xhat.reshape(x.shape)).sum(dims).to(x.dtype) if mask[1] else None
    grad_bias = g.sum(dims).to(x.dtype) if mask[2] else None
    return grad_input, grad_weight, grad_bias


@register(aten.native_group_norm_backward.default)
def group_norm_backward_rule(call: OpCall) -> Decision:
    """The forward's cuts; a batch cut makes the weight and bias gradients partial sums."""
    positions = _positions(call, list(call.args[:5]))
    g_pos, x_pos, mean_pos, rstd_pos, w_pos = positions
    assert g_pos is not None and x_pos is not None
    cuts = _input_cuts([call.layout(x_pos), call.layout(g_pos)], call.args[8])
    params = _param_placements(cuts)
    stats = _stat_placements(cuts)
    param_grads = tuple(SUM if p != Shard(1) and p != R else q for p, q in zip(cuts, params, strict=True))
    inputs = {p: cuts for p in (g_pos, x_pos) if p is not None}
    inputs.update({p: stats for p in (mean_pos, rstd_pos) if p is not None})
    if w_pos is not None:
        inputs[w_pos] = params
    return Decision(inputs=inputs, outputs=[cuts, param_grads, param_grads], kernel=_backward_kernel)
