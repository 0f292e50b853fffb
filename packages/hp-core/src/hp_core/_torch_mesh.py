"""``DeviceMesh.from_torch``: a torch ``DeviceMesh`` read as an hp_core mesh on torch's own groups.

The conversion reads torch's CuTe-style layout of the mesh over its root's
rank list and re-expresses it as an hp_core root tensor with prime-sized root
dims, so every mesh of one torch root shares one hp_core root; the groups are
torch's, put in the group cache, so nothing is created or communicated
([Note: meshes from torch]).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from hp_core import mesh as _mesh
from hp_core._checks import require_initialized
from hp_core.mesh import DeviceMesh
from hp_core.platform import get_platform

__all__ = ["convert"]

_WHAT = "DeviceMesh.from_torch"

Modes = list[tuple[int, int]]  # (size, stride) over positions in the root's rank list


@dataclass
class _Family:
    """What the hp_core meshes converted from one torch root mesh (cut one way) share."""

    torch_root: Any  # kept alive: families are keyed by its id
    flattened: dict[str, DeviceMesh] = field(default_factory=dict)  # every member's DeviceMesh._flattened
    meshes: dict[tuple[Any, ...], DeviceMesh] = field(default_factory=dict)  # (dims, names) -> mesh


# [Note: meshes from torch]
# torch (2.9 and later) describes every mesh as a layout into its root mesh's
# flat list of ranks: each dim is a set of (size, stride) modes over positions
# in that list, CuTe style. Slicing, ``_flatten`` and ``_unflatten`` keep the
# root's rank list and change only the layout. hp_core describes a mesh as a
# root rank tensor and, per dim, the root dims it spans ([Note: mesh
# representation] in ``hp_core.mesh``).
#
# So the conversion cuts the rank list at every stride boundary of the mesh's
# modes and of its root's modes and splits each piece into its prime factors
# (smallest innermost). The result is the root tensor; each mesh dim spans the
# root dims between its modes' boundaries. Splitting into primes makes every
# mesh of one torch root (a slice, a flattening, an unflattening of a root dim)
# cut the list the same way in the common cases, so their hp_core meshes share
# one root and can be sliced, flattened and concatenated together, as torch's
# can. A root of twelve ranks cut as (3, 4) becomes root dims (3, 2, 2).
#
# The groups come from torch, not from ``new_group``. Before the mesh is set up,
# every line of every dim is put in the group cache ([Note: group cache]):
# this rank's line with torch's group for that dim, the other lines as entries
# this rank is not a member of. The layout is the same on every rank, so every
# rank's cache holds the same rank sets afterwards, and set-up finds every group
# cached: nothing is created and nothing is communicated. Two exceptions keep
# the cache right: the world's ranks keep mapping to the default group, and a
# dim whose lines do not list their ranks in increasing order (a permuted custom
# mesh) is left to hp_core, which creates its own groups for it (collectively:
# then every rank must convert the mesh), because a group's rank order must be
# the line's order and torch's groups are not known to keep it.
#
# The rule this relies on is torch's own: a torch mesh is the same on every rank
# (as ``init_device_mesh`` builds it). A torch mesh whose root holds only this
# rank's copy (``DeviceMesh.from_group`` with per-rank groups) is converted
# right only when it came from ``DeviceMesh.to_torch()``, which is remembered.
def convert(torch_mesh: Any) -> DeviceMesh:
    """See :meth:`hp_core.DeviceMesh.from_torch`."""
    if isinstance(torch_mesh, DeviceMesh):
        return torch_mesh
    from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh

    if not isinstance(torch_mesh, TorchDeviceMesh):
        kind = type(torch_mesh)
        raise TypeError(
            f"{_WHAT}: expected a torch.distributed.device_mesh.DeviceMesh, got "
            f"{kind.__module__}.{kind.__qualname__} {torch_mesh!r:.80}; build one with "
            "torch.distributed.device_mesh.init_device_mesh(...), or use hp_core.init_device_mesh directly."
        )
    require_initialized(_WHAT)
    _mesh._sync_with_default_group()
    hit = _mesh._from_torch.get(id(torch_mesh))
    if hit is not None and hit[0] is torch_mesh:
        return hit[1]
    mesh, family = _convert(torch_mesh)
    _adopt_flattened(family)
    return mesh


def _convert(torch_mesh: Any) -> tuple[DeviceMesh, _Family]:
    rank_map, dim_modes, root_modes, torch_root = _read_layout(torch_mesh)
    sizes = _root_sizes(rank_map.numel(), [m for modes in (*dim_modes, *root_modes) for m in modes])
    strides = [1] * len(sizes)
    for d in range(len(sizes) - 2, -1, -1):
        strides[d] = strides[d + 1] * sizes[d + 1]
    root = rank_map.detach().to(device="cpu", dtype=torch.int64).reshape(sizes)
    dims = tuple(
        tuple(d for size, stride in modes for d in range(len(sizes)) if stride <= strides[d] < stride * size)
        for modes in dim_modes
    )
    names = None if torch_mesh.mesh_dim_names is None else tuple(torch_mesh.mesh_dim_names)
    key = (id(torch_root), tuple(sizes))
    family = _mesh._torch_families.get(key)
    if family is None or family.torch_root is not torch_root:
        family = _mesh._torch_families[key] = _Family(torch_root)
    mesh = family.meshes.get((dims, names))
    if mesh is None:
        _adopt_groups(torch_mesh, root, dims)
        device_type = torch_mesh.device_type
        mesh = DeviceMesh.__new__(DeviceMesh)
        mesh._setup(
            device_type, get_platform(device_type).tensor_device_type, root, dims, names, family.flattened
        )
        _check_same_ranks(mesh, torch_mesh)
        family.meshes[(dims, names)] = mesh
    _mesh._from_torch[id(torch_mesh)] = (torch_mesh, mesh)
    if mesh.get_coordinate() is not None and all(
        mesh.get_group(d) is torch_mesh.get_group(d) for d in range(mesh.ndim)
    ):
        # to_torch() hands back torch's mesh only when it runs on exactly our groups.
        _mesh._torch_meshes.setdefault(mesh._key(), torch_mesh)
    return mesh, family


def _read_layout(torch_mesh: Any) -> tuple[torch.Tensor, list[Modes], list[Modes], Any]:
    """The root's rank list, each dim's modes, the root's modes and the root mesh (torch internals)."""
    try:
        rank_map = torch_mesh._rank_map
        dim_modes = [list(zip(axis.shape, axis.stride, strict=True)) for axis in torch_mesh._layout]
        torch_root = torch_mesh._get_root_mesh()
        root_modes = (
            [list(zip(axis.shape, axis.stride, strict=True)) for axis in torch_root._layout]
            if torch_root._rank_map is rank_map
            else []
        )
    except AttributeError as error:
        raise TypeError(
            f"{_WHAT}: this torch ({torch.__version__}) DeviceMesh has no layout ({error}); hp_core reads "
            "the layout torch's DeviceMesh has since torch 2.9. Upgrade torch, or build the mesh with "
            "hp_core.init_device_mesh."
        ) from None
    return rank_map, dim_modes, root_modes, torch_root


def _root_sizes(count: int, modes: Modes) -> list[int]:
    """The root tensor's shape (outer first): the rank list cut at every mode boundary, then into primes."""
    cuts = sorted({1, count, *(s for _, s in modes), *(size * s for size, s in modes)})
    inner_first: list[int] = []
    for low, high in itertools.pairwise(cuts):
        if high % low:
            raise ValueError(
                f"{_WHAT}: the mesh's layout {modes} (size, stride) over {count} ranks cuts the rank list at "
                f"{cuts}, which do not nest ({high} is not a multiple of {low}), so its dims are not "
                "unions of dims of one rank tensor; build the mesh with hp_core.DeviceMesh(device_type, "
                "torch_mesh.mesh, mesh_dim_names=...) instead (it creates its own groups)."
            )
        inner_first.extend(_primes(high // low))
    return inner_first[::-1] or [1]


def _primes(value: int) -> list[int]:
    out, factor = [], 2
    while value > 1:
        while value % factor == 0:
            out.append(factor)
            value //= factor
        factor += 1
    return out


def _adopt_groups(torch_mesh: Any, root: torch.Tensor, dims: tuple[tuple[int, ...], ...]) -> None:
    """Cache torch's group for this rank's line of every dim, and the other lines as non-member entries."""
    rank = dist.get_rank()
    member = torch_mesh.get_coordinate() is not None
    for index, root_dims in enumerate(dims):
        lines = _mesh._lines(root, root_dims)
        if any(line != sorted(line) for line in lines):
            continue  # hp_core makes groups in the line's order (see [Note: meshes from torch])
        for line in lines:
            group = torch_mesh.get_group(index) if member and rank in line else None
            if group is not None and dist.get_process_group_ranks(group) != line:
                raise RuntimeError(
                    f"{_WHAT}: torch's group for dim {index} of {torch_mesh!r} holds ranks "
                    f"{dist.get_process_group_ranks(group)}, but the mesh's line through rank {rank} is "
                    f"{line}; this torch mesh's groups do not match its layout. Build the mesh with "
                    "hp_core.init_device_mesh instead."
                )
            _mesh._adopt_group(tuple(line), group)


def _check_same_ranks(mesh: DeviceMesh, torch_mesh: Any) -> None:
    if mesh.get_coordinate() is None:
        return
    ours, theirs = mesh.mesh.tolist(), torch_mesh.mesh.tolist()
    if ours != theirs:
        raise RuntimeError(
            f"{_WHAT}: read {torch_mesh!r} as ranks {ours}, but it holds {theirs}; this torch layout is not "
            "supported yet. Build the mesh with hp_core.DeviceMesh(device_type, torch_mesh.mesh, "
            "mesh_dim_names=...) instead (it creates its own groups)."
        )


def _adopt_flattened(family: _Family) -> None:
    """Make torch's ``_flatten`` meshes of the root reachable as ``mesh[name]`` and by ``flatten(name)``."""
    for name, flat in list(getattr(family.torch_root, "_flatten_mapping", {}).items()):
        if name in family.flattened:
            continue
        converted, flat_family = _convert(flat)
        if flat_family is family and converted.ndim == 1:
            family.flattened[name] = converted
