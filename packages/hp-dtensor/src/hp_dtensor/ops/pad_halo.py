"""``constant_pad_nd`` (``F.pad``) of a dim cut across ranks: a shift of a few rows between neighbours.

Padding a cut dim by ``before`` rows at the front and ``after`` at the back
(negative amounts crop) changes the length, so the output's ``torch.chunk``
pieces start elsewhere than the input's: each rank's output rows read input
rows shifted by ``before``, a few of which live on a neighbour. Those rows
travel by the halo exchange of :mod:`hp_dtensor.ops.halo` and every rank
pads (or crops) its extended piece locally, so the output stays cut with no
gather ([Note: padding a cut dim]). The backward of ``constant_pad_nd`` is
``constant_pad_nd`` with the amounts negated, so it takes the same path.
Reflection and replication padding read the same shifted rows, folded back
at the tensor's two ends: each rank selects its output rows from its
extended piece, and their backward ops add the gradient back along the same
rows ([Note: reflecting a cut dim]).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from hp_dtensor.layout import Layout, chunk_sizes
from hp_dtensor.ops.dispatch import LocalCall, OpCall
from hp_dtensor.ops.halo import HaloDim, Window, extend, fold_back, full_args, line_reads, neighbourly
from hp_dtensor.placements import Shard

__all__ = [
    "INDEX_PAD_OPS",
    "index_pad_halos",
    "index_pad_kernel",
    "pad_amounts",
    "pad_kernel",
    "plan_index_pad",
    "plan_pad",
    "plan_pads",
    "source_rows",
]

aten = torch.ops.aten


def pad_amounts(pad: Sequence[int], ndim: int) -> dict[int, tuple[int, int]]:
    """``constant_pad_nd``'s flat ``pad`` list as ``{dim: (before, after)}`` (pairs run from the last dim)."""
    amounts: dict[int, tuple[int, int]] = {}
    for i in range(0, len(pad) - 1, 2):
        amounts[ndim - 1 - i // 2] = (int(pad[i]), int(pad[i + 1]))
    return amounts


def _clamp(value: int, low: int, high: int) -> int:
    return max(low, min(value, high))


# [Note: padding a cut dim]
# Along a dim of ``L`` rows padded by ``(b, a)`` the output has ``L + b + a``
# rows, cut by ``torch.chunk``: rank ``r`` owns outputs ``[O_r, O_r+1)``.
# Output ``o`` is input row ``o - b`` where ``0 <= o - b < L`` and the pad
# value elsewhere, so rank ``r`` reads the input rows ``[e0, e1) = [O_r - b,
# O_r+1 - b]`` clamped to ``[0, L)`` and writes ``clamp(b - O_r, 0, n_r)``
# pad rows before them and ``clamp(O_r+1 - b - L, 0, n_r)`` after (``n_r``
# its output rows). The rows it reads come from its own piece and its two
# neighbours' borders, as a convolution's halo does (the plan is a
# :class:`~hp_dtensor.ops.halo.HaloDim`), and the local op is
# ``constant_pad_nd`` with those per-rank amounts. A plan exists when every
# rank with input rows to read reads some of its own, and nothing past a
# neighbour; otherwise (a pad wider than a piece) the dim is gathered.
def plan_pad(
    length: int, ranks: int, before: int, after: int
) -> tuple[HaloDim, list[tuple[int, int]]] | None:
    """The halo and the per-rank local pad amounts of padding a cut dim ([Note: padding a cut dim])."""
    out_length = length + before + after
    sizes, out_sizes = chunk_sizes(length, ranks), chunk_sizes(max(out_length, 0), ranks)
    if ranks < 2 or min(sizes) == 0 or min(out_sizes) == 0:
        return None
    starts = tuple(sum(sizes[:r]) for r in range(ranks + 1))
    outs = tuple(sum(out_sizes[:r]) for r in range(ranks + 1))
    ends: list[tuple[int, int]] = []
    local: list[tuple[int, int]] = []
    for r in range(ranks):
        e0, e1 = _clamp(outs[r] - before, 0, length), _clamp(outs[r + 1] - before, 0, length)
        n = outs[r + 1] - outs[r]
        fill = (_clamp(before - outs[r], 0, n), _clamp(outs[r + 1] - before - length, 0, n))
        if e0 < e1 and not neighbourly(starts, r, e0, e1):
            return None  # see neighbourly: gather instead
        if e0 == e1:  # all padding: an empty read at the own piece's start
            e0 = e1 = starts[r]
        ends.append((e0, e1))
        local.append(fill)
    return HaloDim(starts, tuple(ends), outs, tuple(outs[:-1]), window=Window(1, 1, 0)), local


def plan_pads(layout: Layout, pad: Sequence[int]) -> dict[int, tuple[HaloDim, list[tuple[int, int]]]]:
    """Per mesh dim cutting a padded dim of ``layout``: its pad plan, where one exists (others gather)."""
    amounts = pad_amounts(pad, layout.ndim)
    plans: dict[int, tuple[HaloDim, list[tuple[int, int]]]] = {}
    for m, p in enumerate(layout.placements):
        if not isinstance(p, Shard) or amounts.get(p.dim, (0, 0)) == (0, 0):
            continue
        if sum(1 for q in layout.placements if isinstance(q, Shard) and q.dim == p.dim) != 1:
            continue  # a dim cut by two mesh dims: gathered
        found = plan_pad(layout.shape[p.dim], layout.mesh.shape[m], *amounts[p.dim])
        if found is not None:
            halo, local = found
            plans[m] = (
                HaloDim(halo.starts, halo.ends, halo.outs, halo.shift, m, p.dim, halo.window),
                local,
            )
    return plans


def pad_kernel(plans: Sequence[tuple[HaloDim, list[tuple[int, int]]]]) -> Callable[[LocalCall], Any]:
    """The local ``constant_pad_nd`` on pieces extended by neighbours' rows ([Note: padding a cut dim])."""

    def run(call: LocalCall) -> torch.Tensor:
        x = call.args[0]
        pad = list(call.args[1] if len(call.args) > 1 else call.kwargs["pad"])
        value = call.args[2] if len(call.args) > 2 else call.kwargs.get("value", 0)
        layout = call.layout(0)
        for plan, local in plans:
            r = layout.my_coordinate()[plan.mesh_dim]
            x = extend(x, layout, plan)
            at = 2 * (layout.ndim - 1 - plan.dim)
            pad[at], pad[at + 1] = local[r]
        return call.func(x, pad, value)

    return run


# op -> (mode, backward)
INDEX_PAD_OPS: dict[Any, tuple[str, bool]] = {}
for _mode in ("reflection", "replication"):
    for _k in (1, 2, 3):
        for _backward, _suffix in ((False, ""), (True, "_backward")):
            _packet = getattr(aten, f"{_mode}_pad{_k}d{_suffix}", None)
            if _packet is not None:
                INDEX_PAD_OPS[_packet.default] = (_mode, _backward)


def _source(o: int, length: int, before: int, mode: str) -> int:
    """The input row output row ``o`` copies (see :func:`source_rows`), for one row."""
    i = o - before
    if mode == "replication":
        return min(max(i, 0), length - 1)
    i = abs(i)
    return 2 * (length - 1) - i if i > length - 1 else i


def source_rows(first: int, stop: int, length: int, before: int, mode: str, device: Any) -> torch.Tensor:
    """The input rows outputs ``[first, stop)`` of a ``mode`` padding copy ([Note: reflecting a cut dim])."""
    i = torch.arange(first - before, stop - before, device=device)
    if mode == "replication":
        return i.clamp(0, length - 1)
    i = i.abs()
    return torch.where(i > length - 1, 2 * (length - 1) - i, i)


# [Note: reflecting a cut dim]
# Reflection and replication padding of ``L`` rows by ``(b, a)`` make
# output ``o`` a copy of input row ``i = o - b`` folded into ``[0, L)``:
# mirrored about row 0 and row ``L - 1`` (reflection: ``-i``, ``2 (L - 1) -
# i``) or clamped to them (replication). Over a run of outputs that map is
# continuous with steps of one row, so rank ``r``'s outputs ``[O_r,
# O_r+1)`` read one run of input rows ``[e0, e1)``: the shifted rows a
# constant pad reads, plus, at the edge ranks, the rows next to the tensor's
# ends that the mirror reads (on the edge rank itself unless its piece is
# thinner than the pad, then from its neighbour). Those rows travel by the
# halo exchange (a :class:`~hp_dtensor.ops.halo.HaloDim`, nothing when the
# output cut lines up with the input's, as with a symmetric pad of a length
# the ranks divide) and the rank picks its outputs with ``index_select`` of
# the folded rows minus ``e0``. Padded dims that are not cut are picked the
# same way over the whole dim. The backward ops add the output gradient
# onto the same rows (``index_add_``) of a zero extended piece and send the
# halo rows' sums home (:func:`~hp_dtensor.ops.halo.fold_back`). A rank
# that would read none of its own rows, or rows past a neighbour, has no
# plan: that mesh dim is gathered.
def plan_index_pad(length: int, ranks: int, before: int, after: int, mode: str) -> HaloDim | None:
    """The halo of a reflection / replication padding of a cut dim ([Note: reflecting a cut dim])."""
    if mode == "reflection" and max(before, after) >= length:
        return None  # torch refuses it: the gathered op raises its own error

    def reads(first: int, stop: int) -> tuple[int, int]:
        # the map's extremes lie at the run's ends or where it turns (input rows 0 and L - 1)
        turns = [o for o in (before, before + length - 1) if first < o < stop - 1]
        rows = [_source(o, length, before, mode) for o in (first, stop - 1, *turns)]
        return min(rows), max(rows) + 1

    line = line_reads(length, ranks, length + before + after, reads)
    return None if line is None else HaloDim(line.starts, line.ends, line.outs, line.outs[:-1])


def index_pad_halos(call: OpCall, lead: int) -> dict[int, HaloDim]:
    """Halo plans of the mesh dims cutting a spatial dim of a reflection / replication pad (or backward)."""
    spec = INDEX_PAD_OPS.get(call.func)
    if spec is None:
        return {}
    mode, backward = spec
    args = full_args(call.func, call.args, call.kwargs)
    layout: Layout = call.layout(call.position_of(args[1 if backward else 0]))
    pad = [int(v) for v in args[-1]]
    if len(pad) != 2 * (layout.ndim - lead):
        return {}  # malformed: the local op raises its own error on whole tensors
    amounts = pad_amounts(pad, layout.ndim)
    plans: dict[int, HaloDim] = {}
    for m, p in enumerate(layout.placements):
        if not isinstance(p, Shard) or p.dim < lead:
            continue
        if sum(1 for q in layout.placements if isinstance(q, Shard) and q.dim == p.dim) != 1:
            continue
        plan = plan_index_pad(layout.shape[p.dim], layout.mesh.shape[m], *amounts[p.dim], mode)
        if plan is not None:
            plans[m] = HaloDim(plan.starts, plan.ends, plan.outs, plan.shift, m, p.dim, plan.window)
    return plans


def _picks(
    layout: Layout, plans: Sequence[HaloDim], pad: Sequence[int], mode: str, device: Any
) -> list[tuple[int, torch.Tensor]]:
    """Per padded dim: the rows of this rank's (extended) piece that its output rows copy."""
    cut = {plan.dim: plan for plan in plans}
    picks = []
    for dim, (before, after) in pad_amounts(pad, layout.ndim).items():
        if before == after == 0:
            continue
        length = layout.shape[dim]
        plan = cut.get(dim)
        if plan is None:
            picks.append((dim, source_rows(0, length + before + after, length, before, mode, device)))
            continue
        r = layout.my_coordinate()[plan.mesh_dim]
        rows = source_rows(plan.outs[r], plan.outs[r + 1], length, before, mode, device)
        picks.append((dim, rows - plan.ends[r][0]))
    return picks


def index_pad_kernel(func: Any, plans: list[HaloDim]) -> Callable[[LocalCall], Any]:
    """Reflection / replication padding or its backward on extended pieces ([Note: reflecting a cut dim])."""
    mode, backward = INDEX_PAD_OPS[func]

    def run(call: LocalCall) -> torch.Tensor:
        args = full_args(call.func, call.args, call.kwargs)
        pad = [int(v) for v in args[-1]]
        if not backward:
            layout = call.layout(0)
            x = args[0]
            for plan in plans:
                x = extend(x, layout, plan)
            for dim, rows in _picks(layout, plans, pad, mode, x.device):
                x = x.index_select(dim, rows)
            return x
        layout = call.layout(1)
        grad = args[0]
        shape = list(grad.shape)
        for dim, rows in _picks(layout, plans, pad, mode, grad.device):
            cut = next((p for p in plans if p.dim == dim), None)
            if cut is None:
                shape[dim] = layout.shape[dim]
            else:
                e0, e1 = cut.ends[layout.my_coordinate()[cut.mesh_dim]]
                shape[dim] = e1 - e0
            grad = grad.new_zeros(shape).index_add_(dim, rows, grad)
        for plan in reversed(plans):
            grad = fold_back(grad, layout, plan)
        return grad

    return run
