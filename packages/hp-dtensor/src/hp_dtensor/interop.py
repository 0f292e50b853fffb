"""Lossless conversion to and from ``torch.distributed.tensor.DTensor``.

Both sides describe the same thing (a local tensor, a mesh, placements, the
global shape and stride), so conversion re-wraps the same local tensor
without communication. The torch mesh is ``DeviceMesh.to_torch()`` of the
hp_core mesh, built on the same process groups. Ragged layouts have no torch
equivalent (torch assumes ``torch.chunk`` sizes) and are refused.
``StridedShard`` and torch's ``_StridedShard`` mean the same cut (torch's with
split factor 1 is a ``Shard``).
Both directions are differentiable.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from hp_core import DeviceMesh

from hp_dtensor.dtensor import DTensor, _check_mesh
from hp_dtensor.placements import PARTIAL_OPS, Partial, Placement, Replicate, Shard, StridedShard

__all__ = ["from_torch_dtensor", "to_torch_dtensor"]

_meshes: dict[int, DeviceMesh] = {}


def _to_torch_placement(placement: Placement) -> Any:
    from torch.distributed.tensor import Partial as TPartial
    from torch.distributed.tensor import Replicate as TReplicate
    from torch.distributed.tensor import Shard as TShard

    if isinstance(placement, Shard):
        return TShard(placement.dim)
    if isinstance(placement, StridedShard):
        from torch.distributed.tensor.placement_types import _StridedShard

        return _StridedShard(placement.dim, split_factor=placement.split_factor)
    if isinstance(placement, Partial):
        if placement.reduce_op == "norm":
            return _torch_norm_partial(cast(float, placement.norm_type))
        return TPartial(placement.reduce_op)
    return TReplicate()


def _torch_norm_partial(norm_type: float) -> Any:
    """torch's form of ``Partial("norm", p)``: its ``_NormPartial`` for finite p, max / min for +-inf."""
    from torch.distributed.tensor import Partial as TPartial
    from torch.distributed.tensor._ops._math_ops import _NormPartial

    if norm_type == float("inf"):
        return TPartial("max")
    if norm_type == float("-inf"):
        return TPartial("min")
    return _NormPartial(norm_type)


def _from_torch_placement(placement: Any, placements: Any) -> Placement:
    unsupported = ValueError(
        f"from_torch_dtensor: placement {placement!r} (of {list(placements)}) has no hp_dtensor equivalent; "
        "hp_dtensor has Shard(dim), StridedShard(dim, split_factor), Replicate() and "
        "Partial('sum' | 'avg' | 'max' | 'min' | 'product' | 'norm'). "
        "Redistribute the torch DTensor to one of those first, e.g. "
        "t.redistribute(placements=[Replicate()] * mesh.ndim)."
    )
    # _StridedShard also answers is_shard(), but cuts in strides: it is our StridedShard, never a
    # plain Shard (that would silently describe the wrong elements), unless its split factor is 1.
    if placement.is_shard() and type(placement).__name__ == "Shard":
        return Shard(placement.dim)
    if type(placement).__name__ == "_StridedShard":
        factor = int(placement.split_factor)
        return Shard(placement.dim) if factor == 1 else StridedShard(placement.dim, factor)
    if placement.is_partial():
        # torch's p-norm partial says reduce_op "sum" but reduces |x|^p: read as a plain sum it would
        # silently give wrong values, so it maps to our norm partial; other subclasses are refused.
        kind = type(placement).__name__
        if kind == "_NormPartial":
            return Partial("norm", float(placement.norm_type))
        if kind != "Partial" or str(placement.reduce_op) not in PARTIAL_OPS:
            raise unsupported
        return Partial(str(placement.reduce_op))
    if placement.is_replicate():
        return Replicate()
    raise unsupported


def to_torch_dtensor(tensor: DTensor) -> torch.Tensor:
    """The same tensor as a ``torch.distributed.tensor.DTensor`` on ``mesh.to_torch()``."""
    from torch.distributed.tensor import DTensor as TorchDTensor

    if not isinstance(tensor, DTensor):
        raise TypeError(
            f"to_torch_dtensor: expected an hp_dtensor.DTensor, got {type(tensor).__name__}; build one with "
            "hp_dtensor.distribute_tensor(...) or DTensor.from_local(...) first."
        )
    layout = tensor._layout
    if layout.ragged is not None:
        raise ValueError(
            f"to_torch_dtensor: the tensor has ragged per-rank sizes ({layout}), which torch DTensor cannot "
            "represent; redistribute it first, e.g. .redistribute(placements=[Replicate()] * mesh.ndim)."
        )
    torch_mesh = layout.mesh.to_torch()
    _meshes[id(torch_mesh)] = layout.mesh
    return TorchDTensor.from_local(
        tensor.to_local(),
        torch_mesh,
        [_to_torch_placement(p) for p in layout.placements],
        run_check=False,
        shape=torch.Size(layout.shape),
        stride=layout.stride,
    )


def from_torch_dtensor(tensor: torch.Tensor, device_mesh: DeviceMesh | None = None) -> DTensor:
    """An hp_dtensor DTensor over ``device_mesh`` holding a torch DTensor's local tensor.

    ``device_mesh`` may be omitted for tensors whose torch mesh came from
    :func:`to_torch_dtensor` or ``DeviceMesh.to_torch()`` of a mesh seen there.
    """
    from torch.distributed.tensor import DTensor as TorchDTensor

    what = "from_torch_dtensor"
    if not isinstance(tensor, TorchDTensor):
        hint = (
            " It is already an hp_dtensor.DTensor."
            if isinstance(tensor, DTensor)
            else " Build one with torch.distributed.tensor.distribute_tensor or DTensor.from_local."
        )
        raise TypeError(f"{what}: expected a torch DTensor, got {type(tensor).__name__}.{hint}")
    if device_mesh is not None:
        _check_mesh(device_mesh, what)
    mesh = device_mesh if device_mesh is not None else _meshes.get(id(tensor.device_mesh))
    if mesh is None:
        raise ValueError(
            "from_torch_dtensor: pass device_mesh= (the hp_core mesh whose to_torch() the tensor uses); "
            "this torch mesh was not created through to_torch_dtensor."
        )
    if tuple(mesh.shape) != tuple(tensor.device_mesh.shape):
        raise ValueError(
            f"from_torch_dtensor: device_mesh has shape {mesh.shape} but the tensor's torch mesh has "
            f"{tuple(tensor.device_mesh.shape)}; pass the matching mesh."
        )
    ours, theirs = mesh.mesh.tolist(), tensor.device_mesh.mesh.tolist()
    if ours != theirs:
        raise ValueError(
            f"{what}: device_mesh holds ranks {ours} but the tensor's torch mesh holds {theirs}; pass the "
            "hp_core mesh over the same ranks (the one whose to_torch() the tensor lives on)."
        )
    placements = [_from_torch_placement(p, tensor.placements) for p in tensor.placements]
    return (
        DTensor.from_local(tensor.to_local(), mesh, placements, shape=None, run_check=False)
        if _even(tensor) and not any(isinstance(p, StridedShard) for p in placements)
        else _from_uneven(tensor, mesh, placements)
    )


def _even(tensor: Any) -> bool:
    local = tensor.to_local()
    sizes = list(local.shape)
    for mesh_dim, placement in enumerate(tensor.placements):
        if placement.is_shard():
            sizes[placement.dim] *= tensor.device_mesh.size(mesh_dim)
    return tuple(sizes) == tuple(tensor.shape)


def _from_uneven(tensor: Any, mesh: DeviceMesh, placements: list[Placement]) -> DTensor:
    # torch's uneven shards follow torch.chunk, which is our default rule: no gather needed. A strided
    # cut comes here too: its global shape is torch's, not the local one times the mesh.
    from hp_dtensor.dtensor import _FromLocal
    from hp_dtensor.layout import Layout, normalize_placements

    local = tensor.to_local()
    normalized = normalize_placements(placements, mesh, local.dim(), "from_torch_dtensor")
    layout = Layout(mesh, normalized, tuple(tensor.shape), tuple(tensor.stride()))
    return _FromLocal.apply(local, layout)
