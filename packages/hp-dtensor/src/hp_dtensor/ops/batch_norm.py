"""Batch norm forward and backward with the input cut on any dim.

Batch norm normalises each channel (dim 1) over every other dim. So:

* a cut channel dim is independent work: each rank normalises its channels
  with its slice of the weight, bias and running statistics;
* a cut batch or spatial dim needs the statistics of the whole batch in
  training: see [Note: distributed batch norm] and [Note: one exchange for
  the batch statistics]. In evaluation the running statistics are used and
  every piece normalises on its own.

A channel cut may also be a ``StridedShard`` of dim 1: ``instance_norm``
views ``(N, C, *)`` as ``(1, N*C, *)``, and a cut of ``C`` becomes one of the
merged dim ([Note: strided channels]). Partial inputs are reduced first. The
running statistics are updated in place and keep their placement ([Note:
running statistics keep their placement]).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import hp_core.collectives as hc
import torch
from hp_core.distributed import mesh_group

from hp_dtensor.dtensor import DTensor
from hp_dtensor.layout import Layout, strided_rows
from hp_dtensor.ops.dispatch import SPECIAL, Decision, LocalCall, OpCall, register
from hp_dtensor.ops.strided import reads_strided
from hp_dtensor.placements import Partial, Placement, Replicate, Shard, StridedShard

if TYPE_CHECKING:
    from hp_core import DeviceMesh

__all__ = ["batch_norm_backward_rule", "batch_norm_rule"]

aten = torch.ops.aten
_LOW_PRECISION = (torch.float16, torch.bfloat16)
_GATHER_BYTES = 64 * 1024  # the statistics' gather while it is latency-bound (see the note)


class _Args(NamedTuple):
    """The forward's arguments by meaning: tensor indices and scalars."""

    weight: int | None
    bias: int | None
    running_mean: int | None
    running_var: int | None
    training: bool
    momentum: float
    eps: float
    outputs: int


def _forward_args(call: OpCall | LocalCall) -> _Args:
    a, func = call.args, call.func
    if func is aten._native_batch_norm_legit.no_stats:
        return _Args(1, 2, None, None, bool(a[3]), float(a[4]), float(a[5]), 3)
    if func is aten._native_batch_norm_legit_no_training.default:
        return _Args(1, 2, 3, 4, False, float(a[5]), float(a[6]), 3)
    if func is aten._batch_norm_with_update.default:
        return _Args(1, 2, 3, 4, True, float(a[5]), float(a[6]), 4)
    return _Args(1, 2, 3, 4, bool(a[5]), float(a[6]), float(a[7]), 3)  # native_batch_norm, _legit


# [Note: strided channels]
# ``F.instance_norm`` reaches DTensor as a view of ``(N, C, *)`` to ``(1, N*C,
# *)`` followed by batch norm (its weight, bias and running statistics
# repeated ``N`` times). A cut of ``C`` makes the merged channel dim
# ``StridedShard(1, N)``: each rank holds its ``C`` piece of every sample.
# Batch norm's channels are independent, so that cut is as local as a
# ``Shard(1)``: the per-channel vectors go to ``StridedShard(0, N)`` (a local
# cut of a replicated vector), the outputs keep the cut, and viewing back to
# ``(N, C, *)`` gives the ``Shard(1)`` back, all without communication. A
# strided cut of another dim, or one nested with another cut of the channel
# dim, is gathered as before. A whole (replicated) running statistic is read
# at this rank's rows, a copy rather than a view (the rows are not one run),
# and :func:`_sync_full` writes every rank's updated rows back.
def _cuts_channels(p: Placement) -> bool:
    return isinstance(p, (Shard, StridedShard)) and p.dim == 1


def _channel_target(layout: Layout) -> tuple[Placement, ...]:
    """Where a per-channel vector of this input goes: cut where the channel dim is cut."""
    return tuple(
        StridedShard(0, p.split_factor)
        if isinstance(p, StridedShard)
        else Shard(0)
        if _cuts_channels(p)
        else Replicate()
        for p in layout.placements
    )


def _input_target(layout: Layout) -> tuple[Placement, ...]:
    """Shards stay; a strided cut stays when it is the channel dim's only cut ([Note: strided channels])."""
    alone = sum(_cuts_channels(p) for p in layout.placements) == 1
    return tuple(
        p if isinstance(p, Shard) or (alone and _cuts_channels(p)) else Replicate() for p in layout.placements
    )


def _rows(layout: Layout, mesh_dim: int, index: int) -> list[int]:
    """The channels rank ``index`` of ``mesh_dim`` holds, that mesh dim being the channels' only cut."""
    placement = layout.placements[mesh_dim]
    if isinstance(placement, StridedShard):
        return strided_rows(layout.shape[1], placement.split_factor, layout.mesh.shape[mesh_dim], index)
    sizes = layout.line_sizes(mesh_dim, 1)
    start = sum(sizes[:index])
    return list(range(start, start + sizes[index]))


def _batch_mesh_dims(target: tuple[Placement, ...]) -> list[int]:
    return [m for m, p in enumerate(target) if isinstance(p, Shard) and p.dim != 1]


def _stat_target(
    call: OpCall, index: int | None, channel: tuple[Placement, ...]
) -> tuple[Placement, ...] | None:
    """A running statistic stays where it is when that is replicated or cut like the channels."""
    value = call.args[index] if index is not None else None
    if value is None:
        return None
    placements = call.layout(call.position_of(value)).placements
    replicate = (Replicate(),) * len(channel)
    return placements if placements in (replicate, channel) else None


def _narrow(vector: torch.Tensor | None, layout: Layout | None, x_layout: Layout) -> torch.Tensor | None:
    """This rank's channels of a per-channel vector.

    A view for a ``Shard`` cut; a copy for a strided one ([Note: strided channels]).
    """
    if vector is None or layout is None or not _is_full(layout, x_layout):
        return vector
    strided = [m for m, p in enumerate(x_layout.placements) if isinstance(p, StridedShard)]
    if strided:
        rows = _rows(x_layout, strided[0], x_layout.my_coordinate()[strided[0]])
        return vector.index_select(0, torch.tensor(rows, dtype=torch.long, device=vector.device))
    return vector.narrow(0, x_layout.local_offset()[1], x_layout.local_shape()[1])


def _is_full(layout: Layout, x_layout: Layout) -> bool:
    """Whether a per-channel vector is whole on every rank while the input's channels are cut.

    Decided from layouts alone, so every rank takes the same branch (and joins
    the same collectives), whatever its own piece's size.
    """
    channel_cut = any(_cuts_channels(p) for p in x_layout.placements)
    return channel_cut and layout.ndim == 1 and not any(p.is_shard() for p in layout.placements)


def _channel_sums(values: list[torch.Tensor], dims: list[int], groups: list[Any]) -> list[torch.Tensor]:
    """Per-channel sums of each tensor over ``dims``, all-reduced together (one collective per group)."""
    stacked = torch.stack([v.sum(dims) for v in values]).contiguous()
    for group in groups:
        hc.all_reduce(stacked, "sum", group)
    return list(stacked.unbind(0))


# [Note: one exchange for the batch statistics]
# A mean and a variance over pieces need not take two all-reduces (the sum,
# then the squared deviations from the global mean). Each rank sends its
# piece's count ``n_r``, mean ``m_r`` and sum of squared deviations ``M_r``
# (``3 C`` numbers, in float64); every rank then combines them as the parallel
# form of Welford's algorithm does: ``n = sum n_r``, ``m = sum n_r m_r / n``,
# ``M = sum (M_r + n_r (m_r - m)^2)``. That is one collective where the
# two-pass form took two, it is as stable as the two-pass form (no ``E[x^2] -
# E[x]^2`` cancellation), and an empty piece (``n_r = 0``) adds nothing. A
# batch cut over two mesh dims combines over one, then the other. The gather
# moves ``W`` times ``3 C`` numbers where the two all-reduces move about
# ``2 C`` each, so it is used while its payload is at most 64 KiB, where a
# collective costs its latency rather than its bytes; past that (thousands of
# channels, or many ranks) the two all-reduces are kept. torch's DTensor
# gathers the whole input instead.
def _batch_moments(
    work: torch.Tensor, dims: list[int], layout: Layout, batch: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and sum of squared deviations over the whole batch.

    One all_gather per batch mesh dim while the statistics are small, else
    two all-reduces: see [Note: one exchange for the batch statistics].
    """
    channels = work.shape[1]
    if math.prod(layout.mesh.shape[m] for m in batch) * 3 * channels * 8 > _GATHER_BYTES:
        groups = [mesh_group(layout.mesh, m) for m in batch]
        (total,) = _channel_sums([work], dims, groups)
        mean = total / math.prod(layout.shape[d] for d in dims)
        centred = work - mean.view(_broadcast_shape(work))
        (m2,) = _channel_sums([centred * centred], dims, groups)
        return mean, m2
    count = work.numel() // channels if channels else 0
    stats = torch.zeros(3, channels, dtype=torch.float64, device=work.device)
    if count:
        local = work.to(torch.float64)
        local_mean = local.mean(dims)
        stats[0] = count
        stats[1] = local_mean
        stats[2] = (local - local_mean.view(_broadcast_shape(work))).square().sum(dims)
    for m in batch:
        gathered = stats.new_empty((layout.mesh.shape[m], 3, channels))
        hc.all_gather_into_tensor(gathered, stats.contiguous(), mesh_group(layout.mesh, m))
        counts, means, m2s = gathered.unbind(1)
        total = counts.sum(0)
        mean = (counts * means).sum(0) / total.clamp(min=1)
        m2 = (m2s + counts * (means - mean).square()).sum(0)
        stats = torch.stack([total, mean, m2])
    return stats[1].to(work.dtype), stats[2].to(work.dtype)


def _broadcast_shape(x: torch.Tensor) -> list[int]:
    return [1, x.shape[1]] + [1] * (x.dim() - 2)


# [Note: running statistics keep their placement]
# Partial inputs are reduced first. The running statistics are updated in
# place, as on one process, and stay as they were placed: replicated running
# statistics with a cut channel dim get each rank's updated slice back by one
# ``all_gather`` of ``2 C / world`` values, so every rank holds the same, right
# values afterwards (torch's DTensor updates a temporary cut copy instead and
# skips that exchange, leaving the module's running statistics stale).
def _sync_full(full: list[tuple[torch.Tensor, torch.Tensor]], x_layout: Layout) -> None:
    """Every rank's updated channel rows into every rank's full vectors: one all_gather.

    ``full`` pairs each whole vector with this rank's updated rows of it.
    """
    cutting = [m for m, p in enumerate(x_layout.placements) if _cuts_channels(p)]
    if len(cutting) != 1:  # a channel dim cut twice: gather through the general path instead
        raise NotImplementedError("batch norm: a channel dim cut over two mesh dims with replicated stats")
    m = cutting[0]
    rows = [_rows(x_layout, m, r) for r in range(x_layout.mesh.shape[m])]
    width = max(len(r) for r in rows)
    vectors = [vector for vector, _ in full]
    mine = torch.zeros(len(full), width, dtype=vectors[0].dtype, device=vectors[0].device)
    for row, (_, piece) in enumerate(full):
        mine[row, : piece.numel()] = piece
    gathered = mine.new_empty((len(rows), len(full), width))
    hc.all_gather_into_tensor(gathered, mine, mesh_group(x_layout.mesh, m))
    merged = mine.new_empty((len(full), x_layout.shape[1]))
    for r, held in enumerate(rows):
        merged[:, held] = gathered[r, :, : len(held)]
    for row, vector in enumerate(vectors):
        vector.copy_(merged[row])


def _forward_kernel(call: LocalCall) -> Any:
    spec = _forward_args(call)
    x = call.args[0]
    x_layout = call.layout(0)
    target = x_layout.placements
    vectors = {}
    for name in ("weight", "bias", "running_mean", "running_var"):
        index = getattr(spec, name)
        value = call.args[index] if index is not None else None
        vectors[name] = _narrow(value, call.layouts[index] if index is not None else None, x_layout)
    batch = _batch_mesh_dims(target)
    if x.numel() == 0 and not (spec.training and batch):  # an empty piece with no exchange to join
        result = _empty_forward(x, spec)  # (torch's kernels refuse it; there is nothing to normalise)
    elif not spec.training or not batch:
        args = list(call.args)
        for name, value in vectors.items():
            index = getattr(spec, name)
            if index is not None:
                args[index] = value
        result = _saved_like_meta(call.func(*args, **call.kwargs), x)
    else:
        result = _train_forward(x, vectors, spec, x_layout, batch)
    if spec.training:
        full: list[tuple[torch.Tensor, torch.Tensor]] = []
        for name in ("running_mean", "running_var"):
            index, piece = getattr(spec, name), vectors[name]
            if index is not None and piece is not None and _is_full(call.layouts[index], x_layout):
                full.append((call.args[index], piece))
        if full:
            _sync_full(full, x_layout)
    return result


def _empty_forward(x: torch.Tensor, spec: _Args) -> tuple[torch.Tensor, ...]:
    """The outputs for an empty piece: the (empty) input's shape, statistics of its channels."""
    stat_dtype = torch.float32 if x.dtype in _LOW_PRECISION else x.dtype
    stats = (x.new_zeros(x.shape[1], dtype=stat_dtype), x.new_zeros(x.shape[1], dtype=stat_dtype))
    results: tuple[torch.Tensor, ...] = (x.clone(), *stats)
    if spec.outputs == 4:
        results += (torch.empty(0, dtype=torch.uint8, device=x.device),)
    return results


def _saved_like_meta(result: tuple[torch.Tensor, ...], x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Evaluation on CPU saves empty statistics where the meta kernel says ``(C,)``: give zeros of that shape.

    The backward of evaluation reads the running statistics, never these.
    """
    out, mean, invstd, *rest = result
    if mean.numel() == 0 and x.shape[1] > 0:
        mean = mean.new_zeros(x.shape[1])
        invstd = invstd.new_zeros(x.shape[1])
    return (out, mean, invstd, *rest)


# [Note: distributed batch norm]
# With the batch (or a spatial dim) cut, the training forward needs, per
# channel, the mean and the sum of squared deviations from it over the whole
# batch: one ``all_gather`` of each rank's count, mean and sum of squared
# deviations gives them (see [Note: one exchange for the batch statistics]);
# the sum over the global count (known from the global shape, uneven cuts
# included) is the biased variance for normalising, over the count less one
# the unbiased one for the running variance. Every rank then holds the same statistics and updates its
# replicated running statistics identically. The training backward needs, per
# channel, ``sum(dy)`` and ``sum(dy * xhat)`` over the whole batch: one
# ``all_reduce`` of both stacked; they are also the bias and weight gradients,
# replicated. Evaluation's backward is local with weight and bias gradients
# ``Partial("sum")`` over the batch cut.
def _train_forward(
    x: torch.Tensor, vectors: dict[str, Any], spec: _Args, layout: Layout, batch: list[int]
) -> tuple[torch.Tensor, ...]:
    """See [Note: distributed batch norm]."""
    dims = [0, *range(2, x.dim())]
    count = math.prod(layout.shape[d] for d in dims)
    work = x.float() if x.dtype in _LOW_PRECISION else x
    mean, m2 = _batch_moments(work, dims, layout, batch)
    centred = work - mean.view(_broadcast_shape(x))
    var = m2 / count
    invstd = (var + spec.eps).rsqrt()
    out = centred * invstd.view(_broadcast_shape(x))
    if vectors["weight"] is not None:
        out = out * vectors["weight"].view(_broadcast_shape(x))
    if vectors["bias"] is not None:
        out = out + vectors["bias"].view(_broadcast_shape(x))
    with torch.no_grad():
        if vectors["running_mean"] is not None:
            rm = vectors["running_mean"]
            rm.mul_(1 - spec.momentum).add_(mean.to(rm.dtype), alpha=spec.momentum)
        if vectors["running_var"] is not None:
            rv = vectors["running_var"]
            unbiased = m2 / (count - 1) if count > 1 else m2 * math.inf
            rv.mul_(1 - spec.momentum).add_(unbiased.to(rv.dtype), alpha=spec.momentum)
    results: tuple[torch.Tensor, ...] = (out.to(x.dtype), mean, invstd)
    if spec.outputs == 4:
        results += (torch.empty(0, dtype=torch.uint8, device=x.device),)
    return results


_FORWARD = [
    aten._native_batch_norm_legit.no_stats,
    aten._batch_norm_with_update.default,
]


@register(*_FORWARD)
@reads_strided
def batch_norm_rule(call: OpCall) -> Decision | None:
    """Channel cuts are local; batch cuts in training use [Note: distributed batch norm]."""
    position = call.position_of(call.args[0])
    layout = call.layout(position)
    if layout.ndim < 2:
        return None
    spec = _forward_args(call)
    target = _input_target(layout)
    channel = _channel_target(layout.with_placements(target))
    inputs: dict[int, tuple[Placement, ...]] = {position: target}
    for index in (spec.weight, spec.bias):
        if index is not None and call.args[index] is not None:
            inputs[call.position_of(call.args[index])] = channel
    for index in (spec.running_mean, spec.running_var):
        if index is not None and call.args[index] is not None:
            kept = _stat_target(call, index, channel)
            if kept is None:
                return None  # partial or oddly cut statistics: the general path
            inputs[call.position_of(call.args[index])] = kept
    outputs: list[tuple[Placement, ...] | None] = [target, channel, channel]
    if spec.outputs == 4:
        outputs.append((Replicate(),) * len(target))
    return Decision(inputs=inputs, outputs=outputs, kernel=_forward_kernel)


# -- backward ---------------------------------------------------------------------------------

# op -> (weight, running_mean, running_var, save_mean, save_invstd, train, eps, output_mask)
_BACKWARD = {
    aten.native_batch_norm_backward.default: (2, 3, 4, 5, 6, 7, 8, 9),
    aten.batch_norm_backward.default: (2, 3, 4, 5, 6, 7, 8, 9),
}


def _backward_kernel(call: LocalCall) -> Any:
    w_i, rm_i, rv_i, sm_i, si_i, train_i, _, mask_i = _BACKWARD[call.func]
    dy, x = call.args[0], call.args[1]
    x_layout = call.layout(1)
    args = list(call.args)
    for index in (w_i, rm_i, rv_i, sm_i, si_i):
        if args[index] is not None and args[index].numel() > 0:
            args[index] = _narrow(args[index], call.layouts[index], x_layout)
    batch = _batch_mesh_dims(x_layout.placements)
    if x.numel() == 0 and not (bool(args[train_i]) and batch):  # an empty piece with no exchange to join
        mask = list(args[mask_i])
        dtype = x.dtype if args[w_i] is None else args[w_i].dtype
        zeros = [x.new_zeros(x.shape[1], dtype=dtype) if mask[i] else None for i in (1, 2)]
        return (torch.zeros_like(x) if mask[0] else None), *zeros
    if not bool(args[train_i]) or not batch:
        return call.func(*args, **call.kwargs)
    mask = list(args[mask_i])
    groups = [mesh_group(x_layout.mesh, m) for m in batch]
    dims = [0, *range(2, x.dim())]
    count = math.prod(x_layout.shape[d] for d in dims)
    shape = _broadcast_shape(x)
    work_dy = dy.float() if dy.dtype in _LOW_PRECISION else dy
    work_x = x.float() if x.dtype in _LOW_PRECISION else x
    mean, invstd = args[sm_i].view(shape), args[si_i].view(shape)
    xhat = (work_x - mean) * invstd
    sum_dy, sum_dy_xhat = _channel_sums([work_dy, work_dy * xhat], dims, groups)
    grad_input = None
    if mask[0]:
        scale = invstd if args[w_i] is None else invstd * args[w_i].view(shape)
        grad_input = scale * (work_dy - sum_dy.view(shape) / count - xhat * (sum_dy_xhat.view(shape) / count))
        grad_input = grad_input.to(x.dtype)
    weight_dtype = x.dtype if args[w_i] is None else args[w_i].dtype
    grad_weight = sum_dy_xhat.to(weight_dtype) if mask[1] else None
    grad_bias = sum_dy.to(weight_dtype) if mask[2] else None
    return grad_input, grad_weight, grad_bias


@register(*_BACKWARD)
@reads_strided
def batch_norm_backward_rule(call: OpCall) -> Decision | None:
    """``grad_input`` cut like the input; weight and bias gradients cut like the channels.

    In training they come back replicated over the batch cut (their sums are
    all-reduced for ``grad_input`` anyway); in evaluation they are
    ``Partial("sum")`` there.
    """
    w_i, rm_i, rv_i, sm_i, si_i, train_i, _, _ = _BACKWARD[call.func]
    position = call.position_of(call.args[1])
    layout = call.layout(position)
    if layout.ndim < 2:
        return None
    target = _input_target(layout)
    channel = _channel_target(layout.with_placements(target))
    inputs: dict[int, tuple[Placement, ...]] = {position: target, call.position_of(call.args[0]): target}
    if call.args[w_i] is not None:
        inputs[call.position_of(call.args[w_i])] = channel
    for index in (rm_i, rv_i, sm_i, si_i):
        value = call.args[index]
        if value is None:
            continue
        placements = call.layout(call.position_of(value)).placements
        if value.numel() == 0 or placements not in ((Replicate(),) * len(target), channel):
            inputs[call.position_of(value)] = (Replicate(),) * len(target)
    batch = _batch_mesh_dims(target)
    train = bool(call.args[train_i])
    param = tuple(Partial("sum") if (m in batch and not train) else p for m, p in enumerate(channel))
    if all(isinstance(p, Replicate) for p in target):
        return Decision(inputs=inputs, outputs=[target, param, param])
    return Decision(inputs=inputs, outputs=[target, param, param], kernel=_backward_kernel)


# -- the three-output forms called directly ---------------------------------------------------

# [Note: evaluation's empty statistics]
# In evaluation, ``native_batch_norm`` and the ``_native_batch_norm_legit`` forms return
# empty ``save_mean`` / ``save_invstd`` on CPU while their meta kernels say ``(C,)``, and the
# dispatcher builds output layouts from the meta kernel. So these ops are handled whole here:
# evaluation normalises with the running statistics through DTensor pointwise ops (local
# for every cut) and returns the empty statistics replicated, as one process would;
# training goes to ``_batch_norm_with_update`` (or ``.no_stats``), which the rule above covers.


def _empty_replicated(like: DTensor) -> DTensor:
    mesh = like._layout.mesh
    layout = Layout(mesh, (Replicate(),) * mesh.ndim, (0,), (1,))
    return DTensor(like._local.new_empty(0), layout)


# [Note: batch norm without weight or bias]
# ``F.batch_norm(x, running_mean, running_var, training=True)`` without
# ``weight`` (or without ``bias``) reaches DTensor as ``native_batch_norm``,
# which goes on to ``_batch_norm_with_update`` for training with running
# statistics. torch's meta kernel of that op (which the dispatcher runs for
# the output layouts) selects a backend with a call that needs real weight
# and bias tensors, and fails on None. So a missing weight is given as ones
# and a missing bias as zeros, replicated (cut for free to the channels'
# placement by the rule): ``x_hat * 1 + 0`` is ``x_hat`` exactly, so the
# outputs are the same to the bit. Autograd recorded ``native_batch_norm``
# with the caller's None, so the backward (``native_batch_norm_backward``,
# whose meta kernel takes None) returns no weight or bias gradient, as on
# one process.
def _filled(x: DTensor, stat: torch.Tensor, value: float) -> DTensor:
    """A replicated ``(C,)`` DTensor of ``value`` in the running statistics' dtype (see the note)."""
    mesh = x._layout.mesh
    channels = x._layout.shape[1]
    local = torch.full((channels,), value, dtype=stat.dtype, device=x._local.device)
    return DTensor(local, Layout(mesh, (Replicate(),) * mesh.ndim, (channels,), (1,)))


def _three_output_forward(args: tuple[Any, ...], kwargs: dict[str, Any], func: Any) -> Any:
    # Only the argument parsing is used: no mesh is needed (or set).
    call = LocalCall(func, tuple(args), kwargs, (), {}, cast("DeviceMesh", None))
    spec = _forward_args(call)
    x = args[0]
    weight, bias = args[1], args[2]
    rm = args[spec.running_mean] if spec.running_mean is not None else None
    rv = args[spec.running_var] if spec.running_var is not None else None
    if spec.training or rm is None or rv is None:  # without running statistics: the batch's own
        if spec.training and rm is not None and rv is not None:
            # see [Note: batch norm without weight or bias]
            if isinstance(x, DTensor):
                weight = _filled(x, rm, 1.0) if weight is None else weight
                bias = _filled(x, rm, 0.0) if bias is None else bias
            out = aten._batch_norm_with_update.default(x, weight, bias, rm, rv, spec.momentum, spec.eps)
            return out[0], out[1], out[2]
        return aten._native_batch_norm_legit.no_stats(x, weight, bias, True, spec.momentum, spec.eps)
    shape = [1, x.shape[1]] + [1] * (x.dim() - 2)
    # A strided operand meets a broadcast one only by gathering: give the vectors the input's shape
    # (an expanded view, no copy) so that a strided channel cut stays local ([Note: strided channels]).
    strided = isinstance(x, DTensor) and any(isinstance(p, StridedShard) for p in x.placements)

    def per_channel(vector: Any) -> Any:
        return vector.view(shape).expand(x.shape) if strided else vector.view(shape)

    out = (x - per_channel(rm)) * per_channel((rv + spec.eps).rsqrt())
    if weight is not None:
        out = out * per_channel(weight)
    if bias is not None:
        out = out + per_channel(bias)
    if out.dtype != x.dtype:  # low-precision input, float statistics
        out = aten._to_copy.default(out, dtype=x.dtype)
    return out, _empty_replicated(x), _empty_replicated(x)


for _func in (
    aten.native_batch_norm.default,
    aten._native_batch_norm_legit.default,
    aten._native_batch_norm_legit_no_training.default,
):
    # mypy cannot type a lambda with a bound default against SPECIAL's two-argument Callable.
    SPECIAL[_func] = lambda args, kwargs, func=_func: _three_output_forward(args, kwargs, func)  # type: ignore[misc]
