"""torchtitan's meshes (torch ``DeviceMesh``) as hp_core meshes.

torchtitan builds every mesh in ``ParallelDims.build_mesh`` with torch's
``init_device_mesh``; hp_fsdp's ``fully_shard`` takes an ``hp_core.DeviceMesh``
only (a torch mesh is refused with a TypeError). Until hp_fsdp accepts torch's
mesh itself, the parallelize functions here rebuild the same layout (same rank
grid, same dim names) as an hp_core mesh.
"""

from __future__ import annotations

from typing import Any

import hp_core
import torch
from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh

# One hp_core mesh per torch mesh: ParallelDims hands out the same torch mesh
# object for the same dims, and hp_core.DeviceMesh creates process groups, so
# a second parallelize call on the same ParallelDims reuses them.
_converted: dict[int, tuple[TorchDeviceMesh, hp_core.DeviceMesh]] = {}


def hp_mesh_from_torch(mesh: Any) -> hp_core.DeviceMesh:
    """Return an ``hp_core.DeviceMesh`` with ``mesh``'s rank grid and dim names.

    Collective: every rank of the world calls it with the same mesh (as every
    rank calls torchtitan's parallelize function). An hp_core mesh is returned
    as it is.
    """
    if isinstance(mesh, hp_core.DeviceMesh):
        return mesh
    if not isinstance(mesh, TorchDeviceMesh):
        raise TypeError(
            f"hp_mesh_from_torch: expected a torch.distributed DeviceMesh or an hp_core.DeviceMesh, got "
            f"{type(mesh).__name__}; pass parallel_dims.get_mesh(...)."
        )
    hit = _converted.get(id(mesh))
    if hit is not None and hit[0] is mesh:
        return hit[1]
    converted = hp_core.DeviceMesh(mesh.device_type, mesh.mesh, mesh_dim_names=mesh.mesh_dim_names)
    _converted[id(mesh)] = (mesh, converted)
    return converted


def hp_dense_meshes(parallel_dims: Any) -> tuple[hp_core.DeviceMesh, hp_core.DeviceMesh | None]:
    """The data-parallel hp mesh for FSDP/HSDP and, when TP is on, the TP hp mesh beside it.

    Without TP and PP the data-parallel mesh is torchtitan's ``fsdp`` mesh (with
    ``dp_replicate`` in front for HSDP) converted by :func:`hp_mesh_from_torch`.
    Otherwise one hp mesh is built over the whole world (see
    :func:`hp_dense_root`) and sliced; the slices are checked against
    torchtitan's own ``tp`` and data-parallel meshes.
    """
    dp_names = ["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"]
    torch_dp = parallel_dims.get_mesh(dp_names)
    if not parallel_dims.tp_enabled and not parallel_dims.pp_enabled:
        return hp_mesh_from_torch(torch_dp), None
    root = hp_dense_root(parallel_dims)
    dp_mesh = root[tuple(dp_names)]
    pairs = [(dp_mesh, torch_dp, "+".join(dp_names))]
    tp_mesh = None
    if parallel_dims.tp_enabled:
        tp_mesh = root["tp"]
        pairs.append((tp_mesh, parallel_dims.get_mesh("tp"), "tp"))
    for ours, theirs, name in pairs:
        if ours.mesh.flatten().tolist() != theirs.mesh.flatten().tolist():
            raise RuntimeError(
                f"hp_dense_meshes: torchtitan's {name} mesh holds ranks {theirs.mesh.tolist()}, the hp mesh "
                f"built from its (pp, dp_replicate, fsdp, tp) layout {ours.mesh.tolist()}; torchtitan's mesh "
                "layout changed: update hp_torchtitan.meshes."
            )
    return dp_mesh, tp_mesh


def hp_dense_root(parallel_dims: Any) -> hp_core.DeviceMesh:
    """One hp mesh ``(pp, dp_replicate, fsdp, tp)`` over the whole world, as torchtitan lays it out.

    [Note: one hp mesh over the world]
    hp_fsdp needs the TP mesh and the data-parallel mesh to be dims of *one* hp
    mesh (it shards a TP DTensor again over dp and describes the result on the
    combined mesh). And an hp_core mesh is built collectively from the same
    rank grid on every rank, so with PP the per-stage meshes torchtitan hands
    out (a different rank grid on each pipeline rank) cannot be converted one by
    one. So the whole dense layout is built once, row-major over the world as
    ``ParallelDims.build_mesh`` unflattens it, and each rank slices its own
    coordinates out of it.
    """
    world_mesh = parallel_dims.world_mesh
    hit = _converted.get(id(world_mesh))
    if hit is not None and hit[0] is world_mesh:
        return hit[1]
    fsdp = parallel_dims.dp_shard * parallel_dims.cp
    shape = (parallel_dims.pp, parallel_dims.dp_replicate, fsdp, parallel_dims.tp)
    grid = torch.arange(parallel_dims.world_size).view(shape)
    root = hp_core.DeviceMesh(
        world_mesh.device_type, grid, mesh_dim_names=("pp", "dp_replicate", "fsdp", "tp")
    )
    _converted[id(world_mesh)] = (world_mesh, root)
    return root
