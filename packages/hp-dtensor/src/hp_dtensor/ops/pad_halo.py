"""``constant_pad_nd`` (``F.pad``) of a dim cut across ranks: a shift of a few rows between neighbours.

Padding a cut dim by ``before`` rows at the front and ``after`` at the back
(negative amounts crop) changes the length, so the output's ``torch.chunk``
pieces start elsewhere than the input's: each rank's output rows read input
rows shifted by ``before``, a few of which live on a neighbour. Those rows
travel by the halo exchange of :mod:`hp_dtensor.ops.halo` and every rank
pads (or crops) its extended piece locally, so the output stays cut with no
gather ([Note: padding a cut dim]). The backward of ``constant_pad_nd`` is
``constant_pad_nd`` with the amounts negated, so it takes the same path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from hp_dtensor.layout import Layout, chunk_sizes
from hp_dtensor.ops.dispatch import LocalCall
from hp_dtensor.ops.halo import HaloDim, Window, extend
from hp_dtensor.placements import Shard

__all__ = ["pad_amounts", "pad_kernel", "plan_pad", "plan_pads"]


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
        if e0 < starts[max(r - 1, 0)] or e1 > starts[min(r + 2, ranks)]:
            return None  # rows from beyond a neighbour: gather instead
        if e0 < e1 and max(e0, starts[r]) >= min(e1, starts[r + 1]):
            return None  # reads none of its own rows: gather instead
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
