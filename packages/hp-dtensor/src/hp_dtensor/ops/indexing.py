"""Index-driven ops along one dim: the gather / scatter family and the index_select / index_add family.

``gather`` and ``index_select`` read along ``dim``; ``scatter``,
``scatter_add``, ``scatter_reduce`` and the ``index_add`` / ``index_copy`` /
``index_fill`` / ``index_reduce`` ops write along it. Per mesh dim the
placement of ``x`` and of the index decides the options ([Note: placements
of index-driven ops]): a cut ``dim`` is handled by [Note: masked writes]
and [Note: masked reads], a cut index of an additive write by [Note:
sharded additive index]. The option with the fewest collectives wins
(:func:`cheapest`); the last resort gathers that mesh dim of each argument,
never the whole tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hp_dtensor.layout import Layout
from hp_dtensor.ops.dispatch import Decision, LocalCall, OpCall, register
from hp_dtensor.placements import Partial, Placement, Replicate, Shard

__all__ = ["cheapest", "functional_of", "is_inplace", "masked_positions", "move_cost", "spare_slot_write"]

aten = torch.ops.aten
R = Replicate()
SUM = Partial("sum")


@dataclass(frozen=True)
class _Family:
    """How an op of this module reads its arguments."""

    reads: bool  # output shaped by the index (gather, index_select), else shaped like x
    full_index: bool  # index has x's dims (gather family), else a 1-D list of positions
    additive: bool  # writes add into x (scatter_add, index_add)
    wraps_negative: bool = False  # index_fill accepts -1 for the last position


def is_inplace(func: Any) -> bool:
    """Whether ``func`` writes into its first argument (``scatter_``, ``index_put_``, ...)."""
    schema = getattr(func, "_schema", None)
    if schema is None or not schema.arguments:
        return False
    alias = schema.arguments[0].alias_info
    return alias is not None and alias.is_write


def functional_of(func: Any) -> Any:
    """The out-of-place overload of an in-place op (``scatter_.src`` -> ``scatter.src``), else ``func``."""
    if not is_inplace(func):
        return func
    base = func.overloadpacket.__name__.rstrip("_")
    return getattr(getattr(aten, base), func._overloadname)


def masked_positions(index: torch.Tensor, low: int, size: int, whole: int, wrap: bool) -> torch.Tensor:
    """``index`` moved into the piece ``[low, low + size)``; indices outside it point at ``size``."""
    if wrap:
        index = torch.where(index < 0, index + whole, index)
    inside = (index >= low) & (index < low + size)
    return torch.where(inside, index - low, torch.full_like(index, size))


def spare_slot_write(x: torch.Tensor, dims: list[int], run: Any) -> torch.Tensor:
    """``run(padded)`` on ``x`` padded by one spare slot on each of ``dims``; the spares dropped again."""
    padded = x
    for d in dims:
        shape = list(padded.shape)
        shape[d] = 1
        padded = torch.cat([padded, padded.new_zeros(shape)], d)
    out = run(padded)
    for d in dims:
        out = out.narrow(d, 0, x.shape[d])
    return out.contiguous()


# [Note: masked writes]
# A rank holding positions ``[lo, hi)`` of ``dim`` applies only the writes
# aimed there, shifted by ``lo``: the op runs on the local piece padded with one
# spare slot on ``dim``, every index outside the piece points at the spare, and
# the spare is dropped afterwards. This is exact for every write op (a
# ``scatter_reduce`` mean or an ``index_copy`` of duplicates sees the same
# contributions per real position as the whole tensor would) and needs no
# communication: the index and source are replicated on that mesh dim.
def _masked_write_kernel(family: _Family, call: LocalCall) -> torch.Tensor:
    """The op on this rank's positions of ``dim`` only (see [Note: masked writes])."""
    x, index = call.args[0], call.args[2]
    layout = call.layout(0)
    dim = int(call.args[1]) % layout.ndim
    shifted = masked_positions(
        index, layout.local_offset()[dim], x.shape[dim], layout.shape[dim], family.wraps_negative
    )
    functional = functional_of(call.func)
    rest = call.args[3:]
    out = spare_slot_write(x, [dim], lambda padded: functional(padded, dim, shifted, *rest, **call.kwargs))
    if is_inplace(call.func):
        return x.copy_(out)
    return out


# [Note: masked reads]
# A read of ``x`` cut on ``dim`` looks up the indices that fall in the rank's
# piece (shifted by ``lo``) and writes zeros for the others, so the ranks'
# outputs sum to the read: ``Partial("sum")`` without communication, as a
# row-wise embedding does. The consumer reduces the output later, which beats
# gathering ``x`` when the output is small: it is used when the output has at
# most half as many elements as ``x`` (a gather with one index per row, as in a
# loss's target lookup, always).
def _masked_read_kernel(family: _Family, call: LocalCall) -> torch.Tensor:
    """The indices in this rank's piece, zeros for the rest (see [Note: masked reads])."""
    x, index = call.args[0], call.args[2]
    layout = call.layout(0)
    dim = int(call.args[1]) % layout.ndim
    low, size = layout.local_offset()[dim], x.shape[dim]
    inside = (index >= low) & (index < low + size)
    shifted = torch.where(inside, index - low, torch.zeros_like(index))
    if size == 0:  # an empty piece of an uneven cut: read from a zero slot, then mask everything
        shape = list(x.shape)
        shape[dim] = 1
        x = x.new_zeros(shape)
    out = call.func(x, dim, shifted, *call.args[3:], **call.kwargs)
    if not family.full_index:
        inside = inside.reshape([-1 if d == dim else 1 for d in range(out.dim())])
    return torch.where(inside, out, torch.zeros((), dtype=out.dtype, device=out.device))


def _position(call: OpCall, value: Any) -> int | None:
    from hp_dtensor.dtensor import DTensor

    return call.position_of(value) if isinstance(value, DTensor) else None


# [Note: placements of index-driven ops]
# ``gather(x, dim, index)`` and ``index_select(x, dim, index)`` read along
# ``dim``; ``scatter``, ``scatter_add``, ``scatter_reduce``, ``index_add``,
# ``index_copy``, ``index_fill`` and ``index_reduce`` write along it. The
# gather family's ``index`` (and ``src``) has every dim of ``x``; the
# index_select family's ``index`` is one list of positions on ``dim`` and its
# ``source`` has ``x``'s dims. Per mesh dim, by the placement of ``x``:
#
# ============  ==============================  =================  =========================
# ``x``         index (and src)                 output             how
# ============  ==============================  =================  =========================
# S(d), d!=dim  gather family: S(d) when sizes  S(d)               each rank its rows
#               on d agree; index_select: R
# S(dim)        R                               writes: S(dim)     [Note: masked writes]
#                                               reads: P(sum)      [Note: masked reads]
# R             S on dim (reads)                S(dim)             each rank its indices
# R             S on dim (additive writes)      P(sum)             [Note: sharded additive index]
# P(op)         R (reads)                       P(op)              a read of each term
# P(sum)        R, src P(sum) (additive writes) P(sum)             writes are linear
# ============  ==============================  =================  =========================
#
# Where several rows apply, the one with the fewest collectives (then the
# fewest elements moved) wins (:func:`cheapest`); the last resort gathers that
# mesh dim of each argument, never the whole tensor. In-place forms never turn
# ``x`` partial.
# [Note: sharded additive index]
# ``scatter_add`` / ``index_add`` into a replicated ``x`` with the index cut:
# each rank adds its share of the contributions into its copy, ``x`` itself
# entering as ``Partial("sum")`` (one rank keeps it, the others hold zeros, no
# communication), so the ranks' results sum to the whole: the backward of a
# gather or index_select whose index was sharded.
def _along_dim(family: _Family, call: OpCall) -> Decision | None:
    """The table in the module docstring, mesh dim by mesh dim."""
    px_pos = _position(call, call.args[0])
    pi_pos = _position(call, call.args[2])
    if px_pos is None or pi_pos is None:
        return None
    lx, li = call.layout(px_pos), call.layout(pi_pos)
    if lx.ndim == 0:
        return None
    dim = int(call.args[1]) % lx.ndim
    src_pos = _position(call, call.args[3]) if len(call.args) > 3 else None
    ls: Layout | None = call.layout(src_pos) if src_pos is not None else None
    has_src = ls is not None and ls.ndim == lx.ndim  # a source with x's dims (not a 0-d fill value)
    inplace = is_inplace(call.func)
    x_numel = max(1, _numel(lx.shape))
    out_numel = (
        _numel(li.shape)
        if family.full_index
        else _numel(lx.shape) // max(1, lx.shape[dim]) * _numel(li.shape)
    )
    cheap_read = 2 * out_numel <= x_numel or (family.full_index and li.ndim == lx.ndim and li.shape[dim] == 1)

    def same_rows(d: int) -> bool:
        """Whether index (and src) are cut on ``d`` exactly like x (equal sizes)."""
        if not family.full_index:
            return True
        if li.ndim != lx.ndim or li.shape[d] != lx.shape[d]:
            return False
        return not has_src or (ls is not None and ls.shape[d] == li.shape[d])

    index_cut = Shard(dim) if family.full_index else Shard(0)
    src_fits = has_src and ls is not None and (not family.full_index or ls.shape[dim] == li.shape[dim])
    sizes = [_numel(lx.shape), _numel(li.shape), _numel(ls.shape) if ls is not None else 0]
    xs: list[Placement] = []
    ins: list[Placement] = []
    ss: list[Placement] = []
    out: list[Placement] = []
    masked_write = masked_read = False
    for m in range(lx.mesh.ndim):
        px, pi = lx.placements[m], li.placements[m]
        ps = ls.placements[m] if ls is not None else R
        # candidates (x, index, src, output), in order of preference among equal costs
        options: list[tuple[Placement, Placement, Placement, Placement]] = []
        for d in range(lx.ndim):
            if d != dim and same_rows(d):
                options.append(
                    (Shard(d), Shard(d) if family.full_index else R, Shard(d) if has_src else R, Shard(d))
                )
        if px == Shard(dim) and not family.reads:
            options.append((px, R, R, px))  # [Note: masked writes]
        if px == Shard(dim) and family.reads and cheap_read:
            options.append((px, R, R, SUM))  # [Note: masked reads]
        if isinstance(px, Partial) and family.reads:
            options.append((px, R, R, px))
        if px == SUM and family.additive and has_src:
            options.append((SUM, R, SUM, SUM))
        if family.reads and li.ndim > 0:
            options.append((R, index_cut, R, Shard(dim)))
        if family.additive and not inplace and src_fits and li.ndim > 0:
            options.append((SUM, index_cut, Shard(dim), SUM))  # [Note: sharded additive index]
        options.append((R, R, R, R))
        best = cheapest(options, (px, pi, ps), sizes)
        masked_read = masked_read or (family.reads and best[0] == Shard(dim))
        masked_write = masked_write or (not family.reads and best[0] == Shard(dim))
        xs.append(best[0])
        ins.append(best[1])
        ss.append(best[2])
        out.append(best[3])

    inputs = {px_pos: tuple(xs), pi_pos: tuple(ins)}
    if src_pos is not None:
        inputs[src_pos] = tuple(ss) if has_src else (R,) * lx.mesh.ndim
    kernel = None
    if masked_read:
        kernel = lambda local: _masked_read_kernel(family, local)  # noqa: E731
    elif masked_write:
        kernel = lambda local: _masked_write_kernel(family, local)  # noqa: E731
    return Decision(inputs=inputs, outputs=[tuple(out)], inplace=inplace, kernel=kernel)


def move_cost(source: Placement, target: Placement, numel: int) -> tuple[int, int]:
    """(collectives, elements moved) to take one mesh dim of a tensor from ``source`` to ``target``.

    Cutting a whole tensor (R to S) and turning it into sum terms (R to
    P(sum): zeros on the other ranks) are local; every other change is one
    collective moving about the tensor (twice for an all-reduce).
    """
    if source == target or isinstance(source, Replicate):
        return (0, 0)
    if isinstance(source, Partial) and isinstance(target, Replicate):
        return (1, 2 * numel)
    return (1, numel)


def cheapest(
    options: Sequence[tuple[Placement, ...]], current: Sequence[Placement], sizes: Sequence[int]
) -> Any:
    """The option (inputs' targets first, then outputs) with the fewest collectives, then elements moved.

    Among equal costs the option changing the fewest inputs' placements wins
    (inputs all replicated stay replicated: cutting them is free but hands
    the next op a cut it may have to gather back), then the earlier option.
    ``current`` and ``sizes`` are the inputs' placements on this mesh dim and
    their element counts.
    """

    def cost(option: tuple[Placement, ...]) -> tuple[int, int, int]:
        moves, moved, changed = 0, 0, 0
        for source, target, numel in zip(current, option, sizes, strict=False):
            step = move_cost(source, target, numel)
            moves, moved = moves + step[0], moved + step[1]
            changed += source != target
        return (moves, moved, changed)

    return min(options, key=cost)


def _numel(shape: tuple[int, ...]) -> int:
    total = 1
    for s in shape:
        total *= s
    return total


def _rule(family: _Family) -> Any:
    def rule(call: OpCall) -> Decision | None:
        return _along_dim(family, call)

    return rule


register(aten.gather)(_rule(_Family(reads=True, full_index=True, additive=False)))
register(aten.index_select)(_rule(_Family(reads=True, full_index=False, additive=False)))
register(aten.scatter, aten.scatter_, aten.scatter_reduce, aten.scatter_reduce_)(
    _rule(_Family(reads=False, full_index=True, additive=False))
)
register(aten.scatter_add, aten.scatter_add_)(_rule(_Family(reads=False, full_index=True, additive=True)))
register(aten.index_add, aten.index_add_)(_rule(_Family(reads=False, full_index=False, additive=True)))
register(aten.index_copy, aten.index_copy_, aten.index_reduce, aten.index_reduce_)(
    _rule(_Family(reads=False, full_index=False, additive=False))
)
register(aten.index_fill, aten.index_fill_)(
    _rule(_Family(reads=False, full_index=False, additive=False, wraps_negative=True))
)
