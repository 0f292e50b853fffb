"""``_chunk_cat``: FSDP2's packing of gradients for one reduce-scatter, on cut inputs.

See [Note: chunk_cat plans].
"""

from __future__ import annotations

import functools
import itertools
from typing import Any

import torch

from hp_dtensor.layout import Layout
from hp_dtensor.ops.dispatch import Decision, LocalCall, OpCall, register
from hp_dtensor.placements import Partial, Placement, Replicate, Shard

__all__ = ["chunk_cat_rule"]


# [Note: chunk_cat plans]
# ``_chunk_cat(tensors, dim, num_chunks)`` cuts each tensor's dim ``dim`` into
# ``num_chunks`` chunks of ``c_i = ceil(D_i / num_chunks)`` rows (the last
# padded with zeros), flattens each chunk's rows with the dims after them, and
# concatenates the tensors' chunks side by side: the output is ``(*lead,
# num_chunks, sum_i c_i * inner_i)``, where ``lead`` are the dims before
# ``dim`` (equal for all tensors). Per mesh dim, with every tensor cut alike:
#
# * a cut of a leading dim (before ``dim``) is copied as it is: each rank
#   packs its own rows, and the output keeps the cut (a replicated input is
#   cut alike, locally);
# * a cut of dim ``dim`` itself is local when it falls on chunk boundaries
#   ([Note: chunk-aligned cuts]): each rank packs its rows into its own
#   chunks, and the output is cut on its chunk dim;
# * a cut of a dim after ``dim`` would interleave the ranks' columns inside
#   every chunk, so that mesh dim is gathered, as is a cut that is not
#   chunk-aligned or one that leaves some rank an empty piece (the op refuses
#   empty tensors);
# * the op is linear (its padding is zeros): inputs that are all the same
#   ``Partial("sum")`` / ``Partial("avg")`` stay partial.
#
# torch's DTensor has no rule for this op (it refuses it). The op has no
# autograd formula, so there is no backward to rule.

aten = torch.ops.aten
R = Replicate()


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _output_shape(layouts: list[Layout], dim: int, chunks: int) -> tuple[int, ...]:
    width = 0
    for layout in layouts:
        inner = 1
        for size in layout.shape[dim + 1 :]:
            inner *= size
        width += _ceil_div(layout.shape[dim], chunks) * inner
    return (*layouts[0].shape[:dim], chunks, width)


# [Note: chunk-aligned cuts]
# Let rank ``r`` hold rows ``[o, o + s)`` of dim ``dim`` of tensor ``i``
# and, under the output's cut of its chunk dim, chunks ``[q, q + k)``. Those
# chunks hold rows ``[q * c_i, min((q + k) * c_i, D_i))`` of the tensor, so
# the rank's own rows are exactly what its chunks need when ``o = q * c_i``
# and ``s`` is that range's length. The kernel pads the rank's rows with
# zeros to ``k * c_i`` (the padding the global op adds in the last chunk)
# and runs the op with ``num_chunks = k``, which then cuts chunks of ``c_i``
# rows as the global op does. This is checked for every tensor at every mesh
# coordinate, with ``k >= 1`` and ``s >= 1`` (the op refuses empty tensors).
# FSDP2's case (each gradient cut evenly in ``W`` pieces of whole chunks,
# ``num_chunks`` a multiple of ``W``) passes it, and so do uneven cuts that
# end on a chunk boundary.
def _aligned(layouts: list[Layout], out: Layout, dim: int, chunks: int) -> bool:
    for coord in itertools.product(*(range(n) for n in out.mesh.shape)):
        k, q = out.local_shape_at(coord)[dim], out.local_offset_at(coord)[dim]
        if k == 0:
            return False
        for layout in layouts:
            size = layout.shape[dim]
            rows = _ceil_div(size, chunks)
            s, o = layout.local_shape_at(coord)[dim], layout.local_offset_at(coord)[dim]
            wanted = max(min((q + k) * rows, size) - q * rows, 0)
            if s == 0 or o != q * rows or s != wanted:
                return False
    return True


def _nonempty(layouts: list[Layout]) -> bool:
    return all(0 not in shape for layout in layouts for shape in layout.table())


def _kernel(out: Layout, rows: list[int], call: LocalCall) -> torch.Tensor:
    """The op on rows padded to whole chunks, with this rank's chunk count ([Note: chunk-aligned cuts])."""
    tensors, dim = call.args[0], call.args[1] % out.ndim
    chunks = out.local_shape()[dim]
    padded = []
    for t, c in zip(tensors, rows, strict=True):
        missing = chunks * c - t.shape[dim]
        if missing:
            shape = list(t.shape)
            shape[dim] = missing
            t = torch.cat([t, t.new_zeros(shape)], dim)
        padded.append(t)
    return call.func(padded, dim, chunks)


def _plan(layouts: list[Layout], dim: int, gathered: set[int]) -> list[Placement]:
    """Per mesh dim the placement every input takes (a replicated input is cut locally to match)."""
    kept: list[Placement] = []
    for m in range(layouts[0].mesh.ndim):
        seen = [layout.placements[m] for layout in layouts]
        shards = {p for p in seen if isinstance(p, Shard)}
        p: Placement = R
        if len(shards) == 1 and all(q in shards or isinstance(q, Replicate) for q in seen):
            p = next(iter(shards))
        elif len(set(seen)) == 1 and isinstance(seen[0], Partial) and seen[0].reduce_op in ("sum", "avg"):
            p = seen[0]
        keeps = not isinstance(p, Shard) or p.dim <= dim
        kept.append(p if keeps and m not in gathered else R)
    return kept


@register(aten._chunk_cat.default)
def chunk_cat_rule(call: OpCall) -> Decision:
    """Leading-dim cuts and chunk-aligned cuts of ``dim`` stay; others are gathered."""
    from hp_dtensor.dtensor import DTensor

    tensors: list[Any] = list(call.args[0])
    chunks = int(call.args[2])
    positions = [call.position_of(t) for t in tensors if isinstance(t, DTensor)]
    layouts = [call.layout(p) for p in positions]
    dim = call.args[1] % layouts[0].ndim
    mesh = layouts[0].mesh
    shape = _output_shape(layouts, dim, chunks)
    gathered: set[int] = set()
    while True:
        kept = _plan(layouts, dim, gathered)
        targets = [layout.with_placements(kept) for layout in layouts]
        out = Layout(mesh, kept, shape)
        cuts_dim = [m for m, p in enumerate(kept) if p == Shard(dim)]
        if any(isinstance(p, Shard) for p in kept) and not _nonempty(targets):
            gathered.update(m for m, p in enumerate(kept) if isinstance(p, Shard))
            continue
        if cuts_dim and not _aligned(targets, out, dim, chunks):
            gathered.update(cuts_dim)
            continue
        break
    placements = tuple(kept)
    rows = [_ceil_div(layout.shape[dim], chunks) for layout in layouts]
    kernel = functools.partial(_kernel, out, rows) if cuts_dim else None
    return Decision(inputs={p: placements for p in positions}, outputs=[placements], kernel=kernel)
