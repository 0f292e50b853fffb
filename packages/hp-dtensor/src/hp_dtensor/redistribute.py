"""Redistribution execution: run a plan's steps on local tensors, with autograd.

Each step is one collective along one mesh dim (see :mod:`hp_dtensor.planner`).
Uneven shards are padded to the largest shard of the line before a collective
and cut back afterwards, so every collective sees equal pieces; the sizes come
from the layout (no communication to learn them).

Collectives are called through the module ``hp_core.collectives`` at call
time, so a test can count them by wrapping that module's functions.

[Note: gradient placements]
Redistribution does not change the global value, so its gradient is the
output's gradient, whatever its placements. The backward moves it to the
input's placements, except that mesh dims where the input was ``Partial`` get
``Replicate``: a partial input's terms each receive the whole gradient
(d(sum of terms) / d(term) = 1), so the gradient there is replicated.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from typing import Any, cast

import hp_core.collectives as hc
import torch
import torch.autograd.profiler as _profiler
from hp_core import get_logger
from hp_core.distributed import mesh_group
from hp_core.work import Work
from torch.distributed._functional_collectives import _are_we_tracing

from hp_dtensor.layout import Layout, check_strided_order, chunk_sizes, strided_rows
from hp_dtensor.pending import PendingTensor, pending, then
from hp_dtensor.placements import Partial, Placement, Replicate, Shard, StridedShard
from hp_dtensor.planner import RedistributeStep, plan_redistribute

_log = get_logger("hp_dtensor")  # one line per plan built ([Note: debug levels] in hp_core.debug)

Post = Callable[[torch.Tensor], torch.Tensor]

__all__ = ["keep_destination_layout", "redistribute_local", "slice_for_layout"]


def _offsets(sizes: Sequence[int]) -> list[int]:
    return [0, *itertools.accumulate(sizes)][:-1]


def _done(result: Any, out: torch.Tensor, post: Post | None = None) -> torch.Tensor:
    """A step's result: ``post(out)`` now, or pending when ``result`` is an async :class:`Work`.

    See [Note: asynchronous redistribution] in :mod:`hp_dtensor.pending`.
    """
    if isinstance(result, Work):
        return pending(result, out, post)
    return out if post is None else post(out)


def _all_gather(
    local: torch.Tensor, layout: Layout, mesh_dim: int, dim: int, async_op: bool = False
) -> torch.Tensor:
    sizes = layout.line_sizes(mesh_dim, dim)
    uneven = sizes.count(sizes[0]) != len(sizes)
    group = mesh_group(layout.mesh, mesh_dim)
    x = local.contiguous() if dim == 0 else local.movedim(dim, 0).contiguous()  # dim 0: no shuffling
    out = x.new_empty((sum(sizes), *x.shape[1:]))
    result = hc.all_gather_into_tensor(
        out, x, group, async_op=async_op, input_sizes=sizes if uneven else None
    )
    return _done(result, out, None if dim == 0 else lambda full: full.movedim(0, dim).contiguous())


def _chunk(local: torch.Tensor, mesh: Any, mesh_dim: int, dim: int) -> torch.Tensor:
    sizes = chunk_sizes(local.shape[dim], mesh.size(mesh_dim))
    index = mesh.get_local_rank(mesh_dim)
    return local.narrow(dim, _offsets(sizes)[index], sizes[index]).contiguous()


def _all_reduce(
    local: torch.Tensor, op: str, mesh: Any, mesh_dim: int, async_op: bool = False
) -> torch.Tensor:
    buffer = local.clone(memory_format=torch.contiguous_format)
    return _done(hc.all_reduce(buffer, op, mesh_group(mesh, mesh_dim), async_op=async_op), buffer)


def _reduce_scatter(
    local: torch.Tensor, op: str, mesh: Any, mesh_dim: int, dim: int, async_op: bool = False
) -> torch.Tensor:
    n = mesh.size(mesh_dim)
    index = mesh.get_local_rank(mesh_dim)
    sizes = chunk_sizes(local.shape[dim], n)
    largest = max(sizes)
    x = local.movedim(dim, 0)
    rest = tuple(x.shape[1:])
    if all(s == largest for s in sizes):
        source = x.contiguous()
    else:
        source = x.new_zeros((n * largest, *rest))
        for k, (offset, size) in enumerate(zip(_offsets(sizes), sizes, strict=True)):
            source[k * largest : k * largest + size].copy_(x[offset : offset + size])
    out = x.new_empty((largest, *rest))
    result = hc.reduce_scatter_tensor(out, source, op, mesh_group(mesh, mesh_dim), async_op=async_op)
    return _done(result, out, lambda chunk: chunk[: sizes[index]].movedim(0, dim).contiguous())


def _all_to_all(
    local: torch.Tensor, layout: Layout, mesh_dim: int, src_dim: int, dst_dim: int, async_op: bool = False
) -> torch.Tensor:
    mesh = layout.mesh
    n = mesh.size(mesh_dim)
    me = mesh.get_local_rank(mesh_dim)
    src_sizes = layout.line_sizes(mesh_dim, src_dim)
    dst_sizes = chunk_sizes(local.shape[dst_dim], n)
    cell = 1
    for d, size in enumerate(local.shape):
        if d not in (src_dim, dst_dim):
            cell *= size
    pieces = [
        local.narrow(dst_dim, offset, size).contiguous().reshape(-1)
        for offset, size in zip(_offsets(dst_sizes), dst_sizes, strict=True)
    ]
    send = torch.cat(pieces)
    in_splits = [local.shape[src_dim] * dst_sizes[k] * cell for k in range(n)]
    out_splits = [src_sizes[k] * dst_sizes[me] * cell for k in range(n)]
    recv = send.new_empty((sum(out_splits),))
    result = hc.all_to_all_single(
        recv, send, out_splits, in_splits, mesh_group(mesh, mesh_dim), async_op=async_op
    )

    def assemble(received: torch.Tensor) -> torch.Tensor:
        shaped = []
        for k, piece in enumerate(received.split(out_splits)):
            shape = list(local.shape)
            shape[src_dim] = src_sizes[k]
            shape[dst_dim] = dst_sizes[me]
            shaped.append(piece.view(shape))
        return torch.cat(shaped, dim=src_dim)

    return _done(result, recv, assemble)


def _to_partial(local: torch.Tensor, dst: Partial, mesh: Any, mesh_dim: int) -> torch.Tensor:
    # A replicated value as terms whose reduction gives it back: for a sum one
    # rank keeps the value and the others hold zeros (exact, unlike dividing);
    # avg, max and min of equal terms are the term itself; for a product the
    # others hold ones. A finite p-norm's others hold a term whose p-th power
    # is 0: 0 for p > 0, inf for p < 0.
    if mesh.get_local_rank(mesh_dim) == 0:
        return local
    if dst.reduce_op == "sum":
        return torch.zeros_like(local)
    if dst.reduce_op == "product":
        return torch.ones_like(local)
    if dst.reduce_op == "norm" and dst.norm_type not in (_INF, -_INF):
        return torch.full_like(local, 0.0 if cast(float, dst.norm_type) > 0 else _INF)
    return local


_INF = float("inf")


# [Note: strided gather order]
# Collectives concatenate the ranks' pieces in rank order. Under
# ``StridedShard`` a rank's piece is one run from each block, so that order
# is not the tensor's: the rows are put back with one ``index_select`` by a
# permutation computed from the sizes alone (:func:`_gathered_order`; no
# communication, the same on every rank).
@functools.lru_cache(maxsize=1024)
def _gathered_order(size: int, split_factor: int, parts: int) -> tuple[int, ...]:
    """For each row of the whole dim, its position in the rank-order concatenation of the strided pieces."""
    concatenated = [row for rank in range(parts) for row in strided_rows(size, split_factor, parts, rank)]
    order = [0] * size
    for position, row in enumerate(concatenated):
        order[row] = position
    return tuple(order)


def _pick(dim: int, rows: Sequence[int]) -> Post:
    """``index_select`` of ``rows`` along ``dim`` (the index built on the value's device, meta included)."""
    return lambda value: value.index_select(dim, torch.tensor(rows, dtype=torch.long, device=value.device))


def _after(value: torch.Tensor, post: Post) -> torch.Tensor:
    """``post(value)``, still pending when ``value`` is (see [Note: asynchronous redistribution])."""
    if isinstance(value, PendingTensor):
        return then(value, post)
    return post(value)


def _reduce_partial(local: torch.Tensor, src: Partial, run: Any) -> torch.Tensor:
    """``run(terms, op)`` (one collective) for ``src``; a norm's power before it and root after it.

    See [Note: norm partials] in :mod:`hp_dtensor.placements`.
    """
    if src.reduce_op != "norm":
        return run(local, src.reduce_op)
    p = cast(float, src.norm_type)  # a norm partial's norm_type is always set (Partial.__post_init__)
    if p in (_INF, -_INF):
        return run(local, "max" if p > 0 else "min")
    return run(local.pow(p), "sum").pow(1.0 / p)


class _Runner:
    """hp_core's collectives for one step on one mesh dim: the :class:`StepRunner` placements call."""

    __slots__ = ("async_op", "layout", "mesh_dim")

    def __init__(self, layout: Layout, mesh_dim: int, async_op: bool) -> None:
        self.layout, self.mesh_dim, self.async_op = layout, mesh_dim, async_op

    def all_gather(self, local: torch.Tensor, dim: int) -> torch.Tensor:
        return _all_gather(local, self.layout, self.mesh_dim, dim, self.async_op)

    def all_to_all(self, local: torch.Tensor, src_dim: int, dst_dim: int) -> torch.Tensor:
        return _all_to_all(local, self.layout, self.mesh_dim, src_dim, dst_dim, self.async_op)

    def chunk(self, local: torch.Tensor, dim: int) -> torch.Tensor:
        return _chunk(local, self.layout.mesh, self.mesh_dim, dim)

    def to_partial(self, local: torch.Tensor, target: Partial) -> torch.Tensor:
        return _to_partial(local, target, self.layout.mesh, self.mesh_dim)

    def strided_gather(self, local: torch.Tensor, dim: int, split_factor: int) -> torch.Tensor:
        size = sum(self.layout.line_sizes(self.mesh_dim, dim))
        order = _gathered_order(size, split_factor, self.layout.mesh.size(self.mesh_dim))
        return _after(self.all_gather(local, dim), _pick(dim, order))

    def strided_chunk(self, local: torch.Tensor, dim: int, split_factor: int) -> torch.Tensor:
        mesh = self.layout.mesh
        rows = strided_rows(
            local.shape[dim], split_factor, mesh.size(self.mesh_dim), mesh.get_local_rank(self.mesh_dim)
        )
        return _pick(dim, rows)(local)

    def strided_to_shard(
        self, local: torch.Tensor, src_dim: int, split_factor: int, dst_dim: int
    ) -> torch.Tensor:
        size = sum(self.layout.line_sizes(self.mesh_dim, src_dim))
        order = _gathered_order(size, split_factor, self.layout.mesh.size(self.mesh_dim))
        return _after(self.all_to_all(local, src_dim, dst_dim), _pick(src_dim, order))

    def reduce(self, local: torch.Tensor, source: Partial, shard_dim: int | None) -> torch.Tensor:
        mesh, m, async_op = self.layout.mesh, self.mesh_dim, self.async_op
        if shard_dim is None:
            return _reduce_partial(local, source, lambda x, op: _all_reduce(x, op, mesh, m, async_op))
        return _reduce_partial(
            local, source, lambda x, op: _reduce_scatter(x, op, mesh, m, shard_dim, async_op)
        )


def _run_step(
    local: torch.Tensor, layout: Layout, step: RedistributeStep, async_op: bool = False
) -> torch.Tensor:
    """One planned step, done by the source placement ([Note: placement transforms])."""
    return step.src.run_step(step.dst, local, _Runner(layout, step.mesh_dim, async_op))


def _next_layout(layout: Layout, mesh_dim: int, target: Placement) -> Layout:
    placements = list(layout.placements)
    source = placements[mesh_dim]
    placements[mesh_dim] = target
    if layout.ragged is None:
        return Layout(layout.mesh, placements, layout.shape, layout.stride)
    mesh_shape = layout.mesh.shape
    n = mesh_shape[mesh_dim]
    table = []
    for coord in itertools.product(*(range(s) for s in mesh_shape)):
        sizes = list(layout.local_shape_at(coord))
        line = [[*coord[:mesh_dim], k, *coord[mesh_dim + 1 :]] for k in range(n)]
        if isinstance(source, Shard):  # the shard dim becomes whole along this line
            sizes[source.dim] = sum(layout.local_shape_at(c)[source.dim] for c in line)
        if isinstance(target, Shard):
            sizes[target.dim] = chunk_sizes(sizes[target.dim], n)[coord[mesh_dim]]
        table.append(tuple(sizes))
    return Layout(layout.mesh, placements, layout.shape, layout.stride, ragged=table)


def slice_for_layout(full: torch.Tensor, layout: Layout) -> torch.Tensor:
    """This rank's piece of the full (replicated) value under ``layout``, partial terms included."""
    if any(isinstance(p, StridedShard) for p in layout.placements):
        local = _cut_in_mesh_order(full, layout)
    else:
        local = full
        for dim, (offset, size) in enumerate(zip(layout.local_offset(), layout.local_shape(), strict=True)):
            if size != full.shape[dim]:
                local = local.narrow(dim, offset, size)
    for mesh_dim, placement in enumerate(layout.placements):
        if isinstance(placement, Partial):
            local = _to_partial(local, placement, layout.mesh, mesh_dim)
    return local.contiguous()


def _cut_in_mesh_order(full: torch.Tensor, layout: Layout) -> torch.Tensor:
    """This rank's piece of ``full``, cut one mesh dim at a time, lower first (for ``StridedShard``).

    Such layouts are never ragged (``Layout`` refuses it), so every cut is the
    default one of what the lower mesh dims left.
    """
    mesh = layout.mesh
    local = full
    for mesh_dim, placement in enumerate(layout.placements):
        n, index = mesh.size(mesh_dim), mesh.get_local_rank(mesh_dim)
        if isinstance(placement, Shard):
            sizes = chunk_sizes(local.shape[placement.dim], n)
            local = local.narrow(placement.dim, sum(sizes[:index]), sizes[index])
        elif isinstance(placement, StridedShard):
            rows = strided_rows(local.shape[placement.dim], placement.split_factor, n, index)
            local = _pick(placement.dim, rows)(local)
    return local


def redistribute_local(
    local: torch.Tensor, src: Layout, dst: Sequence[Placement] | Layout, *, async_op: bool = False
) -> tuple[torch.Tensor, Layout]:
    """Move ``local`` (held under ``src``) to ``dst``; returns the new local tensor and its layout.

    ``dst`` as placements means the default chunk sizes; a ragged target
    Layout (used for gradients of ragged inputs) is reached through Replicate.

    With ``async_op=True`` the last collective is left in flight and the
    local tensor returned is a :class:`~hp_dtensor.pending.PendingTensor`
    that waits on first use ([Note: asynchronous redistribution]); while
    ``torch.compile`` traces, the flag is ignored (the compiler orders the
    functional collectives itself). A pending ``local`` is waited for first.

    Under an active profiler the work shows as ``hp_dtensor::redistribute``
    (forward and backward), so a profile tells redistribution apart from the
    model's own ops; without one only a module attribute is read (no
    ``record_function`` object per call on this hot path).
    """
    if local.__class__ is PendingTensor:
        local = local.wait()  # type: ignore[attr-defined]
    if async_op and _are_we_tracing():
        async_op = False
    if _profiler._is_profiler_enabled:
        with torch.profiler.record_function("hp_dtensor::redistribute"):
            return _redistribute_local(local, src, dst, async_op)
    return _redistribute_local(local, src, dst, async_op)


def _redistribute_local(
    local: torch.Tensor, src: Layout, dst: Sequence[Placement] | Layout, async_op: bool
) -> tuple[torch.Tensor, Layout]:
    if isinstance(dst, Layout):
        target_layout: Layout | None = dst
        placements = dst.placements
    else:
        target_layout = None
        placements = tuple(dst)
    if src.placements == placements and (target_layout is None or target_layout == src):
        if target_layout is None and src.ragged is None:
            return local, src
        if target_layout is not None:
            return local, src
    ragged = src.ragged is not None or (target_layout is not None and target_layout.ragged is not None)
    if ragged:
        # Ragged sizes: gather everything (sizes from the table), then cut the target's piece.
        full, _ = _run_plan(local, src, tuple(Replicate() for _ in placements), async_op)
        final = target_layout if target_layout is not None else src.with_placements(placements)
        if isinstance(full, PendingTensor):
            return then(full, lambda value: slice_for_layout(value, final)), final
        return slice_for_layout(full, final), final
    return _run_plan(local, src, placements, async_op)


# (source layout token, target placements, itemsize) -> ((step, layout before, layout after), ...)
_Program = tuple[tuple[RedistributeStep, Layout, Layout], ...]
_PROGRAMS: dict[tuple[int, tuple[Placement, ...], int], _Program] = {}
_MAX_PROGRAMS = 4096


def _program(layout: Layout, placements: tuple[Placement, ...], itemsize: int) -> _Program:
    """The plan's steps with the layout before and after each, built once per (layout, target).

    Reusing the layouts (not only the plan) keeps redistribution from
    building Layout objects per call, and keeps each result's layout token
    stable, so the ops that consume it hit the dispatch fast path. Keyed by
    the layout's token, which tells apart equal meshes that are different
    objects (see :meth:`Layout.token`).
    """
    key = (layout.token(), placements, itemsize)
    program = _PROGRAMS.get(key)
    if program is None:
        steps = []
        current = layout
        planned: Sequence[RedistributeStep] = plan_redistribute(layout, placements, itemsize).steps
        if not _strided_order_kept(layout.placements, planned):
            planned = _gather_then_cut(layout.placements, placements)
        for step in planned:
            after = _next_layout(current, step.mesh_dim, step.dst)
            steps.append((step, current, after))
            current = after
        program = tuple(steps)
        _log.debug("redistribute plan %s -> %s: %s", layout.placements, placements, [s[0] for s in program])
        if len(_PROGRAMS) >= _MAX_PROGRAMS:
            _PROGRAMS.clear()
        _PROGRAMS[key] = program
    return program


def _strided_order_kept(start: tuple[Placement, ...], steps: Sequence[RedistributeStep]) -> bool:
    """Whether no state of the plan has a ``StridedShard`` above another cut of its dim.

    The planner orders the steps of nested cuts by ``Shard`` alone ([Note:
    nested shard order] in :mod:`hp_dtensor.planner`); a plan through such a
    state could gather a lower mesh dim under a strided cut of the same dim.
    """
    state = list(start)
    for step in steps:
        state[step.mesh_dim] = step.dst
        try:
            check_strided_order(state, "redistribute")
        except ValueError:
            return False
    return True


def _gather_then_cut(start: tuple[Placement, ...], target: tuple[Placement, ...]) -> list[RedistributeStep]:
    """A plan right whatever cuts what: gather the changed mesh dims highest first, then cut lowest first.

    Used when the planner's plan would pass through a state
    :func:`_strided_order_kept` refuses. Every gather meets no cut above it
    and every cut none either, so no step depends on nesting.
    """
    first = next((m for m in range(len(start)) if start[m] != target[m]), len(start))
    state = list(start)
    steps: list[RedistributeStep] = []

    def move(mesh_dim: int, placement: Placement) -> None:
        def free(dim: int) -> bool:
            return not any(p.is_shard(dim) for p in state[mesh_dim + 1 :])

        collective = state[mesh_dim].step_to(placement, free)
        assert collective is not None, f"no step {state[mesh_dim]} -> {placement} in {state}"
        steps.append(RedistributeStep(mesh_dim, state[mesh_dim], placement, collective, 0))
        state[mesh_dim] = placement

    for mesh_dim in reversed(range(first, len(start))):
        if not isinstance(state[mesh_dim], Replicate):
            move(mesh_dim, Replicate())
    for mesh_dim in range(first, len(start)):
        if not isinstance(target[mesh_dim], Replicate):
            move(mesh_dim, target[mesh_dim])
    return steps


def _run_plan(
    local: torch.Tensor, layout: Layout, placements: tuple[Placement, ...], async_op: bool = False
) -> tuple[torch.Tensor, Layout]:
    program = _program(layout, placements, local.element_size())
    if program and (local.is_conj() or local.is_neg()):
        # Collectives read raw memory: apply lazy bits first ([Note: lazy conjugate and negative bits]).
        local = local.resolve_conj().resolve_neg()
    if async_op:
        return _run_plan_async(local, program, layout)
    for step, before, after in program:
        local = _run_step(local, before, step)
        layout = after
    return local, layout


def _run_plan_async(local: torch.Tensor, program: _Program, layout: Layout) -> tuple[torch.Tensor, Layout]:
    """The plan with its last collective left in flight; local steps after it run on first use.

    Steps before the last collective are waited for (each needs the data of
    the one before); see [Note: asynchronous redistribution].
    """
    last = max(
        (i for i, (step, _, _) in enumerate(program) if not step.collective.startswith("local")), default=-1
    )
    for index, (step, before, after) in enumerate(program[: last + 1]):
        local = _run_step(local, before, step, async_op=index == last)
        layout = after
    tail = program[last + 1 :]
    if not tail:
        return local, layout

    def local_steps(value: torch.Tensor) -> torch.Tensor:
        for step, before, _ in tail:
            value = _run_step(value, before, step)
        return value

    final = tail[-1][2]
    if isinstance(local, PendingTensor):
        return then(local, local_steps), final
    return local_steps(local), final


# [Note: an in-place op keeps its destination's layout]
# A rule may run an in-place op (``x.add_(y)``, ``x.copy_(y)``,
# ``torch._foreach_add_(params, updates)``) on its destination moved to other
# placements: a ``StridedShard`` operand moves a plain ``Shard`` destination to
# the strided cut, a ``Partial`` destination is reduced. Leaving the
# destination there would change the placements of a tensor the caller holds
# (torch's DTensor refuses such ops) and replace its local tensor, which may be
# a view into storage someone else owns (hp-fsdp's sharded parameters live in
# one flat buffer per group, and an optimizer writes them in place). So after
# the op the result is moved back to the destination's own layout and written
# into its original local tensor: one more redistribution in those rare calls,
# never a changed placement or a broken alias. One exception: a ``Partial``
# destination the op had to reduce stays reduced (``Replicate`` or ``Shard``
# on that mesh dim): its value is the same, and moving it back would only make
# the next op reduce it again (``clip_grad_norm_``'s ``_foreach_mul_`` on
# partial gradients, then the optimizer step).
def keep_destination_layout(dt: Any, local: torch.Tensor, layout: Layout) -> None:
    """Move in-place result ``dt`` back to ``layout`` and into ``local``, the tensors it had before the op."""
    if dt._layout == layout and dt._local is local:
        return
    if all(
        now == before or isinstance(before, Partial)
        for now, before in zip(dt._layout.placements, layout.placements, strict=True)
    ):
        return  # only partial sums were reduced: the same value, kept reduced (no second reduction later)
    back, _ = redistribute_local(
        dt._local, dt._layout, layout if layout.ragged is not None else layout.placements
    )
    local.copy_(back)
    dt._local, dt._layout = local, layout
