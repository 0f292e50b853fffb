"""Values of the rank-local fixtures, built inside each rank.

``rank`` and ``world_size`` are plain ints; ``device_mesh_factory`` builds
``hp_core`` meshes over the rank's default process group, so a test can ask for
several mesh shapes without repeating the init boilerplate.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from hp_core import DeviceMesh


class DeviceMeshFactory(Protocol):
    """Builds a mesh over the current ranks: ``factory((2, 2), ("dp", "tp"))``."""

    def __call__(
        self,
        mesh_shape: Sequence[int],
        mesh_dim_names: Sequence[str] | None = None,
        *,
        device_type: str | None = None,
    ) -> DeviceMesh: ...


def make_device_mesh_factory() -> DeviceMeshFactory:
    """A factory bound to the platform this rank runs on (``cpu`` under the harness)."""

    def factory(
        mesh_shape: Sequence[int],
        mesh_dim_names: Sequence[str] | None = None,
        *,
        device_type: str | None = None,
    ) -> DeviceMesh:
        from hp_core import get_platform, init_device_mesh

        kind = device_type or get_platform().device_type
        names = tuple(mesh_dim_names) if mesh_dim_names is not None else None
        return init_device_mesh(kind, tuple(mesh_shape), mesh_dim_names=names)

    return factory
