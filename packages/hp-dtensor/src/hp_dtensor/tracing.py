"""What ``torch.compile`` needs to know about hp_dtensor's metadata types.

[Note: TP boundaries under torch.compile]
A tensor-parallel block converts its input to a DTensor (``from_local``) and
its output back (``redistribute``, ``to_local``) in forward hooks. Dynamo
cannot trace the construction of a wrapper subclass from Python metadata, so
those conversions are marked ``torch._dynamo.nonstrict_trace``: dynamo puts
each one into its graph as one opaque call, and AOTAutograd traces through it
(under fake tensors, where redistribution issues functional collectives, see
[Note: collectives under torch.compile] in ``hp_core._issue``). The compiled
graph is therefore whole (``fullgraph=True`` works) and holds only local ops
and collectives. The metadata passed to those calls (the mesh, placements and
layouts) is registered as pytree *constants*: immutable, hashable values that
dynamo guards on by equality and never traces into.
"""

from __future__ import annotations

from typing import Any

import torch.utils._pytree as pytree
from hp_core import DeviceMesh

from hp_dtensor.layout import Layout
from hp_dtensor.placements import Partial, Replicate, Shard

__all__ = ["register_constant_types"]

_REGISTERED: set[type] = set()


def register_constant_types(*types: type[Any]) -> None:
    """Register metadata types as pytree constants once (idempotent: pytree refuses a second time)."""
    for cls in types:
        if cls not in _REGISTERED:
            pytree.register_constant(cls)
            _REGISTERED.add(cls)


register_constant_types(DeviceMesh, Layout, Shard, Replicate, Partial)
