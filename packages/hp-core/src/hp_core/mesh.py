"""DeviceMesh: ranks arranged in an n-D grid with named dims, one process group per dim.

``init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))`` lays the
world's ranks out row-major; ``mesh["tp"]`` is this rank's row, ``mesh["dp"]``
its column, and ``mesh.get_group("tp")`` the process group that talks along
it. ``to_torch()`` hands the same layout and the same groups to PyTorch's own
``DeviceMesh`` so torch DTensor and FSDP2 can use them; ``DeviceMesh.from_torch``
reads a torch mesh the other way, on torch's groups ([Note: meshes from torch]
in ``hp_core._torch_mesh``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as _c10d

from hp_core._checks import agree_across_world, require_initialized
from hp_core.platform import get_platform

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh

__all__ = [
    "DeviceMesh",
    "StaleMeshError",
    "cached_groups",
    "clear_group_cache",
    "init_device_mesh",
]


class StaleMeshError(RuntimeError):
    """A mesh whose process groups were released by :func:`clear_group_cache`."""


# -- the process-group cache (see [Note: group cache]) -------------------------

# ranks -> (this rank's group or None when it is not a member, whether we own it)
_groups: dict[tuple[int, ...], tuple[dist.ProcessGroup | None, bool]] = {}
# torch DeviceMesh views of our meshes (they hold groups too, so they live and die with the cache)
_torch_meshes: dict[tuple[Any, ...], TorchDeviceMesh] = {}
# DeviceMesh.from_torch's memo: id(torch mesh) -> (that torch mesh, our mesh); see hp_core._torch_mesh
_from_torch: dict[int, tuple[TorchDeviceMesh, DeviceMesh]] = {}
# per torch root mesh and root shape: state shared by the meshes converted from it (hp_core._torch_mesh)
_torch_families: dict[tuple[int, tuple[int, ...]], Any] = {}
_generation = 0
_cache_world: dist.ProcessGroup | None = None


def _sync_with_default_group() -> None:
    # Groups outlive nothing: if the default group was destroyed and re-created
    # behind our back, the cached groups belong to the old one and are dead.
    global _cache_world, _generation
    world = dist.group.WORLD
    if _cache_world is not None and world is not _cache_world:
        _forget_all()
        _generation += 1
    _cache_world = world


def _forget_all() -> None:
    """Drop every cache entry that holds process groups (the caller bumps the generation)."""
    _groups.clear()
    _torch_meshes.clear()
    _from_torch.clear()
    _torch_families.clear()


# [Note: group cache]
# Creating a process group is a collective over the *default* group: every rank
# must call ``new_group`` for every group, members or not, in the same order,
# or creation hangs. So a mesh creates the groups of all its lines (rows and
# columns of every rank, not only its own) in a fixed order, and groups are
# cached by their tuple of ranks. Any later mesh needing the same ranks, such as
# a slice of the mesh or a second mesh of the same shape, reuses the cached
# group without communicating. The consequence for users is the SPMD rule:
# build meshes and call ``flatten`` on every rank in the same order (slicing is
# free and may happen anywhere). :func:`clear_group_cache` forgets the groups
# (the test harness calls it before it re-creates the default group); meshes
# built before then refuse further use with a clear error. Meshes record the
# ranks of their lines, not the group objects: the cache is the only owner, so
# clearing it really releases the groups (a group object that outlives
# ``destroy_process_group`` can abort gloo at interpreter exit).
def _group_for(ranks: tuple[int, ...]) -> dist.ProcessGroup | None:
    """The cached group over ``ranks`` (created on first use by every rank), or None for non-members."""
    _sync_with_default_group()
    entry = _groups.get(ranks)
    if entry is not None:
        return entry[0]
    world_size = dist.get_world_size()
    if ranks == tuple(range(world_size)):
        group: dist.ProcessGroup | None = dist.group.WORLD
        owned = False
    else:
        ordered = list(ranks) == sorted(ranks)
        # sort_ranks=False keeps group rank == position for permuted layouts; it
        # is only passed when needed because the TorchComms path rejects it.
        created = dist.new_group(list(ranks)) if ordered else dist.new_group(list(ranks), sort_ranks=False)
        group = None if created is dist.GroupMember.NON_GROUP_MEMBER else created
        owned = True
    _groups[ranks] = (group, owned)
    return group


def _adopt_group(ranks: tuple[int, ...], group: dist.ProcessGroup | None) -> None:
    """Cache a group someone else created (torch's DeviceMesh) for ``ranks``, unless one is cached.

    ``group`` is None on ranks outside ``ranks``. Adopted groups are not
    owned: :func:`clear_group_cache` forgets them but leaves them alive.
    The world's ranks always map to the default group (see :func:`_group_for`).
    """
    _sync_with_default_group()
    if ranks not in _groups and ranks != tuple(range(dist.get_world_size())):
        _groups[ranks] = (group, False)


def _lines(root: torch.Tensor, root_dims: tuple[int, ...]) -> list[list[int]]:
    """Every line of ``root`` along ``root_dims`` (merged row-major), across the whole root."""
    others = [d for d in range(root.dim()) if d not in root_dims]
    line_length = math.prod(root.shape[d] for d in root_dims)
    return root.permute(*others, *root_dims).reshape(-1, line_length).tolist()


def cached_groups() -> list[dist.ProcessGroup]:
    """The groups the cache holds for this rank (the test harness tells them apart from leaks)."""
    return [group for group, _ in _groups.values() if group is not None]


def clear_group_cache() -> None:
    """Forget every cached group and destroy (best-effort) the ones the cache created.

    Meshes created before this call raise :class:`StaleMeshError` when used.
    Call it on every rank, before destroying or re-creating the default group.
    """
    global _generation, _cache_world
    for group, owned in list(_groups.values()):
        if group is None or not owned:
            continue
        try:
            dist.destroy_process_group(group)
        except Exception:  # best-effort: the default group may already be gone
            pass
    _forget_all()
    _generation += 1
    _cache_world = None


# -- validation helpers ---------------------------------------------------------


def _check_names(names: Any, ndim: int, what: str) -> tuple[str, ...] | None:
    if names is None:
        return None
    if isinstance(names, str):
        raise TypeError(
            f"{what}: mesh_dim_names={names!r} is a string; pass a tuple of names, e.g. ({names!r},)."
        )
    values = tuple(names)
    bad = [n for n in values if not isinstance(n, str) or not n]
    if bad:
        raise TypeError(f"{what}: mesh_dim_names={values!r} must be non-empty strings; {bad[0]!r} is not.")
    if len(values) != ndim:
        raise ValueError(
            f"{what}: mesh_dim_names={values} has {len(values)} name(s) but the mesh has {ndim} dim(s); "
            "give exactly one name per dim."
        )
    duplicates = sorted({n for n in values if values.count(n) > 1})
    if duplicates:
        raise ValueError(
            f"{what}: mesh_dim_names={values} repeats {duplicates}; every dim needs its own name."
        )
    return values


def _agree_then_check_device_type(what: str, fix: str, device_type: Any, **arguments: Any) -> None:
    """Agree on a mesh's arguments across ranks, then check the device type.

    Groups are created collectively, so the agreement comes before any local
    check: one rank's bad argument then raises on every rank instead of
    leaving the others in a group creation (see [Note: cross-rank agreement]
    in hp_core.agreement). Before the default group exists there is nothing to
    agree over, and the local checks run alone.
    """
    if dist.is_available() and dist.is_initialized():
        agree_across_world(what, fix, device_type=device_type, **arguments)
    if not isinstance(device_type, str):
        raise TypeError(f"{what}: device_type must be a str such as 'cpu', got {device_type!r}.")


def _check_shape(mesh_shape: Any) -> tuple[int, ...]:
    if isinstance(mesh_shape, int) and not isinstance(mesh_shape, bool):
        mesh_shape = (mesh_shape,)
    try:
        shape = tuple(mesh_shape)
    except TypeError:
        raise TypeError(
            f"init_device_mesh: mesh_shape must be a tuple of ints, got {mesh_shape!r}."
        ) from None
    if not shape or any(not isinstance(s, int) or isinstance(s, bool) or s < 1 for s in shape):
        raise ValueError(
            f"init_device_mesh: mesh_shape={shape} must be a non-empty tuple of positive ints, e.g. (2, 4)."
        )
    return shape


# -- DeviceMesh -----------------------------------------------------------------


# [Note: mesh representation]
# Every mesh keeps its *root* rank tensor (identical on all ranks) and, for each
# of its dims, the root dims it spans: a slice keeps some root dims and pins the
# others at this rank's coordinate; a flattened dim spans several root dims in
# row-major order. From that, any rank can enumerate the lines of a dim across
# the whole root, which is what the group cache needs.
class DeviceMesh:
    """An n-D grid of global ranks with optional dim names and one process group per dim.

    Build one with :func:`init_device_mesh`; the constructor takes an explicit
    rank tensor for custom layouts (every rank must pass the same tensor).
    """

    _device_type: str
    _tensor_device_type: str
    _root: torch.Tensor
    _dims: tuple[tuple[int, ...], ...]
    _names: tuple[str, ...] | None
    _rank: int
    _mesh: torch.Tensor
    _coordinate: tuple[int, ...] | None
    _dim_lines: tuple[tuple[int, ...] | None, ...]
    _generation: int
    _flattened: dict[str, DeviceMesh]

    def __init__(
        self,
        device_type: str,
        mesh: torch.Tensor | Sequence[Any],
        *,
        mesh_dim_names: Sequence[str] | None = None,
    ) -> None:
        what = "DeviceMesh"
        _agree_then_check_device_type(
            what,
            "build a DeviceMesh on every rank with the same device type, rank tensor and names.",
            device_type,
            mesh=mesh,
            mesh_dim_names=mesh_dim_names,
        )
        try:
            # rank tables live on the CPU whatever the ambient device (``with torch.device('meta')``)
            tensor = mesh.cpu() if isinstance(mesh, torch.Tensor) else torch.tensor(mesh, device="cpu")
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(
                f"{what}: mesh must be a tensor or nested list of integer ranks, got {mesh!r}; "
                "e.g. DeviceMesh('cpu', [[0, 1], [2, 3]])."
            ) from None
        if tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool:
            raise TypeError(
                f"{what}: mesh must hold integer ranks, got dtype {tensor.dtype}; "
                "pass ints, e.g. torch.tensor(ranks, dtype=torch.int64)."
            )
        if tensor.dim() == 0:
            raise ValueError(
                f"{what}: mesh must be at least 1-D, got the scalar {tensor.item()}; wrap it in a list."
            )
        names = _check_names(mesh_dim_names, tensor.dim(), what)
        require_initialized(what)
        root = tensor.detach().to(device="cpu", dtype=torch.int64).contiguous()
        world_size = dist.get_world_size()
        values = root.flatten().tolist()
        outside = sorted({r for r in values if not 0 <= r < world_size})
        if outside:
            raise ValueError(
                f"{what}: mesh {root.tolist()} holds ranks {outside} outside the world [0, {world_size}); "
                "use global ranks of the default group."
            )
        if len(set(values)) != len(values):
            repeated = sorted({r for r in values if values.count(r) > 1})
            raise ValueError(
                f"{what}: mesh {root.tolist()} lists ranks {repeated} more than once; "
                "each rank may appear once."
            )
        self._init_root(device_type, root, names)

    def _init_root(self, device_type: str, root: torch.Tensor, names: tuple[str, ...] | None) -> None:
        """Set up a root mesh from checked arguments: resolve the platform, then create the groups."""
        platform = get_platform(device_type)
        self._setup(
            device_type,
            platform.tensor_device_type,
            root,
            tuple((d,) for d in range(root.dim())),
            names,
            {},
        )

    @classmethod
    def _derived(
        cls,
        parent: DeviceMesh,
        dims: tuple[tuple[int, ...], ...],
        names: tuple[str, ...] | None,
    ) -> DeviceMesh:
        mesh = cls.__new__(cls)
        mesh._setup(
            parent._device_type, parent._tensor_device_type, parent._root, dims, names, parent._flattened
        )
        return mesh

    def _setup(
        self,
        device_type: str,
        tensor_device_type: str,
        root: torch.Tensor,
        dims: tuple[tuple[int, ...], ...],
        names: tuple[str, ...] | None,
        flattened: dict[str, DeviceMesh],
    ) -> None:
        _sync_with_default_group()
        self._device_type = device_type
        self._tensor_device_type = tensor_device_type
        self._root = root
        self._dims = dims
        self._names = names
        self._rank = dist.get_rank()
        self._flattened = flattened  # shared by a root and everything derived from it
        self._generation = _generation

        hits = (root == self._rank).nonzero()
        root_coord = tuple(int(c) for c in hits[0].tolist()) if hits.numel() else None
        covered = [d for dim in dims for d in dim]
        if len(covered) == root.dim():
            fixed: list[Any] = [slice(None)] * root.dim()
        elif root_coord is None:
            raise ValueError(f"rank {self._rank} is not in the mesh {root.tolist()} and cannot slice it.")
        else:
            fixed = [slice(None) if d in covered else root_coord[d] for d in range(root.dim())]
        # Pin the dims this mesh does not span, then order and merge the rest
        # (see [Note: mesh representation]).
        pinned = root[tuple(fixed)]
        kept = [d for d in range(root.dim()) if d in covered]
        order = [kept.index(d) for d in covered]
        shape = tuple(math.prod(root.shape[d] for d in dim) for dim in dims)
        self._mesh = pinned.permute(order).reshape(shape)
        # A mesh never changes: its shape and identity key are computed once,
        # because DTensor dispatch asks for them on every op.
        self._shape = tuple(self._mesh.shape)
        self._identity = (self._device_type, self._shape, tuple(self._mesh.flatten().tolist()), self._names)
        local = (self._mesh == self._rank).nonzero()
        self._coordinate = tuple(int(c) for c in local[0].tolist()) if local.numel() else None
        self._dim_lines = tuple(self._create_groups(dim) for dim in dims)

    def _create_groups(self, root_dims: tuple[int, ...]) -> tuple[int, ...] | None:
        """Create (or reuse) the groups of every line along ``root_dims``; return this rank's line."""
        mine: tuple[int, ...] | None = None
        for line in _lines(self._root, root_dims):
            _group_for(tuple(line))
            if self._rank in line:
                mine = tuple(line)
        return mine

    # -- helpers ------------------------------------------------------------------

    def _check_fresh(self, what: str) -> None:
        # Fast path: built in this generation and the default group is still the one the cache
        # saw, so _sync_with_default_group would change nothing (see [Note: group epoch] in
        # hp_core.distributed); two reads instead of a property call.
        if self._generation == _generation and _c10d._world.default_pg is _cache_world:
            return
        _sync_with_default_group()
        if self._generation != _generation:
            raise StaleMeshError(
                f"DeviceMesh.{what}: this mesh ({self!r}) was built before its process groups were released "
                "(clear_group_cache(), destroy_distributed() or a re-created default group); build it again "
                "with init_device_mesh(...)."
            )

    def _check_member(self, what: str) -> tuple[int, ...]:
        if self._coordinate is None:
            raise ValueError(
                f"DeviceMesh.{what}: rank {self._rank} is not in this mesh {self._mesh.tolist()}; "
                "only its ranks can use it."
            )
        return self._coordinate

    def _dim_index(self, dim: int | str | None, what: str) -> int:
        if dim is None:
            if self.ndim != 1:
                raise ValueError(
                    f"DeviceMesh.{what}: dim=None is only allowed for a 1-D mesh, but this mesh has "
                    f"{self.ndim} dims {self._names or tuple(range(self.ndim))}; pass the dim to use."
                )
            return 0
        if isinstance(dim, str):
            if self._names is None or dim not in self._names:
                raise KeyError(
                    f"DeviceMesh.{what}: no dim named {dim!r}; this mesh's dims are "
                    f"{self._names if self._names is not None else 'unnamed (use an int)'}."
                )
            return self._names.index(dim)
        if isinstance(dim, int) and not isinstance(dim, bool):
            if not -self.ndim <= dim < self.ndim:
                names = f" or a name in {self._names}" if self._names is not None else ""
                raise IndexError(
                    f"DeviceMesh.{what}: dim={dim} is out of range for a {self.ndim}-D mesh; "
                    f"use an index in [{-self.ndim}, {self.ndim - 1}]{names}."
                )
            return dim % self.ndim
        raise TypeError(
            f"DeviceMesh.{what}: dim must be an int, a dim name or None, got {type(dim).__name__} {dim!r}; "
            f"use an index in [{-self.ndim}, {self.ndim - 1}]"
            + (f" or a name in {self._names}." if self._names is not None else ".")
        )

    # -- read-only properties --------------------------------------------------------

    @property
    def device_type(self) -> str:
        """The device type given at creation (what code branches on)."""
        return self._device_type

    @property
    def mesh(self) -> torch.Tensor:
        """The global ranks of this mesh, shaped like it (a CPU int64 tensor; do not modify)."""
        return self._mesh

    @property
    def shape(self) -> tuple[int, ...]:
        """Size of each dim."""
        return self._shape

    @property
    def ndim(self) -> int:
        """Number of dims."""
        return self._mesh.dim()

    @property
    def mesh_dim_names(self) -> tuple[str, ...] | None:
        """The dim names, or None for an unnamed mesh."""
        return self._names

    def size(self, dim: int | str | None = None) -> int:
        """Number of ranks in the mesh, or along ``dim``."""
        if dim is None:
            return self._mesh.numel()
        return self.shape[self._dim_index(dim, "size")]

    def get_rank(self) -> int:
        """This process's global rank."""
        return self._rank

    def get_coordinate(self) -> tuple[int, ...] | None:
        """This rank's index along every dim, or None if it is not in the mesh."""
        return self._coordinate

    def get_local_rank(self, dim: int | str | None = None) -> int:
        """This rank's index along ``dim``, which is also its rank in ``get_group(dim)``."""
        index = self._dim_index(dim, "get_local_rank")
        return self._check_member("get_local_rank")[index]

    def get_group(self, dim: int | str | None = None) -> dist.ProcessGroup:
        """The process group of this rank's line along ``dim`` (``None`` only for a 1-D mesh)."""
        index = self._dim_index(dim, "get_group")
        self._check_member("get_group")
        self._check_fresh("get_group")
        # Looked up, not stored: only the cache holds groups, so clearing it
        # releases them (see [Note: group cache]).
        line = self._dim_lines[index]
        assert line is not None  # members are on a line of every dim
        group = _groups[line][0]
        assert group is not None
        return group

    def get_all_groups(self) -> list[dist.ProcessGroup]:
        """This rank's group along every dim, in dim order."""
        return [self.get_group(d) for d in range(self.ndim)]

    # -- slicing and flattening ---------------------------------------------------

    def __getitem__(self, names: str | tuple[str, ...]) -> DeviceMesh:
        """The sub-mesh over one or several dims (given in mesh order) through this rank."""
        self._check_fresh("__getitem__")
        self._check_member("__getitem__")
        wanted = (names,) if isinstance(names, str) else names
        if not isinstance(wanted, tuple) or not wanted or not all(isinstance(n, str) for n in wanted):
            raise TypeError(
                f"DeviceMesh[...]: index with a dim name or a tuple of names, e.g. mesh['dp'] or "
                f"mesh['dp', 'tp']; got {names!r}."
            )
        if (
            len(wanted) == 1
            and wanted[0] in self._flattened
            and (self._names is None or wanted[0] not in self._names)
        ):
            return self._flattened_submesh(wanted[0])
        if self._names is None:
            raise KeyError(
                f"DeviceMesh[{names!r}]: this mesh has no dim names; create it with "
                "mesh_dim_names=... to slice by name."
            )
        unknown = [n for n in wanted if n not in self._names]
        if unknown:
            flat = f" or flattened names {sorted(self._flattened)}" if self._flattened else ""
            raise KeyError(
                f"DeviceMesh[{names!r}]: unknown dim name(s) {unknown}; "
                f"this mesh has dims {self._names}{flat}."
            )
        if len(set(wanted)) != len(wanted):
            raise ValueError(f"DeviceMesh[{names!r}]: a dim name is repeated; list each dim once.")
        indices = [self._names.index(n) for n in wanted]
        if indices != sorted(indices):
            in_order = tuple(sorted(wanted, key=self._names.index))
            raise ValueError(
                f"DeviceMesh[{names!r}]: dims must be given in mesh order {self._names}; "
                f"use mesh[{in_order!r}]."
            )
        if len(indices) == self.ndim:
            return self
        return DeviceMesh._derived(self, tuple(self._dims[i] for i in indices), tuple(wanted))

    def _flattened_submesh(self, name: str) -> DeviceMesh:
        flat = self._flattened[name]
        mine = {d for dim in self._dims for d in dim}
        if not set(flat._dims[0]) <= mine:
            raise KeyError(
                f"DeviceMesh[{name!r}]: the flattened dim {name!r} spans dims this mesh "
                f"({self._names}) does not have; slice it from the mesh it was flattened from."
            )
        return flat

    def flatten(self, name: str | None = None) -> DeviceMesh:
        """A 1-D mesh over the same ranks, row-major; its name defaults to the dim names joined by ``_``.

        Creates process groups, so call it on every rank in the same order
        (see [Note: group cache]). The result is remembered, so ``mesh[name]``
        returns it afterwards, also from the mesh it came from.
        """
        self._check_fresh("flatten")
        self._check_member("flatten")
        if name is not None and (not isinstance(name, str) or not name):
            raise TypeError(f"DeviceMesh.flatten: name must be a non-empty string or None, got {name!r}.")
        if name is None and self._names is not None:
            name = "_".join(self._names)
        if self.ndim == 1 and (name is None or (self._names is not None and name == self._names[0])):
            return self
        if name is not None and self._names is not None and name in self._names:
            raise ValueError(
                f"DeviceMesh.flatten: name {name!r} is already a dim of this mesh {self._names}; "
                "pick another name."
            )
        spanned = tuple(sorted(d for dim in self._dims for d in dim))
        if name is not None and name in self._flattened:
            existing = self._flattened[name]
            if existing._dims == (spanned,) and existing._generation == _generation:
                return existing
            if existing._dims != (spanned,):
                raise ValueError(
                    f"DeviceMesh.flatten: the name {name!r} already names a flattened dim over other dims; "
                    "pick another name."
                )
        # New groups may be created here, collectively: agree first ([Note: cross-rank agreement]).
        agree_across_world(
            "DeviceMesh.flatten",
            "call flatten on every rank, in the same order, on the same dims with the same name.",
            root=self._root,
            dims=spanned,
            name=name,
        )
        flat = DeviceMesh._derived(self, (spanned,), None if name is None else (name,))
        if name is not None:
            self._flattened[name] = flat
        return flat

    # -- combining and reordering dims (see [Note: combining meshes]) -------------------

    # [Note: combining meshes]
    # A library that composes parallelisms is handed meshes sliced from one
    # mesh (FSDP gets mesh["dp"], tensor parallelism mesh["tp"]) and needs
    # the mesh over both, sometimes in another dim order (hp_fsdp orders a TP
    # dim before the FSDP dim when both cut the same tensor dim). Every dim of
    # such a mesh spans root dims some existing mesh already spans, so its
    # process groups are in the cache: combining and permuting are local, no
    # rank communicates, and they may run anywhere, in any order, like slicing.
    # torch's DeviceMesh has the same operation as the private
    # ``DeviceMesh._concatenate``; ``permute`` follows ``Tensor.permute``.

    @staticmethod
    def concatenate(
        meshes: Sequence[DeviceMesh], *, mesh_dim_names: Sequence[str] | None = None
    ) -> DeviceMesh:
        """One mesh whose dims are the dims of ``meshes``, in order (``mesh["dp"]`` + ``mesh["tp"]``).

        The meshes must be sliced (or flattened) from the same mesh and span
        disjoint dims of it; this rank must belong to all of them. The names
        default to the meshes' names joined (None when one is unnamed). No
        communication (see [Note: combining meshes]).
        """
        what = "DeviceMesh.concatenate"
        parts = list(meshes) if not isinstance(meshes, DeviceMesh) else None
        if not parts or not all(isinstance(m, DeviceMesh) for m in parts):
            raise TypeError(
                f"{what}: expected a non-empty list of hp_core DeviceMeshes, got {meshes!r}; e.g. "
                "DeviceMesh.concatenate([mesh['dp'], mesh['tp']])."
            )
        first = parts[0]
        for index, part in enumerate(parts):
            part._check_fresh("concatenate")
            part._check_member("concatenate")
            if part._device_type != first._device_type:
                raise ValueError(
                    f"{what}: meshes[{index}] has device type {part._device_type!r} but meshes[0] has "
                    f"{first._device_type!r}; combine meshes of one device type."
                )
            if part._root.shape != first._root.shape or not torch.equal(part._root, first._root):
                raise ValueError(
                    f"{what}: meshes[{index}] {part!r} and meshes[0] {first!r} were not sliced from the same "
                    f"mesh (their parents are {part._root.tolist()} and {first._root.tolist()}); slice "
                    "both from one mesh, e.g. mesh = init_device_mesh(..., (dp, tp), mesh_dim_names=('dp', "
                    "'tp')), then mesh['dp'] and mesh['tp']."
                )
        dims = tuple(dim for part in parts for dim in part._dims)
        spanned = [d for dim in dims for d in dim]
        shared = sorted({d for d in spanned if spanned.count(d) > 1})
        if shared:
            raise ValueError(
                f"{what}: the meshes {parts!r} overlap (they share dim(s) {shared} of the mesh they were "
                "sliced from), so a rank would appear twice; combine meshes over different dims."
            )
        names: tuple[str, ...] | None
        if mesh_dim_names is not None:
            names = _check_names(mesh_dim_names, len(dims), what)
        elif all(part._names is not None for part in parts):
            names = tuple(n for part in parts for n in part._names or ())
            if len(set(names)) != len(names):
                raise ValueError(
                    f"{what}: the joined names {names} repeat a name; pass mesh_dim_names=(...) with one "
                    "distinct name per dim."
                )
        else:
            names = None
        if len(parts) == 1 and names == first._names:
            return first
        return DeviceMesh._derived(first, dims, names)

    def permute(self, *dims: int | str) -> DeviceMesh:
        """The same ranks with the dims reordered: ``mesh.permute("tp", "dp")`` of a ``("dp", "tp")`` mesh.

        ``dims`` lists every dim once, by index or name; each dim keeps its
        name and its process group. No communication (see [Note: combining meshes]).
        """
        self._check_fresh("permute")
        self._check_member("permute")
        if len(dims) == 1 and isinstance(dims[0], (tuple, list)):
            dims = tuple(dims[0])
        order = [self._dim_index(d, "permute") for d in dims]
        if sorted(order) != list(range(self.ndim)):
            raise ValueError(
                f"DeviceMesh.permute: got dims {dims}, which is not an ordering of this mesh's {self.ndim} "
                f"dims {self._names or tuple(range(self.ndim))}; list every dim exactly once."
            )
        if order == list(range(self.ndim)):
            return self
        names = None if self._names is None else tuple(self._names[i] for i in order)
        return DeviceMesh._derived(self, tuple(self._dims[i] for i in order), names)

    # -- interop ----------------------------------------------------------------------

    @classmethod
    def from_torch(cls, torch_mesh: TorchDeviceMesh | DeviceMesh) -> DeviceMesh:
        """The hp_core mesh for a ``torch.distributed.device_mesh.DeviceMesh``, on torch's own groups.

        Same device type, rank layout and dim names. Every process group
        comes from torch (see [Note: meshes from torch] in ``hp_core._torch_mesh``):
        none is created and nothing is communicated, so, like slicing, it
        may run anywhere. Slices, ``_flatten`` and ``_unflatten`` meshes of
        one torch mesh convert to slices and flattenings of one hp_core
        mesh (they can be sliced, flattened and concatenated together).
        Memoised per torch mesh object: the same hp_core mesh comes back
        every time, and ``from_torch(mesh.to_torch())`` is ``mesh``. An
        hp_core mesh is returned as it is.
        """
        from hp_core._torch_mesh import convert

        return convert(torch_mesh)

    def to_torch(self) -> TorchDeviceMesh:
        """An equivalent ``torch.distributed.device_mesh.DeviceMesh`` built on this mesh's groups.

        Use it to hand the layout to torch DTensor or FSDP2 without creating
        new process groups. An n-D mesh needs dim names (torch requires them
        when building from groups).
        """
        self._check_fresh("to_torch")
        self._check_member("to_torch")
        key = self._key()
        cached = _torch_meshes.get(key)
        if cached is not None:
            return cached
        from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh

        groups = self.get_all_groups()
        if self.ndim == 1:
            torch_mesh = TorchDeviceMesh.from_group(
                groups[0], self._tensor_device_type, mesh_dim_names=self._names
            )
        else:
            if self._names is None:
                raise ValueError(
                    f"DeviceMesh.to_torch: this {self.ndim}-D mesh has no dim names, which torch's "
                    "DeviceMesh.from_group requires; create it with mesh_dim_names=(...)."
                )
            torch_mesh = TorchDeviceMesh.from_group(
                groups, self._tensor_device_type, mesh=self._mesh, mesh_dim_names=self._names
            )
        _torch_meshes[key] = torch_mesh
        _from_torch.setdefault(id(torch_mesh), (torch_mesh, self))  # from_torch(m.to_torch()) is m
        return torch_mesh

    # -- identity -----------------------------------------------------------------------

    @property
    def identity(self) -> tuple[Any, ...]:
        """A hashable value identity: device type, shape, ranks and dim names (no tensor read).

        Equal meshes have equal identities. Computed once at construction, so
        code that runs while ``torch.compile`` traces (under fake tensors, where
        reading the rank tensor is refused) can key caches by it.
        """
        return self._identity

    def _key(self) -> tuple[Any, ...]:
        return self._identity

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DeviceMesh):
            return NotImplemented
        return self is other or self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        names = f", mesh_dim_names={self._names}" if self._names is not None else ""
        return f"DeviceMesh({self._device_type!r}, {self._mesh.tolist()}{names})"


def init_device_mesh(
    device_type: str,
    mesh_shape: Sequence[int],
    *,
    mesh_dim_names: Sequence[str] | None = None,
) -> DeviceMesh:
    """Lay the world's ranks out row-major in ``mesh_shape`` and create one group per line.

    Call it on every rank with the same arguments (see [Note: group cache]).
    The default process group must exist (``hp_core.init_distributed()``).
    """
    what = "init_device_mesh"
    _agree_then_check_device_type(
        what,
        "call init_device_mesh on every rank with the same device_type, mesh_shape and mesh_dim_names.",
        device_type,
        mesh_shape=mesh_shape,
        mesh_dim_names=mesh_dim_names,
    )
    shape = _check_shape(mesh_shape)
    names = _check_names(mesh_dim_names, len(shape), what)
    require_initialized(what)
    world_size = dist.get_world_size()
    if math.prod(shape) != world_size:
        raise ValueError(
            f"{what}: mesh_shape={shape} holds {math.prod(shape)} ranks but the world size is "
            f"{world_size}; choose a shape whose product is {world_size}, e.g. ({world_size},)."
        )
    root = torch.arange(world_size, dtype=torch.int64, device="cpu").view(shape)  # not the ambient device
    mesh = DeviceMesh.__new__(DeviceMesh)  # the arguments are agreed and checked: skip __init__'s gather
    mesh._init_root(device_type, root, names)
    return mesh
