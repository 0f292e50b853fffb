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
