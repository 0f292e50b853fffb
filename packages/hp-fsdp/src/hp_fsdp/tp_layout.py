"""Layouts for parameters that tensor parallelism already sharded (FSDP x TP).

See [Note: FSDP x TP] in :mod:`hp_fsdp.param` for the representation. This
module only computes layouts and checks that a TP parameter can compose with
the data-parallel mesh; it never communicates.
"""

from __future__ import annotations

import itertools
from typing import Any

from hp_core import DeviceMesh
from hp_dtensor import DTensor, Layout, Partial, Placement, Shard, chunk_sizes

__all__ = ["check_tp_param", "combined_layout", "tp_layout_of"]


def _layout(param: Any) -> Layout | None:
    if isinstance(param, DTensor):
        return param.layout_spec
    data = getattr(param, "data", None)
    if isinstance(data, DTensor):
        return data.layout_spec
    return None


def tp_layout_of(param: Any, fqn: str) -> Layout | None:
    """The TP layout of an already-distributed parameter, or None for a plain parameter."""
    return _layout(param)


def check_tp_param(param: Any, fqn: str, mesh: DeviceMesh, *, replicate: bool, shard_dim: int) -> None:
    """Raise (before anything changes) when a DTensor parameter cannot compose with ``mesh``."""
    layout = _layout(param)
    if layout is None:
        return
    tp_mesh = layout.mesh
    if replicate:
        raise ValueError(
            f"fully_shard: parameter {fqn!r} is a tensor-parallel DTensor {layout.placements}; it cannot be "
            "in replicate_params. Leave it to be sharded, or pass it in ignored_params."
        )
    if tp_mesh.ndim != 1 or any(isinstance(p, Partial) for p in layout.placements):
        raise NotImplementedError(
            f"fully_shard: parameter {fqn!r} is a DTensor on a {tp_mesh.ndim}-D mesh {tuple(tp_mesh.shape)} "
            f"with placements {layout.placements}; hp_fsdp composes with 1-D tensor parallelism "
            "(Shard or Replicate on the TP dim) only. Pass it in ignored_params."
        )
    if layout.is_ragged():
        raise NotImplementedError(
            f"fully_shard: parameter {fqn!r} is a DTensor with ragged shard sizes; hp_fsdp composes with the "
            "torch.chunk sizes parallelize_module produces. Redistribute it first or ignore it."
        )
    try:
        DeviceMesh.concatenate([mesh, tp_mesh])  # local: validates that the two meshes compose
    except ValueError as error:
        raise ValueError(
            f"fully_shard: parameter {fqn!r} is a DTensor over mesh {tp_mesh!r}, which is not another dim of "
            f"the data-parallel mesh {mesh!r} ({error}). Slice both from one mesh, e.g. mesh = "
            "init_device_mesh(..., (dp, tp), mesh_dim_names=('dp', 'tp')); parallelize_module(model, "
            "mesh['tp'], plan); fully_shard(block, mesh=mesh['dp'])."
        ) from error


def combined_layout(
    tp_layout: Layout, dp_mesh: DeviceMesh, dp_placements: tuple[Placement, ...], world: int
) -> Layout:
    """The exact layout over the data-parallel dims and the TP dim (see [Note: FSDP x TP])."""
    tp_mesh = tp_layout.mesh
    tp_placement = tp_layout.placements[0]
    fsdp = dp_placements[-1]
    assert isinstance(fsdp, Shard)
    ndim = len(tp_layout.shape)
    same_dim = isinstance(tp_placement, Shard) and tp_placement.dim % ndim == fsdp.dim % ndim
    mesh = DeviceMesh.concatenate([dp_mesh, tp_mesh])  # (*dp dims, tp), no communication
    n = mesh.ndim
    if same_dim:  # TP-major nesting: the TP dim goes before the FSDP shard dim
        mesh = mesh.permute(*range(n - 2), n - 1, n - 2)
        placements = (*dp_placements[:-1], tp_placement, fsdp)
        shard_pos, tp_pos = n - 1, n - 2
    else:
        placements = (*dp_placements, tp_placement)
        shard_pos, tp_pos = n - 2, n - 1
    table = []
    for coord in itertools.product(*(range(n) for n in mesh.shape)):
        sizes = list(tp_layout.local_shape_at((coord[tp_pos],)))
        sizes[fsdp.dim] = chunk_sizes(sizes[fsdp.dim], world)[coord[shard_pos]]
        table.append(tuple(sizes))
    return Layout(mesh, placements, tp_layout.shape, ragged=table)
