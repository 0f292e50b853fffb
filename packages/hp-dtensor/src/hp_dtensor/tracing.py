"""What ``torch.compile`` needs to know about hp_dtensor's metadata types.

TP boundaries are ``nonstrict_trace`` calls, so compiled graphs hold only
local ops and collectives ([Note: TP boundaries under torch.compile]);
placements are opaque value types that dynamo bakes in as constants.
"""

from __future__ import annotations

from typing import Any

from hp_dtensor.placements import Partial, Replicate, Shard

__all__ = ["register_placements"]


# [Note: TP boundaries under torch.compile]
# A tensor-parallel block converts its input to a DTensor (``from_local``) and
# its output back (``redistribute``, ``to_local``) in forward hooks. Dynamo
# cannot trace the construction of a wrapper subclass from Python metadata, so
# those conversions are marked ``torch._dynamo.nonstrict_trace``: dynamo puts
# each one into its graph as one opaque call, and AOTAutograd traces through it
# (under fake tensors, where redistribution issues functional collectives, see
# [Note: collectives under torch.compile] in ``hp_core._issue``). The compiled
# graph is therefore whole (``fullgraph=True`` works) and holds only local ops
# and collectives; the metadata is closed over by those calls, so only tensors
# cross into them.
#
# Placements are registered as opaque *value* types (as torch registers its
# own), so model code may read ``dt.placements`` inside a compiled region:
# dynamo bakes them into the graph as constants (``__fx_repr__``) and guards
# on their equality. That registration uses a private torch API; should it
# move, compile still works, only reading placements inside a graph breaks.
def register_placements() -> None:
    """Make the placement classes opaque value types for torch.compile (once; best effort)."""
    try:
        from torch._library.opaque_object import MemberType, is_opaque_type, register_opaque_type
    except ImportError:  # a torch without opaque objects: placements are only read outside graphs
        return
    members: dict[str, Any] = {
        name: MemberType.USE_REAL for name in ("is_shard", "is_partial", "is_replicate", "__eq__")
    }
    extra: dict[type, dict[str, Any]] = {
        Shard: {"dim": MemberType.USE_REAL},
        Partial: {"reduce_op": MemberType.USE_REAL, "norm_type": MemberType.USE_REAL},
    }
    for cls in (Shard, Replicate, Partial):
        if not is_opaque_type(cls):
            register_opaque_type(cls, typ="value", members=members | extra.get(cls, {}))


register_placements()
