"""Layout: a mesh, one placement per mesh dim, and the global shape and stride.

The layout answers "which slice of the global tensor does the rank at mesh
coordinate ``c`` hold?" for every coordinate, without communication. That is
what lets redistribution size its buffers for uneven shards and what lets
``full_tensor()`` be right when ranks hold different amounts.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch
from hp_core import DeviceMesh

from hp_dtensor.placements import (
    Partial,
    Placement,
    Replicate,
    Shard,
    StridedShard,
    as_placement,
    is_torch_placement,
)

__all__ = [
    "Layout",
    "chunk_sizes",
    "contiguous_stride",
    "normalize_placements",
    "strided_rows",
    "strided_sizes",
]


# [Note: uneven and ragged shards]
# By default a sharded dim is cut like ``torch.chunk``: chunks of
# ``ceil(n / k)`` rows, so trailing ranks may get fewer rows or none. When
# several mesh dims shard the same tensor dim, the lower mesh dim cuts first and
# the higher one cuts each of its pieces (nested chunking), as in PyTorch.
# ``DTensor.from_local(..., shape=...)`` also accepts arbitrary per-rank sizes
# ("ragged"); such a layout stores the local shape of every mesh coordinate in a
# table (``ragged``), and the pieces are ordered lexicographically by the
# coordinates of the mesh dims that shard the tensor dim, lower mesh dims outer.
# The default rule is the special case the table would compute, so code that
# asks :meth:`Layout.local_shape_at` never needs to know which one it has.
def chunk_sizes(size: int, parts: int) -> list[int]:
    """The sizes ``torch.chunk(t, parts)`` gives along a dim of ``size``, padded with zeros to ``parts``."""
    if parts <= 0:
        raise ValueError(f"chunk_sizes: parts must be positive, got {parts}.")
    step = -(-size // parts) if size else 0
    out = []
    for index in range(parts):
        start = min(index * step, size)
        out.append(min(step, size - start))
    return out


def strided_sizes(size: int, split_factor: int, parts: int) -> list[int]:
    """Rows of a dim of ``size`` each of ``parts`` ranks holds under ``StridedShard(_, split_factor)``.

    Each rank holds its ``torch.chunk`` piece of every one of the
    ``split_factor`` blocks ([Note: strided shards] in ``hp_dtensor.placements``).
    """
    totals = [0] * parts
    for block in chunk_sizes(size, split_factor):
        for rank, rows in enumerate(chunk_sizes(block, parts)):
            totals[rank] += rows
    return totals


def strided_rows(size: int, split_factor: int, parts: int, index: int) -> list[int]:
    """The rows of a dim of ``size`` that rank ``index`` of ``parts`` holds under ``StridedShard``."""
    rows: list[int] = []
    start = 0
    for block in chunk_sizes(size, split_factor):
        sizes = chunk_sizes(block, parts)
        first = start + sum(sizes[:index])
        rows.extend(range(first, first + sizes[index]))
        start += block
    return rows


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major strides for ``shape``."""
    stride = []
    acc = 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))


def global_stride_like(local: torch.Tensor, shape: Sequence[int]) -> tuple[int, ...]:
    """Strides for ``shape`` that keep the dim order of ``local``'s memory (contiguous if it is)."""
    if local.is_contiguous() or local.dim() != len(shape):
        return contiguous_stride(shape)
    order = sorted(range(local.dim()), key=lambda d: (local.stride(d), d), reverse=True)
    stride = [0] * len(shape)
    acc = 1
    for dim in reversed(order):
        stride[dim] = acc
        acc *= max(shape[dim], 1)
    return tuple(stride)


def normalize_placements(
    placements: Sequence[Placement], mesh: DeviceMesh, ndim: int, what: str
) -> tuple[Placement, ...]:
    """Check ``placements`` against the mesh and the tensor rank; make shard dims non-negative.

    torch's ``Shard``, ``Replicate`` and ``Partial`` become ours here, the one
    place every entry's placements pass ([Note: torch placements] in
    ``hp_dtensor.placements``). Raises before any communication with a
    message that names the values and the fix (see the package README's
    "Bad input" section).
    """
    if isinstance(placements, Placement) or is_torch_placement(placements):
        raise TypeError(
            f"{what}: placements must be a sequence, got the single placement {placements!r}; "
            f"wrap it: [{placements!r}]."
        )
    values = tuple(placements)
    if len(values) != mesh.ndim:
        raise ValueError(
            f"{what}: got {len(values)} placement(s) {list(values)} for a {mesh.ndim}-D mesh {mesh.shape}; "
            f"give exactly one placement per mesh dim, e.g. {[Replicate()] * mesh.ndim}."
        )
    out: list[Placement] = []
    for index, given in enumerate(values):
        placement = as_placement(given, f"{what}: placements[{index}]")
        if isinstance(placement, (Shard, StridedShard)):
            dim = placement.dim
            if not -ndim <= dim < ndim:
                given_text = f"Shard({dim})" if isinstance(placement, Shard) else repr(placement)
                raise ValueError(
                    f"{what}: placements[{index}]={given_text} is out of range for a {ndim}-D tensor; "
                    f"use a dim in [{-ndim}, {ndim - 1}]."
                )
            if dim < 0:
                placement = (
                    Shard(dim + ndim)
                    if isinstance(placement, Shard)
                    else StridedShard(dim + ndim, placement.split_factor)
                )
        out.append(placement)
    check_strided_order(out, what)
    return tuple(out)


def check_strided_order(placements: Sequence[Placement], what: str) -> None:
    """Refuse a ``StridedShard`` below which (on a lower mesh dim) another placement cuts the same dim.

    The lower mesh dim cuts first ([Note: uneven and ragged shards]); a strided
    cut of its pieces has no use (no view produces it) and redistribution
    orders its steps by ``Shard`` alone, so it is refused rather than moved
    wrongly. A ``StridedShard`` on the lower mesh dim with a ``Shard`` above it
    (torch's FSDP2 + TP layout) is fine.
    """
    for mesh_dim, placement in enumerate(placements):
        if not isinstance(placement, StridedShard):
            continue
        for lower in range(mesh_dim):
            if placements[lower].is_shard(placement.dim):
                raise ValueError(
                    f"{what}: placements {list(placements)} cut tensor dim {placement.dim} on mesh dim "
                    f"{lower} and again with {placement} on mesh dim {mesh_dim}; a StridedShard must be "
                    "the first (lowest mesh dim) cut of its dim. Put it on the lower mesh dim or "
                    "redistribute that dim to Replicate() first."
                )


class Layout:
    """Mesh + placements + global shape and stride, and optionally a ragged size table.

    Layouts are immutable and hashable; two layouts are equal when the mesh,
    placements, shape, stride and per-rank sizes agree.
    """

    __slots__ = (
        "_hash",
        "_key_cache",
        "_lines",
        "_local_shape",
        "_token",
        "mesh",
        "placements",
        "ragged",
        "shape",
        "stride",
    )

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    ragged: tuple[tuple[int, ...], ...] | None

    def __init__(
        self,
        mesh: DeviceMesh,
        placements: Sequence[Placement],
        shape: Sequence[int],
        stride: Sequence[int] | None = None,
        ragged: Sequence[Sequence[int]] | None = None,
    ) -> None:
        self.mesh = mesh
        self.placements = tuple(placements)
        self.shape = tuple(int(s) for s in shape)
        self.stride = tuple(stride) if stride is not None else contiguous_stride(self.shape)
        table = None if ragged is None else tuple(tuple(int(s) for s in row) for row in ragged)
        if table is not None and table == self._default_table():
            table = None  # a table equal to the default rule is the default rule
        if table is not None and any(isinstance(p, StridedShard) for p in self.placements):
            raise ValueError(
                f"Layout: placements {list(self.placements)} with per-rank sizes {table} that differ from "
                "torch.chunk's: a StridedShard is always cut like torch.chunk in every block; give "
                "the sizes that rule gives, or use Shard placements for ragged pieces."
            )
        self.ragged = table
        self._local_shape: tuple[int, ...] | None = None
        self._hash: int | None = None
        self._key_cache: tuple[Any, ...] | None = None
        self._token: int | None = None  # see token()
        self._lines: dict[tuple[int, int], list[int]] | None = None  # see line_sizes()

    # -- identity -------------------------------------------------------------------

    def _key(self) -> tuple[Any, ...]:
        if self._key_cache is None:
            self._key_cache = (mesh_key(self.mesh), self.placements, self.shape, self.stride, self.ragged)
        return self._key_cache

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Layout):
            return NotImplemented
        return self is other or self._key() == other._key()

    def token(self) -> int:
        """A small int, equal for equal layouts on the same mesh object: a cheap dispatch-cache key.

        Interned on first use. Unlike ``==`` it tells apart equal meshes that
        are different objects, so a cache keyed by tokens never hands a layout
        on one mesh object to a tensor on another (a mesh rebuilt after its
        groups were released must not be swapped for the stale one). Mesh ids
        stay unique because :func:`mesh_key` keeps every mesh it saw alive.
        """
        if self._token is None:
            key = (id(self.mesh), self._key())
            token = _TOKENS.get(key)
            if token is None:
                token = len(_TOKENS)
                _TOKENS[key] = token
            self._token = token
        return self._token

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash(self._key())
        return self._hash

    def __repr__(self) -> str:
        placements = "[" + ", ".join(str(p) for p in self.placements) + "]"
        extra = ", ragged" if self.ragged is not None else ""
        return f"Layout(mesh={tuple(self.mesh.shape)}, placements={placements}, shape={self.shape}{extra})"

    # -- derived layouts ------------------------------------------------------------

    def with_placements(self, placements: Sequence[Placement]) -> Layout:
        """The same tensor under other placements (default chunk sizes; ragged tables are not carried)."""
        return Layout(self.mesh, placements, self.shape, self.stride)

    @property
    def ndim(self) -> int:
        """The tensor's rank."""
        return len(self.shape)

    def is_ragged(self) -> bool:
        """Whether some rank's shard size differs from the ``torch.chunk`` default."""
        return self.ragged is not None

    def has_partial(self) -> bool:
        """Whether any mesh dim holds partial terms."""
        return any(isinstance(p, Partial) for p in self.placements)

    def is_replicated(self) -> bool:
        """Whether every mesh dim is ``Replicate()`` (each rank holds the full tensor)."""
        return all(isinstance(p, Replicate) for p in self.placements)

    # -- local shapes and offsets -----------------------------------------------------

    def _coords(self) -> list[tuple[int, ...]]:
        return list(itertools.product(*(range(n) for n in self.mesh.shape)))

    def _coord_index(self, coord: Sequence[int]) -> int:
        index = 0
        for c, n in zip(coord, self.mesh.shape, strict=True):
            index = index * n + c
        return index

    def _default_shape_at(self, coord: Sequence[int]) -> tuple[int, ...]:
        sizes = list(self.shape)
        mesh_shape = self.mesh.shape
        for mesh_dim, placement in enumerate(self.placements):
            if isinstance(placement, Shard):
                sizes[placement.dim] = chunk_sizes(sizes[placement.dim], mesh_shape[mesh_dim])[
                    coord[mesh_dim]
                ]
            elif isinstance(placement, StridedShard):
                sizes[placement.dim] = strided_sizes(
                    sizes[placement.dim], placement.split_factor, mesh_shape[mesh_dim]
                )[coord[mesh_dim]]
        return tuple(sizes)

    def _default_table(self) -> tuple[tuple[int, ...], ...]:
        return tuple(self._default_shape_at(c) for c in self._coords())

    def table(self) -> tuple[tuple[int, ...], ...]:
        """The local shape of every mesh coordinate, in row-major coordinate order."""
        return self.ragged if self.ragged is not None else self._default_table()

    def local_shape_at(self, coord: Sequence[int]) -> tuple[int, ...]:
        """The local shape of the rank at mesh coordinate ``coord``."""
        if self.ragged is not None:
            return self.ragged[self._coord_index(coord)]
        return self._default_shape_at(coord)

    def my_coordinate(self) -> tuple[int, ...]:
        """This rank's mesh coordinate (an error for ranks outside the mesh)."""
        coord = self.mesh.get_coordinate()
        if coord is None:
            raise RuntimeError(f"rank {self.mesh.get_rank()} is not in the mesh {self.mesh!r}.")
        return coord

    def local_shape(self) -> tuple[int, ...]:
        """This rank's local shape."""
        if self._local_shape is None:
            self._local_shape = self.local_shape_at(self.my_coordinate())
        return self._local_shape

    def local_offset_at(self, coord: Sequence[int]) -> tuple[int, ...]:
        """Where the rank at ``coord`` starts in each tensor dim (see [Note: uneven and ragged shards]).

        A ``StridedShard`` piece is not one run of rows, so it has no offset:
        that raises (callers that meet one redistribute first).
        """
        strided = [p for p in self.placements if isinstance(p, StridedShard)]
        if strided:
            raise ValueError(
                f"{self} holds {strided[0]}: each rank's rows of dim {strided[0].dim} are a piece of every "
                "one of its blocks, not one run with an offset; redistribute that mesh dim to Shard() or "
                "Replicate() first."
            )
        offsets = [0] * self.ndim
        for dim in range(self.ndim):
            sharding = [m for m, p in enumerate(self.placements) if isinstance(p, Shard) and p.dim == dim]
            if not sharding:
                continue
            for other in itertools.product(*(range(self.mesh.shape[m]) for m in sharding)):
                if other >= tuple(coord[m] for m in sharding):
                    continue
                peer = list(coord)
                for m, value in zip(sharding, other, strict=True):
                    peer[m] = value
                offsets[dim] += self.local_shape_at(peer)[dim]
        return tuple(offsets)

    def local_offset(self) -> tuple[int, ...]:
        """This rank's offset in each tensor dim."""
        return self.local_offset_at(self.my_coordinate())

    def line_sizes(self, mesh_dim: int, tensor_dim: int) -> list[int]:
        """Sizes along ``tensor_dim`` of the ranks on this rank's line along ``mesh_dim``, in order.

        Memoised (layouts are immutable): every all-gather and all-to-all asks.
        Callers must not modify the returned list.
        """
        lines = self._lines
        if lines is None:
            lines = self._lines = {}
        out = lines.get((mesh_dim, tensor_dim))
        if out is None:
            coord = list(self.my_coordinate())
            out = []
            for k in range(self.mesh.shape[mesh_dim]):
                coord[mesh_dim] = k
                out.append(self.local_shape_at(coord)[tensor_dim])
            lines[(mesh_dim, tensor_dim)] = out
        return out


_MESH_KEYS: dict[int, tuple[DeviceMesh, tuple[Any, ...]]] = {}
_TOKENS: dict[tuple[Any, ...], int] = {}  # (mesh id, layout value) -> token; only grows (tokens stay unique)


def mesh_key(mesh: DeviceMesh) -> tuple[Any, ...]:
    """A hashable value identity of ``mesh``, memoised per mesh object (which it keeps alive).

    Taken from :attr:`hp_core.DeviceMesh.identity`, not from the rank tensor:
    under ``torch.compile`` layouts are compared while fake tensors are active,
    and reading a real tensor there is refused.
    """
    entry = _MESH_KEYS.get(id(mesh))
    if entry is None or entry[0] is not mesh:
        entry = (mesh, mesh.identity)
        _MESH_KEYS[id(mesh)] = entry
    return entry[1]
