"""One cross-rank agreement for every hp library: a digest first, the details only on a mismatch.

:func:`verify_across_ranks` is what mesh creation, ``distribute_tensor``,
``DTensor.from_local(run_check=True)``, ``parallelize_module``,
``fully_shard``'s first communication and a pipeline schedule's first step
call; see [Note: cross-rank agreement].
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from hp_core._checks import object_device_ready
from hp_core.debug import DebugLevel, get_debug_level
from hp_core.logging import get_logger
from hp_core.platform import get_platform

__all__ = ["verify_across_ranks"]

_log = get_logger("hp_core")

# [Note: cross-rank agreement]
# Some calls must get the same arguments on every rank: creating a mesh's
# process groups, a broadcast of a tensor whose shape each rank gives, the
# first all-gather of an FSDP unit, a pipeline's first transfer. If the
# ranks' arguments differ, the first collective corrupts data silently (gloo
# broadcasts a longer tensor into a shorter one's bytes), aborts the process
# (a dtype mismatch) or hangs (one rank raises locally while its peers wait).
# So these calls first compare a description of their arguments across ranks,
# *before* any local check, and raise the same error on every rank.
#
# The comparison costs one tensor ``all_gather`` of eight int64s (64 bytes
# per rank) per group (per mesh dim on a mesh: a slice has no single group, and a
# new flattened group would be created collectively over the whole world):
# a 128-bit digest of the description's text, plus up to ``_INLINE`` small
# ints a caller needs from every rank anyway (``from_local``'s local shapes),
# so those ride along for free. No object collective (pickling, two
# all-gathers) runs on that path. Only when the digests differ, which every
# rank sees alike, do the ranks exchange the descriptions themselves
# (``all_gather_object``) to name each rank's value; then all raise. The
# exchange goes to torch.distributed directly, not through hp_core's
# collectives: it is a check, not the library's traffic, so
# ``hp_testing.record_collectives`` does not count it. Everything here runs at
# every debug level ([Note: debug levels] in hp_core.debug): 64 bytes per rank
# per call that communicates anyway, or once per mesh, root or schedule.
#
# A description must be built from values whose ``repr`` is the same on every
# rank when they mean the same (tuples, strings, numbers, names; a tensor by
# shape and dtype, not by its storage). Object addresses (`` at 0x..``) are
# dropped from the text before hashing, so a default ``repr`` does not make
# equal calls disagree.

_INLINE = 6  # extra ints carried inside the digest exchange; more take a second exchange
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


Explain = Callable[[list[Any], list[int]], str]


def verify_across_ranks(
    value: Any,
    group: Any = None,
    *,
    what: str,
    fix: str,
    explain: Explain | None = None,
    extra: Sequence[int] | None = None,
) -> list[tuple[int, ...]] | None:
    """Raise ``ValueError`` on every rank unless every rank of ``group`` passed an equal ``value``.

    ``value`` is a picklable description (see [Note: cross-rank agreement]);
    ``group`` a ProcessGroup, an hp_core ``DeviceMesh`` of any number of dims,
    or None for the default group. The error reads ``"{what}: {details};
    {fix}"``, where ``details`` comes from ``explain(values, ranks)`` (every
    rank's value and global rank, in rank order; row-major on a mesh) or, by
    default, names the keys of a mapping that differ with each rank's values.
    ``extra``: ints that may differ between ranks (their count must follow
    from ``value``); every rank's are returned, in the same order, or None
    without them. One tensor ``all_gather`` per group when the ranks
    agree (two when ``extra`` has more than six ints).
    """
    groups, ranks = _groups_and_ranks(group)
    text = _ADDRESS.sub("", repr(value))
    mine = list(extra) if extra is not None else []
    if len(ranks) == 1:
        return [tuple(mine)] if extra is not None else None
    digest = hashlib.blake2b(f"{len(mine)}|{text}".encode(), digest_size=16).digest()
    head = [
        int.from_bytes(digest[:8], "little", signed=True),
        int.from_bytes(digest[8:], "little", signed=True),
    ]
    inline = mine if len(mine) <= _INLINE else []
    rows = _gather_ints(head + inline + [0] * (_INLINE - len(inline)), groups)
    if any(row[:2] != rows[0][:2] for row in rows):
        values = _gather_objects(value, groups)
        details = (explain or _differences)(values, ranks)
        raise ValueError(f"{what}: {details}; {fix}")
    _log.debug("agreed across %d ranks: %s", len(ranks), what)
    if get_debug_level() >= DebugLevel.DETAIL:
        _log.debug("agreed across %d ranks: %s: %s", len(ranks), what, text)
    if extra is None:
        return None
    if len(mine) <= _INLINE:
        return [tuple(row[2 : 2 + len(mine)]) for row in rows]
    return [tuple(row) for row in _gather_ints(mine, groups)]


def _groups_and_ranks(group: Any) -> tuple[list[dist.ProcessGroup], list[int]]:
    """The groups to gather over, last mesh dim first, and the global ranks in gather order."""
    if group is not None and hasattr(group, "get_group") and not isinstance(group, dist.ProcessGroup):
        groups = [group.get_group(dim) for dim in reversed(range(group.ndim))]
        return groups, [int(r) for r in group.mesh.flatten().tolist()]
    pg = dist.group.WORLD if group is None else group
    assert pg is not None, "verify_across_ranks needs an initialised default process group"
    return [pg], dist.get_process_group_ranks(pg)


def _device(pg: dist.ProcessGroup) -> torch.device:
    """Where the exchanged tensor must live for ``pg``'s backend (the CPU for gloo)."""
    if "gloo" in str(dist.get_backend(pg)):
        return torch.device("cpu")
    object_device_ready(pg)
    return get_platform().handle.current_device()


def _gather_ints(values: list[int], groups: list[dist.ProcessGroup]) -> list[list[int]]:
    """Every rank's ``values`` (equal lengths), row-major over the groups (the last mesh dim first)."""
    data = torch.tensor(values, dtype=torch.int64, device=_device(groups[0]))
    for pg in groups:
        parts = [torch.empty_like(data) for _ in range(dist.get_world_size(pg))]
        dist.all_gather(parts, data, group=pg)  # the list form: every backend, no deprecation
        data = torch.stack(parts)
    return data.reshape(-1, len(values)).tolist()


def _gather_objects(value: Any, groups: list[dist.ProcessGroup]) -> list[Any]:
    """Every rank's ``value``, in the order of :func:`_gather_ints` (the mismatch path only)."""
    flat: list[Any] = [value]
    for pg in groups:
        object_device_ready(pg)
        parts: list[Any] = [None] * dist.get_world_size(pg)
        dist.all_gather_object(parts, flat, group=pg)
        flat = [item for part in parts for item in part]
    return flat


def _differences(values: list[Any], ranks: list[int]) -> str:
    """The differing keys of mappings with each rank's values, or each rank's whole value."""
    if all(isinstance(v, Mapping) for v in values):
        keys = list(dict.fromkeys(k for v in values for k in v))
        differing = [k for k in keys if any(v.get(k) != values[0].get(k) for v in values)]
        if not differing:  # equal by ==, different in text: show the text
            differing = keys
        per_rank = "; ".join(
            f"rank {rank}: " + ", ".join(f"{k}={v.get(k)!r}" for k in differing)
            for rank, v in zip(ranks, values, strict=True)
        )
        return f"the ranks passed different {', '.join(map(str, differing))} ({per_rank})"
    per_rank = "; ".join(f"rank {rank}: {v!r}" for rank, v in zip(ranks, values, strict=True))
    return f"the ranks passed different values ({per_rank})"
