"""Argument checks shared by the collectives, p2p and the mesh.

Each check runs before any communication: a rank that raises after its peers
entered a collective leaves them waiting until the timeout, so every mistake
we can see locally is reported locally, naming the observed value and the fix.
"""

from __future__ import annotations

import weakref
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as _c10d

__all__: list[str] = []


class NotInitializedError(RuntimeError):
    """Raised when something needs the default process group before it exists."""


def require_initialized(what: str) -> None:
    """Raise :class:`NotInitializedError` naming ``what`` if there is no default group."""
    if not (dist.is_available() and dist.is_initialized()):
        raise NotInitializedError(
            f"{what} needs the default process group, which is not initialised. Call "
            "hp_core.init_distributed() first, and start the script with torchrun or "
            "`hp-run -n N script.py` so RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT are set."
        )


# -- per-group facts (see [Note: group facts]) -----------------------------------------------

# [Note: group facts]
# A ProcessGroup's members, size, this rank's place in it and its backend
# never change while the group lives, but torch answers each question with
# several dict lookups behind property calls, and a collective asked three of
# them per call. ``group_facts`` remembers them per group object. A hit needs
# the very same object (a weak reference, so the memo keeps no group alive and
# a reused id never matches) and that object still registered with torch
# (``pg_map``): destroying the group, alone or with the default group, drops
# it from there, so a dead group is never served; it takes the full path and
# gets torch's own error. A re-created group is a new object, a new entry.


class GroupFacts(NamedTuple):
    """What a collective needs to know about a live group."""

    rank: int  # this rank's rank in the group (-1 when not a member)
    size: int
    backend: str  # dist.get_backend(group), e.g. "gloo" or "cpu:gloo,cuda:nccl"


_FACTS: dict[int, tuple[weakref.ref[Any], GroupFacts]] = {}
_MAX_FACTS = 4096


def group_facts(group: dist.ProcessGroup) -> GroupFacts:
    """``group``'s rank, size and backend, remembered per live group (see [Note: group facts])."""
    entry = _FACTS.get(id(group))
    if entry is not None and entry[0]() is group and group in _c10d._world.pg_map:
        return entry[1]
    facts = GroupFacts(dist.get_rank(group), dist.get_world_size(group), str(dist.get_backend(group)))
    if len(_FACTS) >= _MAX_FACTS:
        _FACTS.clear()
    _FACTS[id(group)] = (weakref.ref(group), facts)
    return facts


def resolve_group(fn: str, group: Any) -> dist.ProcessGroup:
    """Turn ``group`` (a ProcessGroup, a 1-D DeviceMesh, or None) into a ProcessGroup this rank is in."""
    require_initialized(f"{fn}()")
    if group is None:
        default = dist.group.WORLD
        assert default is not None  # guaranteed by require_initialized
        return default
    get_group = getattr(group, "get_group", None)
    if get_group is not None and not isinstance(group, dist.ProcessGroup):
        # A DeviceMesh: only a 1-D one names a single group (get_group explains otherwise).
        group = get_group()
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(
            f"{fn}(): rank {dist.get_rank()} is not a member of the group it was given "
            "(new_group returned NON_GROUP_MEMBER on this rank); call it only on the group's ranks."
        )
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"{fn}(): group must be a torch.distributed ProcessGroup, a 1-D hp_core DeviceMesh or None, "
            f"got {type(group).__name__}."
        )
    if group_facts(group).rank < 0:
        raise ValueError(
            f"{fn}(): rank {dist.get_rank()} is not in the group {dist.get_process_group_ranks(group)}; "
            "call it only on the group's ranks."
        )
    return group


def check_tensor(fn: str, name: str, tensor: Any) -> torch.Tensor:
    """A dense, contiguous tensor, or an error that says how to get one.

    [Note: contiguous only]
    gloo reads and writes a tensor's storage as if it were contiguous, so a
    non-contiguous view (``torch.ones(4, 4)[:, 0]``) is silently reduced over
    the wrong elements. NCCL and HCCL reject such views anyway. We refuse them
    on every backend so code that passes here does not break on a cluster.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{fn}(): {name} must be a torch.Tensor, got {type(tensor).__name__}.")
    if tensor.layout != torch.strided:
        raise ValueError(
            f"{fn}(): {name} has layout {tensor.layout}; only dense (strided) tensors can be communicated. "
            "Convert it with .to_dense()."
        )
    if not tensor.is_contiguous():
        raise ValueError(
            f"{fn}(): {name} is not contiguous (shape {tuple(tensor.shape)}, "
            f"stride {tuple(tensor.stride())}); "
            "gloo would silently communicate the wrong elements. Pass `t.contiguous()` (and copy the "
            "result back into the view afterwards if the operation is in place)."
        )
    return tensor


def check_same_dtype(fn: str, a_name: str, a: torch.Tensor, b_name: str, b: torch.Tensor) -> None:
    """Input and output of a collective must share a dtype (backends do not convert)."""
    if a.dtype != b.dtype:
        raise ValueError(
            f"{fn}(): {a_name} has dtype {a.dtype} but {b_name} has dtype {b.dtype}; "
            f"cast one of them (e.g. `{b_name}.to({a.dtype})`) so they match."
        )
    if a.device != b.device:
        raise ValueError(
            f"{fn}(): {a_name} is on {a.device} but {b_name} is on {b.device}; put both on the same device."
        )


def check_group_rank(fn: str, name: str, value: int, group: dist.ProcessGroup) -> int:
    """``value`` is a global rank that belongs to ``group``; return its rank within the group."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{fn}(): {name} must be an int (a global rank), got {type(value).__name__}.")
    ranks = dist.get_process_group_ranks(group)
    if value not in ranks:
        raise ValueError(
            f"{fn}(): {name}={value} is not in the group, whose global ranks are {ranks}; "
            "pass one of those (ranks are global, not positions in the group)."
        )
    return ranks.index(value)
