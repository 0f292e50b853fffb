"""Which mesh an op runs on, when its DTensor arguments name meshes.

Every DTensor argument of one op must live on one mesh (equal by
:func:`hp_dtensor.layout.mesh_key`), or on a permutation of it; the
dispatcher asks here.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from typing import Any

from hp_dtensor.dtensor import DTensor
from hp_dtensor.layout import Layout, mesh_key
from hp_dtensor.placements import Shard

__all__ = ["common_mesh", "on_mesh"]


def common_mesh(call_flat: list[Any], positions: Sequence[int], func: Any) -> tuple[Any, list[Any]]:
    """The op's mesh (its first DTensor's) and ``call_flat`` with every DTensor on that mesh.

    A DTensor on a permutation of that mesh is replaced by the same data
    re-expressed on it (see [Note: permuted meshes]); ``call_flat`` itself is
    returned when nothing needed it.
    """
    mesh = call_flat[positions[0]]._layout.mesh
    out = call_flat
    for p in positions[1:]:
        dt = call_flat[p]
        other = dt._layout.mesh
        if other is mesh or mesh_key(other) == mesh_key(mesh):
            continue
        moved = on_mesh(dt, mesh, func)
        if out is call_flat:
            out = list(call_flat)
        out[p] = moved
    return mesh, out


# [Note: permuted meshes]
# FSDP x TP puts a parameter that both shard on tensor dim 0 on the mesh
# ``("tp", "dp")`` and the others on ``("dp", "tp")``: the same ranks and the
# same process groups, the dims in another order. A DTensor on
# ``mesh.permute(order)`` is the same data as one on ``mesh`` whose placements
# are permuted back, as long as the order of the mesh dims does not matter to
# its pieces: it does not when no tensor dim is sharded by two mesh dims (with
# two, the lower mesh dim cuts first, see [Note: nested shard order] in
# :mod:`hp_dtensor.planner`). Such an argument is re-expressed on the first
# DTensor's mesh without communication (a new DTensor over the same local
# tensor), so ``torch.stack`` of norms from both orderings, or a gradient
# clipped by a coefficient computed on the other ordering, just work. Nested
# shards of one tensor dim cannot be re-expressed: that keeps the error.
def on_mesh(dt: Any, mesh: Any, func: Any) -> Any:
    """``dt`` re-expressed on ``mesh``, a permutation of its own mesh, without communication.

    Raises a ValueError naming both meshes when ``mesh`` is not a permutation
    of ``dt``'s mesh, or when ``dt`` shards one tensor dim on two mesh dims.
    """
    layout: Layout = dt._layout
    order = _permutation(mesh_key(mesh), mesh_key(layout.mesh))
    if order is None:
        raise ValueError(
            f"{func}: DTensor arguments live on different meshes ({mesh!r} and {layout.mesh!r}); an op "
            "needs all of its DTensors on one mesh (or on permutations of one mesh, like ('dp', 'tp') and "
            f"('tp', 'dp')).{_submesh_hint(mesh, layout.mesh)} Move one with full_tensor() + "
            "distribute_tensor()."
        )
    shard_dims = [p.dim for p in layout.placements if isinstance(p, Shard)]
    if len(shard_dims) != len(set(shard_dims)):
        raise ValueError(
            f"{func}: an argument on {layout.mesh!r} with placements {list(layout.placements)} shards one "
            f"tensor dim on two mesh dims, which cannot be re-expressed on the permuted mesh {mesh!r} (the "
            "order of the cuts differs). Redistribute it so each tensor dim is sharded once, or move it "
            "with full_tensor() + distribute_tensor()."
        )
    # Mesh dim j of the target is mesh dim order[j] of the source.
    placements = tuple(layout.placements[i] for i in order)
    ragged = None
    if layout.ragged is not None:
        table = dict(
            zip(itertools.product(*(range(s) for s in layout.mesh.shape)), layout.ragged, strict=True)
        )
        ragged = []
        for coord in itertools.product(*(range(s) for s in mesh.shape)):
            source = [0] * len(coord)
            for j, i in enumerate(order):
                source[i] = coord[j]
            ragged.append(table[tuple(source)])
    return DTensor(dt._local, Layout(mesh, placements, layout.shape, layout.stride, ragged=ragged))


@functools.lru_cache(maxsize=256)
def _permutation(target: tuple[Any, ...], source: tuple[Any, ...]) -> tuple[int, ...] | None:
    """``order`` with ``source.permute(order) == target`` (by mesh identities), or None.

    An identity is (device type, shape, flat ranks, dim names). Named meshes
    must agree on names too; the ranks decide which orders fit.
    """
    device, shape, ranks, names = target
    s_device, s_shape, s_ranks, s_names = source
    if device != s_device or len(shape) != len(s_shape) or sorted(ranks) != sorted(s_ranks):
        return None
    if (names is None) != (s_names is None):
        return None
    fits = []
    for order in itertools.permutations(range(len(shape))):
        if tuple(s_shape[i] for i in order) != tuple(shape):
            continue
        if names is not None and tuple(s_names[i] for i in order) != tuple(names):
            continue
        if _permuted_ranks(s_shape, s_ranks, order) == tuple(ranks):
            fits.append(order)
    return fits[0] if len(fits) == 1 else None


def _permuted_ranks(
    shape: tuple[int, ...], ranks: tuple[int, ...], order: tuple[int, ...]
) -> tuple[int, ...]:
    """The flat ranks of a mesh of ``shape`` holding ``ranks`` (row-major) after permuting its dims."""
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    out = []
    for coord in itertools.product(*(range(shape[i]) for i in order)):
        out.append(ranks[sum(c * strides[i] for c, i in zip(coord, order, strict=True))])
    return tuple(out)


def _submesh_hint(a: Any, b: Any) -> str:
    """When one mesh's dims are a subset of the other's: why that is refused, and the usual fix.

    A DTensor on ``("dp",)`` says nothing about the ranks of ``tp``: its
    values are the same there only if the program made them so, which
    hp_dtensor (like torch's DTensor) does not assume. FSDP x TP models meet
    this when the layers TP does not shard stay plain before ``fully_shard``.
    """
    names_a, names_b = a.mesh_dim_names, b.mesh_dim_names
    if not names_a or not names_b or set(names_a) == set(names_b):
        return ""
    small, large = (names_a, names_b) if len(names_a) < len(names_b) else (names_b, names_a)
    missing = [n for n in large if n not in small]
    if not set(small) <= set(large) or not missing:
        return ""
    return (
        f" The DTensors on {small} are not known to be equal across {tuple(missing)}; put them on the "
        f"larger mesh: replicate the layers tensor parallelism leaves whole over {missing[0]!r} "
        f"(distribute_module(module, mesh[{missing[0]!r}]) before fully_shard, as torchtitan does)."
    )
