"""Check a rule's decision for every rank before any rank acts on it.

How: [Note: decisions that hold on every rank] (above :func:`decision_problem`);
why the verdicts are shared by a process's ranks: [Note: one verdict per process].
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from hp_dtensor.dtensor import DTensor
from hp_dtensor.layout import Layout

__all__ = ["decision_problem", "to_meta"]

_MAX_VERDICTS = 8192


# [Note: one verdict per process]
# The verdict is a function of what the meta runs see: the op, the argument
# structure, each DTensor's global shape, dtype and placements (after the
# rule's input targets) on a mesh of a given shape, the other arguments'
# meta stand-ins, and the decision's outputs. It depends on no rank and on no
# mesh object, so it is remembered under exactly that key in a memo that
# outlives the dispatcher's caches (a new rule gives a new decision, hence a
# new key). The memo is an object, not a module-level dict, on purpose:
# hp_testing's local mode runs every rank of a world as a thread of one
# process and gives each rank its own copy of the module-level dicts of hp's
# packages (their per-process state), but leaves other objects shared, so the
# 64 ranks of a local world check each decision once instead of 64 times.
class _Verdicts:
    """Remembered answers of :func:`decision_problem` (see [Note: one verdict per process])."""

    def __init__(self) -> None:
        self.table: dict[Any, str | None] = {}

    def remember(self, key: Any, verdict: str | None) -> str | None:
        if len(self.table) >= _MAX_VERDICTS:
            self.table.clear()
        self.table[key] = verdict
        return verdict


_VERDICTS = _Verdicts()


def _meta(shape: Sequence[int], like: torch.Tensor) -> torch.Tensor:
    return torch.empty(tuple(shape), dtype=like.dtype, device="meta")


def to_meta(value: Any) -> Any:
    """A meta stand-in for one call argument: a DTensor at its global shape, a tensor at its own."""
    if isinstance(value, DTensor):
        layout = value._layout
        return torch.empty_strided(layout.shape, layout.stride, dtype=value.dtype, device="meta")
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(tuple(value.shape), value.stride(), dtype=value.dtype, device="meta")
    if isinstance(value, torch.device):  # _to_copy(..., device=cpu), factories: stay on meta
        return torch.device("meta")
    return value


def _leaf_key(value: Any) -> Any:
    """What a non-DTensor argument contributes to the meta runs (None: not hashable, not memoised)."""
    if isinstance(value, torch.Tensor):
        return ("T", tuple(value.shape), value.stride(), value.dtype)
    if isinstance(value, torch.device):
        return ("device",)
    try:
        hash(value)
    except TypeError:
        return None
    return (type(value), value)


def _verdict_key(
    func: Any,
    flat: list[Any],
    spec: Any,
    layouts: dict[int, Layout],
    decision: Any,
    mesh: Any,
    out_meta: list[Any],
) -> Any:
    """The key of [Note: one verdict per process], or None when some argument cannot be keyed."""
    leaves: list[Any] = []
    for i, value in enumerate(flat):
        layout = layouts.get(i)
        if layout is not None:
            leaves.append(("D", layout.shape, layout.placements, layout.ragged, flat[i].dtype))
            continue
        key = _leaf_key(value)
        if key is None:
            return None
        leaves.append(key)
    outputs = (
        None
        if decision.inplace
        else tuple((tuple(decision.outputs[i]), tuple(m.shape), tuple(m.stride())) for i, m in out_meta)
    )
    return (func, spec, tuple(leaves), tuple(mesh.shape), outputs, decision.inplace, decision.size_arg)


# [Note: decisions that hold on every rank]
# A rule decides from layouts, which every rank shares, but the local op then
# runs on each rank's own piece. A decision that is wrong for some pieces only
# (``squeeze()`` dropping a dim that is 1 on one rank's piece; an op that
# refuses an empty piece) used to fail on those ranks alone, while their peers
# went on into the next collective and waited there until the timeout: one
# rank's internal error, the others' hang. So the first time a decision is
# made (decisions are cached by layouts, so this is once per signature) the
# dispatcher runs the op on meta tensors with the local shapes of *every* mesh
# coordinate and compares each result with the output layouts' local shapes
# there. Every rank computes the same answer from the same layouts, with no
# communication; a decision that fails anywhere is dropped on every rank and
# the call takes the replicated fallback, which is right by construction (and,
# under the ``"error"`` fallback policy, raises on every rank). Coordinates
# with equal local shapes share one meta run.
#
# Decisions with a ``kernel`` are not checked: a kernel may communicate and
# is written for uneven pieces itself.
def decision_problem(
    func: Any, flat: list[Any], spec: Any, positions: Sequence[int], decision: Any, mesh: Any, meta: Any
) -> str | None:
    """Why ``decision`` would go wrong on some rank, or None when it holds on every one.

    ``meta`` is the op's output on global meta tensors (its shapes give the
    output layouts).
    """
    outputs = decision.outputs
    # outputs[i] belongs to the op's i-th result leaf (None for a non-tensor leaf)
    leaves = pytree.tree_leaves(meta)
    out_meta = [(i, m) for i, m in enumerate(leaves) if isinstance(m, torch.Tensor)]
    if not decision.inplace:
        for index, _ in out_meta:
            if index >= len(outputs) or outputs[index] is None:
                return f"the rule gives no placements for the op's tensor result #{index}"
    if decision.kernel is not None:
        return None
    layouts: dict[int, Layout] = {}
    for p in positions:
        layout: Layout = flat[p]._layout
        target = decision.inputs.get(p)
        if target is not None and tuple(target) != layout.placements:
            layout = layout.with_placements(target)
        layouts[p] = layout
    key = _verdict_key(func, flat, spec, layouts, decision, mesh, out_meta)
    if key is None:
        return _check_every_coordinate(func, flat, spec, positions, decision, mesh, layouts, out_meta)
    if key in _VERDICTS.table:
        return _VERDICTS.table[key]
    verdict = _check_every_coordinate(func, flat, spec, positions, decision, mesh, layouts, out_meta)
    return _VERDICTS.remember(key, verdict)


def _check_every_coordinate(
    func: Any,
    flat: list[Any],
    spec: Any,
    positions: Sequence[int],
    decision: Any,
    mesh: Any,
    layouts: dict[int, Layout],
    out_meta: list[Any],
) -> str | None:
    """Run the op on meta tensors at every distinct set of local shapes; the first failure, or None."""
    tables = {p: layout.table() for p, layout in layouts.items()}
    out_tables: list[tuple[tuple[int, ...], ...] | None] = []
    if not decision.inplace:
        for index, m in out_meta:
            target = decision.outputs[index]
            assert target is not None
            out_tables.append(Layout(mesh, tuple(target), tuple(m.shape), tuple(m.stride())).table())
    base = [to_meta(v) for v in flat]  # DTensor slots are replaced per coordinate
    seen: set[tuple[Any, ...]] = set()
    for coord in range(len(next(iter(tables.values())))):
        shapes = tuple(tables[p][coord] for p in positions)
        expected = tuple(t[coord] for t in out_tables if t is not None)
        if (shapes, expected) in seen:
            continue
        seen.add((shapes, expected))
        local_leaves = list(base)
        for p in positions:
            local_leaves[p] = _meta(tables[p][coord], flat[p])
        args, kwargs = pytree.tree_unflatten(local_leaves, spec)
        if decision.size_arg is not None:
            args = list(args)
            args[decision.size_arg] = list(expected[0])
        try:
            result = func(*args, **kwargs)
        except Exception as error:  # the local op would raise on this rank only
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            return f"the local op fails on the piece of mesh coordinate #{coord}: {first}"
        if decision.inplace:
            continue
        got = [tuple(r.shape) for r in pytree.tree_leaves(result) if isinstance(r, torch.Tensor)]
        if tuple(got) != expected:
            return (
                f"local result shapes {got} at mesh coordinate #{coord} do not match the layouts' "
                f"{list(expected)}"
            )
    return None
