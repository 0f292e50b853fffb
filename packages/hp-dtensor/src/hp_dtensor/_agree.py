"""Cross-rank agreement for the entry points that communicate anyway.

[Note: agreement before validation]
``distribute_tensor`` (with a ``src_data_rank``), ``DTensor.from_local`` with
``run_check=True`` (or a ``shape=`` to check against), ``parallelize_module``
and ``distribute_module`` all talk to the other ranks of the mesh. If their
arguments differ between ranks, the first collective either corrupts data
silently (gloo broadcasts a longer tensor into a shorter one's bytes), aborts
the process (a dtype mismatch), or hangs (a rank raises locally while its
peers wait in the broadcast). So these calls first gather a small,
picklable description of their arguments from every rank of the mesh (one
``all_gather_object`` per mesh dim: the mesh may be a slice, so there is no
single group to use) and compare them *before* any local check. Every rank
then holds the same table, so a disagreement raises on every rank with the
same message, and so does any later local check, since the arguments it
looks at are now known to be equal everywhere. The calls that do not
communicate (``from_local`` without ``run_check``, ``redistribute``, the op
dispatch) skip this: it would add a collective to the hot path and to
compiled graphs.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping
from typing import Any

import hp_core.collectives as hc
import torch
from hp_core import DeviceMesh
from hp_core.distributed import mesh_group

__all__ = ["agree_over_mesh", "describe", "gather_over_mesh"]


def describe(value: Any) -> Any:
    """A picklable, comparable stand-in for an argument (tensors by type, shape, dtype and device type)."""
    if isinstance(value, torch.Tensor):
        return (type(value).__name__, tuple(value.shape), str(value.dtype), value.device.type)
    if isinstance(value, (list, tuple)):
        return tuple(describe(v) for v in value)
    if isinstance(value, Mapping):
        return tuple((describe(k), describe(v)) for k, v in value.items())
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    # An address in a repr (a generator, a function) differs between processes for the same code.
    return _ADDRESS.sub("", repr(value))


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def gather_over_mesh(mesh: DeviceMesh, value: Any) -> list[Any]:
    """Every mesh coordinate's ``value``, in row-major coordinate order (one gather per mesh dim)."""
    data: Any = value
    for mesh_dim in reversed(range(mesh.ndim)):
        data = hc.all_gather_object(data, mesh_group(mesh, mesh_dim))
    flat: list[Any] = []

    def walk(node: Any, depth: int) -> None:
        if depth == mesh.ndim:
            flat.append(node)
            return
        for child in node:
            walk(child, depth + 1)

    walk(data, 0)
    return flat


def _coordinates(mesh: DeviceMesh) -> list[tuple[int, ...]]:
    return list(itertools.product(*(range(n) for n in mesh.shape)))


def agree_over_mesh(
    what: str, mesh: DeviceMesh, fix: str, agreed: Mapping[str, Any], extra: Any = None
) -> list[Any]:
    """Raise on every rank if the ranks' ``agreed`` values differ; return every rank's ``extra``.

    ``agreed`` maps argument names to descriptions (see :func:`describe`);
    ``extra`` rides along in the same gather for values that may differ
    (``from_local``'s local shapes), so the check costs no second collective.
    See [Note: agreement before validation].
    """
    table = gather_over_mesh(mesh, (dict(agreed), extra))
    first = table[0][0]
    differing = [key for key in agreed if any(entry[0].get(key) != first.get(key) for entry in table)]
    if differing:
        lines = "; ".join(
            f"mesh coordinate {coord}: " + ", ".join(f"{key}={entry[0].get(key)!r}" for key in differing)
            for coord, entry in zip(_coordinates(mesh), table, strict=True)
        )
        raise ValueError(
            f"{what}: the ranks of the mesh passed different {', '.join(differing)} ({lines}); {fix}"
        )
    return [entry[1] for entry in table]
