"""Cross-rank agreement for hp-dtensor's entry points that communicate anyway.

``distribute_tensor`` (with a ``src_data_rank``), ``DTensor.from_local`` with
``run_check=True`` (or a ``shape=`` to check against), ``parallelize_module``
and ``distribute_module`` compare their arguments over the mesh with
:func:`hp_core.verify_across_ranks` before any local check
([Note: cross-rank agreement] in :mod:`hp_core.agreement`); the calls that do
not communicate (``from_local`` without a check, ``redistribute``, the op
dispatch) skip it. This module only describes arguments and words the error.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from hp_core import DeviceMesh, verify_across_ranks

__all__ = ["agree_over_mesh", "describe"]


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


def agree_over_mesh(
    what: str, mesh: DeviceMesh, fix: str, agreed: Mapping[str, Any], extra: Sequence[int] | None = None
) -> list[tuple[int, ...]] | None:
    """Raise on every rank if the ranks' ``agreed`` values differ; return every coordinate's ``extra``.

    ``agreed`` maps argument names to descriptions (see :func:`describe`);
    ``extra`` are ints that may differ (``from_local``'s local shape, whose
    length ``agreed`` fixes), gathered in the same exchange, in row-major
    mesh coordinate order. The error names each mesh coordinate's values.
    """
    coordinates = list(itertools.product(*(range(n) for n in mesh.shape)))
    agreed = dict(agreed)

    def explain(values: list[Any], ranks: list[int]) -> str:
        differing = [key for key in agreed if any(v.get(key) != values[0].get(key) for v in values)]
        lines = "; ".join(
            f"mesh coordinate {coord}: " + ", ".join(f"{key}={v.get(key)!r}" for key in differing)
            for coord, v in zip(coordinates, values, strict=True)
        )
        return f"the ranks of the mesh passed different {', '.join(differing)} ({lines})"

    return verify_across_ranks(agreed, mesh, what=what, fix=fix, explain=explain, extra=extra)
