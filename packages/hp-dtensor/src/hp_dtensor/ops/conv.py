"""Convolution (1-D to 3-D, transposed, grouped) and its backward as contractions, plus halos.

Without its windows a convolution is a matrix product over channels: the
input ``(N, Cin, *S)`` is ``bi``, the weight ``(Cout, Cin/g, *K)`` is ``oi``
(``io`` when transposed), the output ``(N, Cout, *S')`` is ``bo``. So the
plans are a matmul's ([Note: contraction placements] in
:mod:`hp_dtensor.ops.matrix`): a batch cut is local, a cut of the weight's
output channels cuts the output's channels, the input channels cut on both
give a ``Partial("sum")`` output. The backward keeps those cuts, and a batch
cut makes the weight and bias gradients ``Partial("sum")``, the sum FSDP and
DP reduce anyway ([Note: convolution backward plans]). Groups, and an input
cut along a spatial dim (a halo exchange, :mod:`hp_dtensor.ops.halo`):
[Note: grouped and windowed convolutions].
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hp_dtensor.layout import Layout
from hp_dtensor.ops.dispatch import Decision, LocalCall, OpCall, register
from hp_dtensor.ops.halo import (
    HaloDim,
    Window,
    extended_shape,
    fold_back,
    full_args,
    narrow_output,
    pad_output_grad,
    per_dim,
    plan_halos,
)
from hp_dtensor.ops.halo_kept import extend_keeping, extend_kept, release_kept
from hp_dtensor.ops.holding import first_that_holds
from hp_dtensor.ops.matrix import contraction_placements
from hp_dtensor.placements import Partial, Placement, Replicate, Shard

__all__ = ["convolution_backward_rule", "convolution_rule"]

aten = torch.ops.aten
R = Replicate()
SUM = Partial("sum")


def _conv_halos(x: Layout, weight_shape: Sequence[int], args: Sequence[Any]) -> dict[int, HaloDim]:
    """Halo plans of the mesh dims that cut a spatial dim of the input ``x``.

    ``args`` are the convolution's ``stride, padding, dilation, transposed,
    output_padding``.
    """
    stride, padding, dilation, transposed, output_padding = args
    k = len(weight_shape) - 2
    kernel = list(weight_shape[2:])
    strides, pads, dils = per_dim(stride, k), per_dim(padding, k), per_dim(dilation, k)
    extra = per_dim(output_padding, k) if transposed else [0] * k
    windows = [
        Window(dils[i] * (kernel[i] - 1) + 1, strides[i], pads[i], False, bool(transposed), extra[i])
        for i in range(k)
    ]
    return plan_halos(x, list(range(x.ndim - k, x.ndim)), windows)


def _channel_only(p: Placement) -> Placement:
    """A shard of a spatial or kernel dim taken as replicated (gathered), for the channel contraction."""
    return R if isinstance(p, Shard) and p.dim >= 2 else p


def _group_cut(layouts: Sequence[tuple[Layout, int]], m: int, groups: int) -> bool:
    """Whether mesh dim ``m`` may cut whole groups: it cuts one of the channel dims given, alone, evenly."""
    size = layouts[0][0].mesh.shape[m]
    if groups % size != 0:
        return False
    cuts = False
    for layout, dim in layouts:
        cutters = [k for k, p in enumerate(layout.placements) if isinstance(p, Shard) and p.dim == dim]
        cuts = cuts or m in cutters
        if cutters and cutters != [m]:
            return False
    return cuts


def _bias_of(out: Placement) -> Placement:
    if isinstance(out, Shard):
        return Shard(0) if out.dim == 1 else R
    return out


# [Note: grouped and windowed convolutions]
# With ``groups > 1`` output channel ``o`` reads only the input channels of
# its group, so a channel cut is right only when each rank holds whole groups
# of both: a mesh dim of size ``W`` with ``groups % W == 0`` cuts the input
# channels, the weight's first dim and the output channels together, and each
# rank runs its ``groups / W`` groups (depthwise convolutions are the common
# case); any other channel cut of a grouped convolution is gathered. An input
# cut on a spatial dim keeps that cut on the output through a halo exchange
# ([Note: halo plans] in :mod:`hp_dtensor.ops.halo`), transposed or not, the
# weight replicated on that mesh dim; a cut kernel dim, or a spatial cut
# without a plan, is gathered.
def _local_groups(groups: int, splits: int) -> int:
    return groups // splits


def _forward_kernel(halos: list[HaloDim], splits: int) -> Any:
    """Run the convolution on halo-extended pieces with ``groups / splits`` local groups."""

    def run(call: LocalCall) -> torch.Tensor:
        args = list(call.args)
        layout = call.layout(0)
        if halos:  # the rows received are kept for the backward ([Note: halo rows kept for the backward])
            args[0] = extend_keeping(args[0], layout, halos)
        args[8] = _local_groups(args[8], splits)
        out = call.func(*args)
        for plan in halos:
            out = narrow_output(out, layout, plan)
        return out

    return run


@register(aten.convolution.default)
def convolution_rule(call: OpCall) -> Decision | None:
    """Batch, output-channel and input-channel cuts as a matmul's; whole groups; halos for spatial cuts."""
    if call.kwargs:
        return None
    x, w, bias, stride, padding, dilation, transposed, output_padding, groups = call.args
    if x.ndim != w.ndim:
        return None  # an unbatched input: the fallback
    px, pw = call.position_of(x), call.position_of(w)
    pb = call.position_of(bias) if bias is not None else None
    lx, lw = call.layout(px), call.layout(pw)
    halos = _conv_halos(lx, w.shape, (stride, padding, dilation, transposed, output_padding))
    letters = ("bi", "io" if transposed else "oi", "bo")
    sizes = (x.numel(), w.numel())

    def build(gathered: frozenset[int]) -> Decision:
        tx: list[Placement] = []
        tw: list[Placement] = []
        out: list[Placement] = []
        used: list[HaloDim] = []
        splits = 1
        for m in range(lx.mesh.ndim):
            a, b = lx.placements[m], lw.placements[m]
            if m in gathered:
                row: tuple[Placement, Placement, Placement] = (R, R, R)
            elif m in halos:
                cut = Shard(halos[m].dim)
                row = (cut, R, cut)
                used.append(halos[m])
            elif groups == 1:
                row = contraction_placements(
                    letters, _channel_only(a), _channel_only(b), sizes, lx.mesh.shape[m]
                )[:3]
            elif isinstance(a, Shard) and a.dim == 0:
                row = (a, R, a)
            elif _group_cut([(lx, 1), (lw, 0)], m, groups):
                row = (Shard(1), Shard(0), Shard(1))
                splits *= lx.mesh.shape[m]
            else:
                row = (R, R, R)
            tx.append(row[0])
            tw.append(row[1])
            out.append(row[2])
        inputs = {px: tuple(tx), pw: tuple(tw)}
        if pb is not None:
            inputs[pb] = tuple(_bias_of(p) for p in out)
        kernel = _forward_kernel(used, splits) if used or splits > 1 else None
        return Decision(inputs=inputs, outputs=[tuple(out)], kernel=kernel)

    return first_that_holds(call, build, nonempty=True, empty_batch_ok=True)  # an empty batch runs


# [Note: convolution backward plans]
# ``convolution_backward(grad_out, input, weight, ...)`` returns the input's,
# the weight's and the bias's gradients. Per mesh dim, the first of these
# that applies:
#
# ========================  ======================  ===========================
# cut                       (grad_out, in, weight)  (grad_in, grad_w, grad_b)
# ========================  ======================  ===========================
# batch                     S(0), S(0), R           S(0), P, P
# spatial dim d (halo)      S(d), S(d), R           S(d), P, P
# output channels           S(1), R, S(o)           P, S(o), S(0)
# input channels            R, S(1), S(i)           S(1), S(i), R
# whole groups              S(1), S(1), S(0)        S(1), S(0), S(0)
# partial grad_out          P, R, R                 P, P, P
# ========================  ======================  ===========================
#
# (``o`` / ``i`` are the weight's output / input channel dims: 0 / 1, or
# 1 / 0 when transposed.) A batch or spatial cut leaves each rank's weight
# and bias gradients as its own terms of the sum: ``Partial("sum")``, which
# FSDP's reduce-scatter and DP's all-reduce consume as they are. A spatial
# cut costs one exchange of border rows, the input gradient's halo going
# home: the weight gradient reads the input's halo the forward received and
# kept ([Note: halo rows kept for the backward] in
# :mod:`hp_dtensor.ops.halo_kept`; exchanged again only where nothing was
# kept). The local op's ``bias_sizes`` is the local channel count (a kernel
# fixes it).
def _backward_row(
    m: int,
    layouts: tuple[Layout, Layout, Layout],
    transposed: bool,
    groups: int,
    halos: dict[int, HaloDim],
) -> tuple[tuple[Placement, ...], str]:
    go, x, w = (layout.placements[m] for layout in layouts)
    o, i = (1, 0) if transposed else (0, 1)

    def cut(p: Placement, dim: int) -> bool:
        return isinstance(p, Shard) and p.dim == dim

    if cut(go, 0) or cut(x, 0):
        return (Shard(0), Shard(0), R, Shard(0), SUM, SUM), ""
    if m in halos:
        d = Shard(halos[m].dim)
        return (d, d, R, d, SUM, SUM), "halo"
    if groups == 1:
        if cut(go, 1) or cut(w, o):
            return (Shard(1), R, Shard(o), SUM, Shard(o), Shard(0)), ""
        if cut(x, 1) or cut(w, i):
            return (R, Shard(1), Shard(i), Shard(1), Shard(i), R), ""
    elif _group_cut([(layouts[0], 1), (layouts[1], 1), (layouts[2], 0)], m, groups):
        return (Shard(1), Shard(1), Shard(0), Shard(1), Shard(0), Shard(0)), "group"
    if isinstance(go, Partial) and go.reduce_op == "sum" and not isinstance(x, Partial):
        return (go, R, R, go, go, go), ""
    return (R,) * 6, ""


def _backward_kernel(halos: list[HaloDim], splits: int) -> Any:
    """The local backward on halo-extended pieces; the input gradient's halo summed back to its owners."""

    def run(call: LocalCall) -> Any:
        args = list(call.args)
        layout = call.layout(1)
        if halos and not args[10][1]:
            # no weight gradient: the input's values are not read, only its shape
            release_kept(args[1], layout, halos)
            args[1] = args[1].new_zeros(extended_shape(args[1].shape, layout, halos))
        elif halos:
            args[1] = extend_kept(args[1], layout, halos)
        for plan in halos:
            args[0] = pad_output_grad(args[0], layout, plan)
        if args[3] is not None:
            args[3] = [args[0].shape[1]]  # the local bias size: this rank's output channels
        args[9] = _local_groups(args[9], splits)
        grad_in, grad_w, grad_b = call.func(*args)
        if grad_in is not None:
            for plan in reversed(halos):
                grad_in = fold_back(grad_in, layout, plan)
        return grad_in, grad_w, grad_b

    return run


@register(aten.convolution_backward.default)
def convolution_backward_rule(call: OpCall) -> Decision | None:
    """The forward's cuts, weight and bias gradients partial over a batch or spatial cut."""
    args = full_args(call.func, call.args, call.kwargs)
    go, x, w = args[0], args[1], args[2]
    transposed, groups = args[7], args[9]
    if x.ndim != w.ndim:
        return None
    positions = [call.position_of(t) for t in (go, x, w)]
    layouts = (call.layout(positions[0]), call.layout(positions[1]), call.layout(positions[2]))
    halos = _conv_halos(layouts[1], w.shape, args[4:9])
    mesh = layouts[1].mesh

    def build(gathered: frozenset[int]) -> Decision:
        rows: list[tuple[Placement, ...]] = []
        used: list[HaloDim] = []
        splits = 1
        for m in range(mesh.ndim):
            row, kind = (
                ((R,) * 6, "") if m in gathered else _backward_row(m, layouts, transposed, groups, halos)
            )
            if kind == "halo":
                used.append(halos[m])
            elif kind == "group":
                splits *= mesh.shape[m]
            rows.append(row)
        columns = [tuple(c) for c in zip(*rows, strict=True)]
        inputs = dict(zip(positions, columns[:3], strict=True))
        return Decision(inputs=inputs, outputs=list(columns[3:]), kernel=_backward_kernel(used, splits))

    return first_that_holds(call, build, nonempty=True, empty_batch_ok=True)  # an empty batch runs
