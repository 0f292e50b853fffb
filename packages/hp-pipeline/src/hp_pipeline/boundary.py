"""DTensors across a stage boundary: the local shard travels, the receiver rebuilds the DTensor.

Details: [Note: DTensors across stages].
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["DTensorMeta"]


# [Note: DTensors across stages]
# A stage of a tensor-parallel model (torchtitan's, say) may return DTensors,
# torch's or hp-dtensor's. A process group is not serialisable, so, as in torch,
# what crosses the boundary is the *local* shard, and the metadata of the first
# step ([Note: first step] in :mod:`hp_pipeline.executor`) says how to rebuild
# the DTensor on the other side: its class, placements, global shape and the
# mesh's dim names and shape (:class:`DTensorMeta`, a field of
# :class:`~hp_pipeline.stage.TensorMeta`). The receiving stage finds the mesh
# itself, because only it holds the groups: first among the meshes of the
# DTensors it already knows (its module's parameters and buffers, the DTensors
# it received or produced), then through ``PipelineStage(get_mesh=...)``,
# torch's ``GetMeshCallback``, called as ``get_mesh(mesh_dim_names, None)``
# (the layout argument is torch's private ``_MeshLayout``, which ours has no
# counterpart of; the mesh the callback returns is checked against the
# sender's shape instead). A mesh found once is cached on the stage.
#
# Gradients go back the same way. The gradient of a received DTensor may come
# out of autograd with other placements than the activation had (``Partial``
# after a row-parallel layer); it is redistributed to the activation's
# placements before its shard is sent, so the sender of the activation can
# rebuild it with the placements of the output it produced. That may cost a
# collective on the receiving stage's mesh where torch would send the partial
# sums as they are; the values are the same.
#
# hp-pipeline does not import hp-dtensor (nor need torch's DTensor): a DTensor
# is recognised by its public interface (``to_local``, ``placements``,
# ``device_mesh`` and the class's ``from_local``), which both share.


@dataclass(frozen=True)
class DTensorMeta:
    """How to rebuild a DTensor from its local shard ([Note: DTensors across stages])."""

    cls: str  # "module:qualname" of the DTensor class
    placements: tuple[Any, ...]
    global_shape: tuple[int, ...]
    global_stride: tuple[int, ...]
    mesh_dim_names: tuple[str, ...]
    mesh_shape: tuple[int, ...]

    def __str__(self) -> str:
        name = self.cls.rsplit(":", 1)[-1]
        return f"{name}{list(self.global_shape)} {list(self.placements)} on {self.mesh_dim_names}"


def is_dtensor(value: object) -> bool:
    """A DTensor, ours or torch's, recognised by the interface both have."""
    return (
        isinstance(value, torch.Tensor)
        and hasattr(value, "to_local")
        and hasattr(value, "placements")
        and hasattr(value, "device_mesh")
    )


def dtensor_meta(value: Any) -> DTensorMeta:
    mesh = value.device_mesh
    cls = type(value)
    return DTensorMeta(
        cls=f"{cls.__module__}:{cls.__qualname__}",
        placements=tuple(value.placements),
        global_shape=tuple(value.shape),
        global_stride=tuple(value.stride()),
        mesh_dim_names=tuple(mesh.mesh_dim_names or ()),
        mesh_shape=tuple(mesh.shape),
    )


def local_of(value: torch.Tensor) -> torch.Tensor:
    """What travels for ``value``: its local shard for a DTensor, itself otherwise."""
    return value.to_local() if is_dtensor(value) else value  # type: ignore[attr-defined]


def grad_to_send(grad: torch.Tensor, meta: DTensorMeta | None) -> torch.Tensor:
    """A gradient's shard, in the placements of its activation ([Note: DTensors across stages])."""
    if meta is None or not is_dtensor(grad):
        return grad
    if tuple(grad.placements) != meta.placements:  # type: ignore[attr-defined]
        grad = grad.redistribute(placements=list(meta.placements))  # type: ignore[attr-defined]
    return grad.to_local()  # type: ignore[attr-defined]


def _mesh_key(cls: str, names: Iterable[str], shape: Iterable[int]) -> tuple[Any, ...]:
    return (cls, tuple(names), tuple(shape))


class MeshFinder:
    """A stage's meshes by (DTensor class, dim names, shape): its own first, then ``get_mesh``."""

    def __init__(self, stage_index: int, get_mesh: Any) -> None:
        self.stage_index = stage_index
        self.get_mesh = get_mesh
        self._meshes: dict[tuple[Any, ...], Any] = {}

    def remember(self, tensors: Iterable[object]) -> None:
        """Cache the meshes of the DTensors among ``tensors``."""
        for t in tensors:
            if is_dtensor(t):
                meta = dtensor_meta(t)
                key = _mesh_key(meta.cls, meta.mesh_dim_names, meta.mesh_shape)
                self._meshes.setdefault(key, t.device_mesh)  # type: ignore[attr-defined]

    def find(self, meta: DTensorMeta, module: torch.nn.Module) -> Any:
        key = _mesh_key(meta.cls, meta.mesh_dim_names, meta.mesh_shape)
        mesh = self._meshes.get(key)
        if mesh is not None:
            return mesh
        self.remember([*module.parameters(), *module.buffers()])
        mesh = self._meshes.get(key)
        if mesh is not None:
            return mesh
        if self.get_mesh is None:
            raise ValueError(
                f"stage {self.stage_index} received a {meta} over a mesh of shape {list(meta.mesh_shape)}, "
                f"and no DTensor of its module lies on such a mesh; pass PipelineStage(..., "
                "get_mesh=lambda names, layout: mesh[names]) with the mesh the DTensor lives on"
            )
        mesh = self.get_mesh(meta.mesh_dim_names, None)
        if mesh is None or tuple(mesh.shape) != meta.mesh_shape:
            got = None if mesh is None else list(mesh.shape)
            raise ValueError(
                f"stage {self.stage_index}: get_mesh{meta.mesh_dim_names!r} returned a mesh of shape {got}, "
                f"but the {meta} was sent over a mesh of shape {list(meta.mesh_shape)}; return the mesh "
                "with those dim names that the sending stage's DTensor lives on"
            )
        self._meshes[key] = mesh
        return mesh


@functools.cache
def _dtensor_class(path: str) -> tuple[Any, bool]:
    """The DTensor class named ``module:qualname``, and whether its ``from_local`` takes ``stride``."""
    module, _, qualname = path.partition(":")
    cls: Any = importlib.import_module(module)
    for part in qualname.split("."):
        cls = getattr(cls, part)
    return cls, "stride" in inspect.signature(cls.from_local).parameters


def rebuild(local: torch.Tensor, meta: DTensorMeta, mesh: Any) -> torch.Tensor:
    """The DTensor ``local`` is the shard of, on ``mesh`` (no communication: ``run_check=False``)."""
    cls, takes_stride = _dtensor_class(meta.cls)
    whole: dict[str, Any] = {"shape": torch.Size(meta.global_shape)}
    if takes_stride:  # torch's needs both or neither
        whole["stride"] = meta.global_stride
    return cls.from_local(local, mesh, list(meta.placements), run_check=False, **whole)
