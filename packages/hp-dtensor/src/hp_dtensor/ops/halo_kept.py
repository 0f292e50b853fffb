"""Halo rows a convolution's forward received, kept for its backward so they are not exchanged twice.

A convolution's weight gradient reads the same extended input piece as its
forward. Rather than exchange the border rows again in the backward, the
forward keeps the rows it received (only those: the local piece is the
saved input itself) beside its local input tensor, and the backward joins
them to the piece again ([Note: halo rows kept for the backward]).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from hp_dtensor.layout import Layout, mesh_key
from hp_dtensor.ops.halo import HaloDim, halo_rows, with_halo

__all__ = ["extend_keeping", "extend_kept", "release_kept"]

Rows = tuple[torch.Tensor | None, torch.Tensor | None]


@dataclass
class _Kept:
    version: int  # the local piece's version counter when the rows were received
    rows: list[Rows]  # per plan, in the order the piece was extended
    uses: int  # forwards that kept these rows and whose backward has not run yet


# local input piece -> {(mesh identity, plans): kept rows}; an entry dies with its piece
_KEPT: Any = WeakIdKeyDictionary()


# [Note: halo rows kept for the backward]
# The forward of a convolution on a spatially cut input extends each rank's
# piece by the border rows of its neighbours; the backward's weight gradient
# reads that same extended piece. Under grad mode the forward keeps the rows
# it received, cloned (a few rows per cut dim and rank: one border slab from
# each neighbour that has rows to give, never the piece), in a table keyed
# weakly by the local input tensor, which autograd holds for the backward
# anyway. The backward finds them by that tensor, joins them to it and
# exchanges only the input gradient's halo: one exchange fewer per
# convolution. A forward that finds rows already kept for its piece and
# plans (a second convolution with the same window on the same input) uses
# them too, without an exchange. Each forward that keeps counts one use and
# each backward releases one, dropping the rows at zero; an entry also dies
# with its piece (a forward whose backward never runs). Hits and misses are
# the same on every rank, as the exchange they skip is collective: every
# rank runs the same forwards and backwards on the same pieces. A miss
# (rows never kept: grad mode off, a retained graph's second backward, an
# input redistributed anew for the call) exchanges again, and an in-place
# write to the piece since the forward (its version counter moved) too.
def _key(layout: Layout, plans: Sequence[HaloDim]) -> tuple[Any, ...]:
    return (mesh_key(layout.mesh), tuple(plans))


def _version(local: torch.Tensor) -> int:
    """The piece's version counter (bumped by every in-place write): kept rows are stale once it moves."""
    return int(local._version)


def _join(local: torch.Tensor, layout: Layout, plans: Sequence[HaloDim], rows: list[Rows]) -> torch.Tensor:
    for plan, (left, right) in zip(plans, rows, strict=True):
        local = with_halo(local, layout, plan, left, right)
    return local


def _usable(local: torch.Tensor, layout: Layout, plans: Sequence[HaloDim]) -> _Kept | None:
    table = _KEPT.get(local)
    kept = None if table is None else table.get(_key(layout, plans))
    return kept if kept is not None and kept.version == _version(local) else None


def extend_keeping(local: torch.Tensor, layout: Layout, plans: Sequence[HaloDim]) -> torch.Tensor:
    """The piece extended along every plan; under grad mode its halo rows are kept for the backward."""
    keep = torch.is_grad_enabled()
    kept = _usable(local, layout, plans)
    if kept is not None:
        kept.uses += int(keep)
        return _join(local, layout, plans, kept.rows)
    extended, rows = local, []
    for plan in plans:
        left, right = halo_rows(extended, layout, plan)
        rows.append((left, right))
        extended = with_halo(extended, layout, plan, left, right)
    if keep:
        cloned = [tuple(None if t is None else t.clone() for t in pair) for pair in rows]
        table = _KEPT.setdefault(local, {})
        table[_key(layout, plans)] = _Kept(_version(local), cloned, 1)  # type: ignore[arg-type]
    return extended


def release_kept(local: torch.Tensor, layout: Layout, plans: Sequence[HaloDim]) -> _Kept | None:
    """Release one use of the rows kept for ``local``; the rows when they are still valid."""
    table = _KEPT.get(local)
    key = _key(layout, plans)
    kept = None if table is None else table.get(key)
    if kept is None:
        return None
    kept.uses -= 1
    if kept.uses <= 0:
        del table[key]
        if not table:
            del _KEPT[local]
    return kept if kept.version == _version(local) else None


def extend_kept(local: torch.Tensor, layout: Layout, plans: Sequence[HaloDim]) -> torch.Tensor:
    """The backward's extended piece: from the forward's kept rows, or by exchanging them again."""
    kept = release_kept(local, layout, plans)
    if kept is not None:
        return _join(local, layout, plans, kept.rows)
    for plan in plans:
        local = with_halo(local, layout, plan, *halo_rows(local, layout, plan))
    return local
