"""Argument checks shared by the collectives, p2p and the mesh.

Each check runs before any communication: a rank that raises after its peers
entered a collective leaves them waiting until the timeout, so every mistake
we can see locally is reported locally, naming the observed value and the fix.
"""

from __future__ import annotations

import re
import weakref
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as _c10d

from hp_core.platform import get_platform

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
        # A DeviceMesh: only a 1-D one names a single group.
        if getattr(group, "ndim", 1) != 1:
            raise ValueError(
                f"{fn}(): group is the {group.ndim}-D mesh {group!r}, which has one group per dim; pass a "
                "1-D slice such as mesh['dp'], or mesh.get_group('dp')."
            )
        group = get_group()
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(
            f"{fn}(): rank {dist.get_rank()} is not a member of the group it was given "
            "(new_group returned NON_GROUP_MEMBER on this rank); call it only on the group's ranks."
        )
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"{fn}(): group must be a torch.distributed ProcessGroup, a 1-D hp_core DeviceMesh or None, "
            f"got {type(group).__name__} {short_repr(group)}; pass e.g. mesh.get_group('dp') or "
            "mesh['dp'], or None for the default group."
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
        raise TypeError(f"{fn}(): {name} must be a torch.Tensor, got {describe_non_tensor(tensor)}.")
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


def short_repr(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters, so an error about a huge object stays readable."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def describe_non_tensor(value: Any) -> str:
    """What was passed where a tensor belongs, and how to get one.

    A pending :class:`~hp_core.work.Work` is the usual mistake after
    ``async_op=True`` (its result is the tensor), so it gets its own hint.
    """
    if type(value).__name__ == "Work" and hasattr(value, "wait"):
        return "a pending Work handle; call .wait() on it first, which returns the tensor"
    return f"{type(value).__name__} {short_repr(value)}; pass a torch.Tensor, e.g. torch.as_tensor(value)"


def check_async_op(fn: str, async_op: Any) -> None:
    """``async_op`` must be a real bool: a truthy string would silently return a Work instead of a tensor."""
    if async_op is not True and async_op is not False:
        raise TypeError(
            f"{fn}(): async_op must be True or False, got {type(async_op).__name__} "
            f"{short_repr(async_op)}; pass async_op=True to get a Work handle."
        )


def check_tag(fn: str, tag: Any) -> None:
    """A p2p tag is an int; torch would reject anything else only inside the backend call."""
    if not isinstance(tag, int) or isinstance(tag, bool):
        raise TypeError(f"{fn}(): tag must be an int, got {short_repr(tag)}; e.g. tag=0.")


def plain(value: Any) -> Any:
    """A comparable, picklable stand-in for an argument (sequences as tuples, tensors as lists, else repr).

    Used to compare arguments across ranks ([Note: cross-rank agreement] in hp_core.agreement):
    whatever a rank was handed, its description can be gathered and printed.
    """
    if isinstance(value, torch.Tensor):
        return repr(value.tolist()) if value.device.type != "meta" else repr(value)
    if isinstance(value, (list, tuple)):
        return tuple(plain(v) for v in value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    # An address in a repr (a generator, a function) differs between processes for the same code.
    return re.sub(r" at 0x[0-9a-fA-F]+", "", repr(value))


def object_device_ready(group: Any = None) -> None:
    """Make the ``LOCAL_RANK`` device current before an object collective on an accelerator group.

    ``all_gather_object`` on NCCL / HCCL stages its bytes on the *current*
    device. A script that called ``dist.init_process_group`` itself (not
    ``hp_core.init_distributed``) and never chose a device would have every
    rank of a node on device 0, which NCCL refuses or hangs on. torch's own
    ``init_device_mesh`` picks the ``LOCAL_RANK`` device in that case; so do
    we, and only while the device runtime is untouched, so a device the user
    chose is never overridden. Gloo stages on the CPU and needs nothing.
    """
    if "gloo" in str(dist.get_backend(group)):
        return
    handle = get_platform().handle
    if not handle.is_accelerator:
        return
    initialized = getattr(torch.get_device_module(handle.tensor_device_type), "is_initialized", None)
    if initialized is None or not initialized():
        handle.set_device()


def agree_across_world(what: str, fix: str, **arguments: Any) -> None:
    """Raise on every rank if the ranks of the default group passed different ``arguments``.

    :func:`hp_core.verify_across_ranks` over the world, each argument by
    :func:`plain` ([Note: cross-rank agreement] in :mod:`hp_core.agreement`).
    """
    from hp_core.agreement import verify_across_ranks  # the agreement imports this module

    verify_across_ranks({key: plain(value) for key, value in arguments.items()}, what=what, fix=fix)
