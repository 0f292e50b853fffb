"""Which mesh an op runs on, when its DTensor arguments name meshes.

Every DTensor argument of one op must live on one mesh (equal by
:func:`hp_dtensor.layout.mesh_key`); the dispatcher asks here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hp_dtensor.layout import mesh_key

__all__ = ["common_mesh"]


def common_mesh(call_flat: Sequence[Any], positions: Sequence[int], func: Any) -> Any:
    mesh = call_flat[positions[0]]._layout.mesh
    for p in positions[1:]:
        other = call_flat[p]._layout.mesh
        if other is not mesh and mesh_key(other) != mesh_key(mesh):
            raise ValueError(
                f"{func}: DTensor arguments live on different meshes ({mesh!r} and {other!r}); an op "
                "needs all of its DTensors on one mesh. Move one with full_tensor() + distribute_tensor()."
            )
    return mesh
