"""Shape ops: views, transposes, permutes, (un)squeeze, expand, split, unbind, cat and stack.

These ops only relabel or regroup dims, so a shard survives when its dim
maps to an output dim whose pieces are the same elements: a transpose moves
``Shard(d)`` (or ``StridedShard(d, k)``) to the new position of ``d``; a view
that merges or splits dims keeps the cut when the ``torch.chunk`` cut of the
input dim and of the output dim select the same rows (checked exactly, uneven
sizes included): as a ``Shard`` when the cut dim is the outermost of its group,
as a ``StridedShard`` when outer dims merge into it ([Note: views of a cut
dim]). Otherwise that mesh dim is gathered first. Partial and replicated
values pass through every shape op.

The ``*_copy`` forms (``t_copy``, ``view_copy``, ``squeeze_copy``, ...) move
the same elements as their views into new storage, so they share the views'
rules (and ``unsafe_split``/``unsafe_chunk`` those of ``split``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from hp_dtensor.layout import Layout, chunk_sizes
from hp_dtensor.ops.dispatch import Decision, LocalCall, OpCall, register
from hp_dtensor.ops.strided import reads_strided
from hp_dtensor.placements import Partial, Placement, Replicate, Shard, StridedShard

__all__ = ["covers", "map_dims", "view_groups"]

aten = torch.ops.aten


def _moved(placement: Shard | StridedShard, dim: int) -> Placement:
    """The same cut on tensor dim ``dim``."""
    if isinstance(placement, StridedShard):
        return StridedShard(dim, placement.split_factor)
    return Shard(dim)


def map_dims(call: OpCall, mapping: Sequence[int | None], out_ndim: int) -> Decision:
    """Shard(d) -> Shard(mapping[d]) (a StridedShard likewise); a None entry means the dim cannot stay cut."""
    position = call.positions[0]
    layout = call.layout(position)
    inputs: list[Placement] = []
    out: list[Placement] = []
    for placement in layout.placements:
        if isinstance(placement, (Shard, StridedShard)):
            target = mapping[placement.dim]
            if target is None:
                inputs.append(Replicate())
                out.append(Replicate())
            else:
                inputs.append(placement)
                out.append(_moved(placement, target))
        else:
            inputs.append(placement)
            out.append(placement)
    return Decision(inputs={position: tuple(inputs)}, outputs=[tuple(out)])


@register(aten.t.default, aten.transpose.int, aten.t_copy.default, aten.transpose_copy.int)
@reads_strided
def transpose_rule(call: OpCall) -> Decision:
    """Swap two dims; the shard follows its dim."""
    ndim = call.layout(call.positions[0]).ndim
    mapping: list[int | None] = list(range(ndim))
    if ndim == 0:  # t() and transpose(0, -1) of a 0-dim tensor return it as it is
        return map_dims(call, mapping, ndim)
    if call.func in (aten.t.default, aten.t_copy.default):
        d0, d1 = 0, min(1, ndim - 1)
    else:
        d0, d1 = int(call.args[1]) % ndim, int(call.args[2]) % ndim
    mapping[d0], mapping[d1] = d1, d0
    return map_dims(call, mapping, ndim)


@register(aten.permute.default, aten.permute_copy.default)
@reads_strided
def permute_rule(call: OpCall) -> Decision:
    """Reorder dims; the shard follows its dim."""
    ndim = call.layout(call.positions[0]).ndim
    order = [int(d) % ndim for d in call.args[1]]
    mapping: list[int | None] = [0] * ndim
    for new, old in enumerate(order):
        mapping[old] = new
    return map_dims(call, mapping, ndim)


@register(aten.unsqueeze.default, aten.unsqueeze_copy.default)
@reads_strided
def unsqueeze_rule(call: OpCall) -> Decision:
    """Insert a size-1 dim; later dims shift by one."""
    ndim = call.layout(call.positions[0]).ndim
    dim = int(call.args[1]) % (ndim + 1)
    return map_dims(call, [d if d < dim else d + 1 for d in range(ndim)], ndim + 1)


_SQUEEZE_DIMS = {
    **dict.fromkeys((aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default), aten.squeeze.dims),
    **dict.fromkeys(
        (aten.squeeze_copy.dim, aten.squeeze_copy.dims, aten.squeeze_copy.default), aten.squeeze_copy.dims
    ),
}


@register(*_SQUEEZE_DIMS)
@reads_strided
def squeeze_rule(call: OpCall) -> Decision:
    """Drop the dims of global size 1.

    The local op is told exactly which dims: ``squeeze()`` on a piece would
    also drop a dim that is 1 only locally (a shard of 3 rows over 2 ranks
    leaves rank 1 one row), and ``squeeze(d)`` likewise.
    """
    layout = call.layout(call.positions[0])
    ndim = layout.ndim
    if call.func in (aten.squeeze.default, aten.squeeze_copy.default):
        drop = {d for d in range(ndim) if layout.shape[d] == 1}
    elif call.func in (aten.squeeze.dim, aten.squeeze_copy.dim):
        drop = {int(call.args[1]) % max(ndim, 1)} if ndim else set()
    else:
        drop = {int(d) % max(ndim, 1) for d in call.args[1]} if ndim else set()
    drop = {d for d in drop if layout.shape[d] == 1}
    mapping: list[int | None] = []
    new = 0
    for d in range(ndim):
        if d in drop:
            mapping.append(None)
        else:
            mapping.append(new)
            new += 1
    decision = map_dims(call, mapping, new)
    dims = tuple(sorted(drop))
    by_dims = _SQUEEZE_DIMS[call.func]
    decision.kernel = lambda local: by_dims(local.args[0], dims)
    return decision


@register(aten.expand.default, aten.expand_copy.default)
@reads_strided
def expand_rule(call: OpCall) -> Decision:
    """Broadcast size-1 dims; existing dims keep their shard (an expanded dim had size 1, never cut)."""
    layout = call.layout(call.positions[0])
    sizes = list(call.args[1])
    lead = len(sizes) - layout.ndim
    mapping: list[int | None] = []
    for d in range(layout.ndim):
        expanded = layout.shape[d] == 1 and sizes[d + lead] not in (-1, 1)
        mapping.append(None if expanded else d + lead)
    decision = map_dims(call, mapping, len(sizes))
    decision.size_arg = 1
    return decision


def view_groups(src: Sequence[int], dst: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """Pair up runs of input and output dims with equal products (size-1 dims join the next group)."""
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(src) or j < len(dst):
        gi: list[int] = []
        gj: list[int] = []
        pi = pj = 1
        while True:
            if pi == pj and (gi or gj) and (i >= len(src) or src[i] != 1) and (j >= len(dst) or dst[j] != 1):
                break
            if (pi <= pj or j >= len(dst)) and i < len(src):
                pi *= src[i]
                gi.append(i)
                i += 1
            elif j < len(dst):
                pj *= dst[j]
                gj.append(j)
                j += 1
            else:
                break
        groups.append((gi, gj))
    return groups


# [Note: views of a cut dim]
# Take the group of input dims a view merges or splits (:func:`view_groups`),
# its elements numbered row-major, and a cut of input dim ``d`` in it: ``P``
# elements of outer dims before ``d``, ``b`` rows of ``d``, ``I`` elements of
# inner dims after. Rank ``r`` holds, in each of the ``P`` outer blocks, the
# run of ``torch.chunk(b, n)[r] * I`` elements. In the output group, the dim
# ``k`` where that outer boundary falls (``Q = P / prefix`` outer blocks of it,
# ``prefix`` the product of the output dims before it, ``J`` the elements
# after it) holds the same elements in each of its ``Q`` blocks exactly when
# ``torch.chunk(b, n)`` times ``I`` equals ``torch.chunk(b * I / J, n)`` times
# ``J``: the cut is ``Shard(k)`` for ``Q = 1`` and ``StridedShard(k, Q)``
# otherwise. A ``StridedShard(d, k)`` input is read as a ``Shard`` of the
# second dim of ``d`` split into ``(k, size / k)`` (when ``k`` divides the
# size, its blocks are then equal), so the view that splits the merged dim
# again finds that ``Shard``. Anything else is gathered.
def _cut_after_view(
    shape: Sequence[int], placement: Shard | StridedShard, out_shape: Sequence[int], n: int
) -> Placement:
    """The placement of the view's output for one mesh dim of size ``n`` cutting ``placement.dim``."""
    d = placement.dim
    if isinstance(placement, StridedShard):
        factor = placement.split_factor
        if shape[d] % factor:
            return Replicate()
        shape = [*shape[:d], factor, shape[d] // factor, *shape[d + 1 :]]
        d += 1
    group = next(((gi, gj) for gi, gj in view_groups(shape, out_shape) if d in gi), None)
    if group is None:
        return Replicate()
    gi, gj = group
    outer = math.prod(shape[x] for x in gi if x < d)
    inner = math.prod(shape[x] for x in gi if x > d)
    rows = shape[d]
    if outer == 1:  # the cut dim leads its group: the first output dim of size > 1 takes it
        lead = [x for x in gj if out_shape[x] != 1]
        if not lead:
            return Replicate()
        k = lead[0]
        after = math.prod(out_shape[x] for x in gj if x > k)
        if [s * inner for s in chunk_sizes(rows, n)] == [s * after for s in chunk_sizes(out_shape[k], n)]:
            return Shard(k)
        return Replicate()
    if outer == 0:
        return Replicate()
    prefix = 1
    for k in gj:
        if prefix * out_shape[k] > outer:
            break
        prefix *= out_shape[k]
    else:
        return Replicate()
    after = math.prod(out_shape[x] for x in gj if x > k)
    if outer % prefix or (rows * inner) % after:
        return Replicate()
    blocks, block = outer // prefix, rows * inner // after
    if out_shape[k] != blocks * block:
        return Replicate()
    if [s * inner for s in chunk_sizes(rows, n)] != [s * after for s in chunk_sizes(block, n)]:
        return Replicate()
    return Shard(k) if blocks == 1 else StridedShard(k, blocks)


def _view_decision(call: OpCall, layout: Layout, out_shape: Sequence[int]) -> Decision:
    mesh = layout.mesh
    inputs: list[Placement] = []
    out: list[Placement] = []
    for m, placement in enumerate(layout.placements):
        if not isinstance(placement, (Shard, StridedShard)):
            inputs.append(placement)
            out.append(placement)
            continue
        shared = any(p.is_shard(placement.dim) for i, p in enumerate(layout.placements) if i != m)
        keep = Replicate() if shared else _cut_after_view(layout.shape, placement, out_shape, mesh.shape[m])
        inputs.append(placement if not isinstance(keep, Replicate) else Replicate())
        out.append(keep)
    for m, placement in enumerate(out):
        # Each mesh dim's cut was derived alone; a strided cut nested with another cut of the same
        # output dim would need both derived together (the higher one cuts the lower one's piece).
        if isinstance(placement, StridedShard) and any(
            p.is_shard(placement.dim) for i, p in enumerate(out) if i != m
        ):
            inputs[m] = out[m] = Replicate()
    return Decision(inputs={call.positions[0]: tuple(inputs)}, outputs=[tuple(out)], size_arg=1)


def _infer(shape: Sequence[int], sizes: Sequence[int]) -> list[int]:
    sizes = [int(s) for s in sizes]
    if -1 in sizes:
        known = math.prod(s for s in sizes if s != -1)
        sizes[sizes.index(-1)] = math.prod(shape) // known if known else 0
    return sizes


@register(aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.view_copy.default)
@reads_strided
def view_rule(call: OpCall) -> Decision:
    """Regroup dims; see the module docstring for when a shard survives."""
    layout = call.layout(call.positions[0])
    return _view_decision(call, layout, _infer(layout.shape, call.args[1]))


@register(
    aten.split.Tensor,
    aten.split_with_sizes.default,
    aten.unsafe_split.Tensor,
    aten.unsafe_split_with_sizes.default,
    aten.split_copy.Tensor,
    aten.split_with_sizes_copy.default,
)
@reads_strided
def split_rule(call: OpCall) -> Decision:
    """Split along one dim: that dim must be whole; other shards carry over to every piece."""
    layout = call.layout(call.positions[0])
    dim = (int(call.args[2]) if len(call.args) > 2 else int(call.kwargs.get("dim", 0))) % layout.ndim
    inputs = tuple(Replicate() if p.is_shard(dim) else p for p in layout.placements)
    sizes = call.args[1] if len(call.args) > 1 else call.kwargs["split_size"]
    if isinstance(sizes, (list, tuple)):
        pieces = len(sizes)
    else:
        pieces = -(-layout.shape[dim] // int(sizes)) if layout.shape[dim] else 1
    return Decision(inputs={call.positions[0]: inputs}, outputs=[inputs] * max(pieces, 1))


@register(aten.unbind.int, aten.unbind_copy.int)
@reads_strided
def unbind_rule(call: OpCall) -> Decision:
    """One output per index of a dim: that dim must be whole; other shards carry over, shifted down."""
    layout = call.layout(call.positions[0])
    dim = (int(call.args[1]) if len(call.args) > 1 else int(call.kwargs.get("dim", 0))) % max(layout.ndim, 1)
    decision = map_dims(call, _dropping(layout.ndim, dim), layout.ndim - 1)
    decision.outputs = decision.outputs * layout.shape[dim]
    return decision


def _dropping(ndim: int, dim: int, dropped: bool = True) -> list[int | None]:
    """Dim mapping of an op that removes (or, ``dropped=False``, rewrites) ``dim`` and keeps the rest."""
    return [None if d == dim else d - 1 if dropped and d > dim else d for d in range(ndim)]


def _cut_elsewhere(layouts: Sequence[Layout], m: int, dim: int) -> Placement | None:
    """The first input's cut on mesh dim ``m`` of a dim other than ``dim`` (what the output can keep)."""
    for layout in layouts:
        placement = layout.placements[m]
        if isinstance(placement, (Shard, StridedShard)) and placement.dim != dim:
            return placement
    return None


# [Note: concatenating cut tensors]
# ``cat`` and ``stack`` move no element across ranks when every input is cut
# the same way on the dims they keep, so on each mesh dim the output takes a
# cut that some input has on such a dim (not only the first input's), and
# replicated inputs are cut to it locally: ``cat([R, S(1)], 0)`` is ``S(1)``
# with no communication, where gathering the cut input would move it whole.
# ``cat`` along the cut dim itself, of ``k`` inputs of one size there, each
# cut ``S(d)`` (or replicated, then cut locally), is ``StridedShard(d, k)``:
# rank ``r`` holds piece ``r`` of every input, in input order, which is piece
# ``r`` of each of the ``k`` equal blocks of the result.
@register(aten.cat.default)
@reads_strided
def cat_rule(call: OpCall) -> Decision:
    """Concatenate along one dim: other dims keep a cut, the cat dim strided or gathered.

    See [Note: concatenating cut tensors].
    """
    tensors = [t for t in call.args[0]]
    dim = int(call.args[1]) if len(call.args) > 1 else int(call.kwargs.get("dim", 0))
    layouts = [call.layout(call.position_of(t)) for t in tensors]
    ref = next((lay for lay in layouts if lay.ndim > 1 or lay.shape != (0,)), layouts[0])
    dim %= ref.ndim
    joined = [lay for lay in layouts if lay.ndim == ref.ndim]  # torch.cat skips legacy empty (0,) tensors
    target: list[Placement] = []
    out: list[Placement] = []
    strided_at = _strided_cat_mesh_dim(joined, dim)
    for m, placement in enumerate(ref.placements):
        kept = _cut_elsewhere(joined, m, dim)
        if m == strided_at:
            target.append(Shard(dim))
            out.append(Shard(dim) if len(joined) == 1 else StridedShard(dim, len(joined)))
            continue
        if kept is None:
            kept = placement if isinstance(placement, Replicate) else Replicate()
        target.append(kept)
        out.append(kept)
    inputs = {
        call.position_of(t): tuple(target)
        for t, lay in zip(tensors, layouts, strict=True)
        if lay.ndim == ref.ndim
    }
    return Decision(inputs=inputs, outputs=[tuple(out)])


def _strided_cat_mesh_dim(layouts: Sequence[Layout], dim: int) -> int | None:
    """The mesh dim whose ``S(dim)`` inputs a ``cat`` along ``dim`` keeps as a ``StridedShard``, if any."""
    if len({lay.shape[dim] for lay in layouts}) != 1:
        return None
    for m in range(layouts[0].mesh.ndim):
        seen = {lay.placements[m] for lay in layouts}
        if Shard(dim) not in seen or not seen <= {Shard(dim), Replicate()}:
            continue
        if any(p.is_shard(dim) for lay in layouts for i, p in enumerate(lay.placements) if i != m):
            return None  # another mesh dim cuts the dim too: the pieces would nest
        return m
    return None


@register(aten.stack.default)
@reads_strided
def stack_rule(call: OpCall) -> Decision:
    """Stack along a new dim: the inputs' cuts of the existing dims are kept.

    Stacking moves no element across ranks: a shard of dim ``d`` stays a shard
    of the same rows, at ``d + 1`` when the new dim comes before it. On a mesh
    dim where every input is the same partial or replicated, the output is
    that partial: each element reduces on its own, so the stack of terms is
    the term of the stack, and a replicated input becomes a term locally (no
    communication; ``clip_grad_norm_`` stacks partial per-tensor norms).
    Other partial terms are summed first (as for ``cat``). A replicated input
    is cut like a cut one ([Note: concatenating cut tensors]).
    """
    tensors = list(call.args[0])
    layouts = [call.layout(call.position_of(t)) for t in tensors]
    ref = layouts[0]
    dim = int(call.args[1]) if len(call.args) > 1 else int(call.kwargs.get("dim", 0))
    dim %= ref.ndim + 1
    target: list[Placement] = []
    for m, placement in enumerate(ref.placements):
        seen = {layout.placements[m] for layout in layouts}
        partials = [p for p in seen if isinstance(p, Partial)]
        cut = _cut_elsewhere(layouts, m, -1)
        if len(partials) == 1 and all(isinstance(p, (Partial, Replicate)) for p in seen):
            target.append(partials[0])
        elif cut is not None:
            target.append(cut)
        else:
            target.append(placement if isinstance(placement, Replicate) else Replicate())
    out = tuple(
        _moved(p, p.dim + (p.dim >= dim)) if isinstance(p, (Shard, StridedShard)) else p for p in target
    )
    return Decision(inputs={call.position_of(t): tuple(target) for t in tensors}, outputs=[out])


def covers(start: int | None, end: int | None, step: int | None, size: int) -> bool:
    """Whether ``[start:end:step]`` keeps every index of a dim of ``size``, in order (moves nothing)."""
    return slice(start, end, step or 1).indices(size) == (0, size, 1)


def _whole_slice(call: OpCall, size: int) -> bool:
    if call.func in (aten.narrow.default, aten.narrow_copy.default):
        start, length = int(call.args[2]), int(call.args[3])
        return start in (0, -size) and length == size
    named = dict(zip(("self", "dim", "start", "end", "step"), call.args, strict=False)) | call.kwargs
    return covers(named.get("start"), named.get("end"), named.get("step"), size)


@register(aten.slice.Tensor, aten.select.int, aten.narrow.default, aten.narrow_copy.default)
@reads_strided
def slice_rule(call: OpCall) -> Decision:
    """Take part of one dim: that dim must be whole; other shards carry over (select drops the dim).

    A slice or narrow that keeps the whole dim (``x[0:]``, ``narrow(d, 0,
    size)``) keeps its shard too: every rank's piece is already the answer.
    """
    layout = call.layout(call.positions[0])
    dim = (int(call.args[1]) if len(call.args) > 1 else int(call.kwargs.get("dim", 0))) % max(layout.ndim, 1)
    dropped = call.func is aten.select.int
    mapping = _dropping(layout.ndim, dim, dropped)
    decision = map_dims(call, mapping, layout.ndim - (1 if dropped else 0))
    if not dropped and layout.ndim and _whole_slice(call, layout.shape[dim]):
        decision = map_dims(call, list(range(layout.ndim)), layout.ndim)
        if call.func in (aten.narrow.default, aten.narrow_copy.default):
            func = call.func  # a piece is shorter than the global length: narrow it to its own
            decision.kernel = lambda local: func(local.args[0], dim, 0, local.args[0].shape[dim])
    elif not dropped and layout.ndim:
        _keep_strided_blocks(call, layout, dim, decision)
    return decision


def _slice_range(call: OpCall, size: int) -> tuple[int, int] | None:
    """``(start, end)`` of a step-1 ``slice`` / ``narrow`` of a dim of ``size``; None for another step."""
    if call.func in (aten.narrow.default, aten.narrow_copy.default):
        start, length = int(call.args[2]), int(call.args[3])
        start = start + size if start < 0 else start
        return start, start + length
    named = dict(zip(("self", "dim", "start", "end", "step"), call.args, strict=False)) | call.kwargs
    start, end, step = slice(named.get("start"), named.get("end"), named.get("step") or 1).indices(size)
    return (start, max(start, end)) if step == 1 else None


# [Note: slicing whole blocks]
# Under ``StridedShard(d, k)`` each rank holds, block after block, its piece
# of each of the ``k`` equal blocks of dim ``d``. A slice of ``d`` that takes
# whole blocks ``j0 .. j1`` is, on every rank, the run of its own rows of
# those blocks: ``Shard(d)`` for one block, ``StridedShard(d, j1 - j0)`` for
# more, with no communication. That is the backward of a ``cat`` kept strided
# ([Note: concatenating cut tensors]): each input's gradient is its block.
def _keep_strided_blocks(call: OpCall, layout: Layout, dim: int, decision: Decision) -> None:
    """Turn ``decision`` (which gathers ``dim``) into a local slice when it takes whole strided blocks."""
    placements = layout.placements
    cuts = [m for m, p in enumerate(placements) if p.is_shard(dim)]
    if len(cuts) != 1:
        return
    m, placement = cuts[0], placements[cuts[0]]
    if not isinstance(placement, StridedShard):
        return
    size, factor = layout.shape[dim], placement.split_factor
    span = _slice_range(call, size)
    if size % factor or span is None:
        return
    block = size // factor
    (start, end) = span
    if block == 0 or start % block or end % block or end <= start:
        return
    first, count = start // block, (end - start) // block
    decision.inputs[call.positions[0]] = tuple(
        placement if i == m else p for i, p in enumerate(decision.inputs[call.positions[0]])
    )
    out = list(decision.outputs[0] or ())
    out[m] = Shard(dim) if count == 1 else StridedShard(dim, count)
    decision.outputs = [tuple(out)]
    rows = chunk_sizes(block, layout.mesh.size(m))
    func = call.func

    def kernel(local: LocalCall) -> torch.Tensor:
        own = rows[local.layout(0).my_coordinate()[m]]
        piece = local.args[0].narrow(dim, first * own, count * own)
        return piece if func is aten.slice.Tensor or func is aten.narrow.default else piece.clone()

    decision.kernel = kernel


@register(aten.alias_copy.default)
@reads_strided
def alias_copy_rule(call: OpCall) -> Decision:
    """A copy of the whole tensor: every placement carries over."""
    return map_dims(call, list(range(call.layout(call.positions[0]).ndim)), 0)
