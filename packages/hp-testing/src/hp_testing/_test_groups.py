"""On a pooled rank, between tests: forget the process groups a test made, as a fresh process never knew them.

A pooled rank keeps its default group for the next test, so torch's
``destroy_process_group()`` never runs there; the worker destroys the groups
the test made itself (they would pile up sockets) and must also undo what a
fresh process would not carry over: see [Note: group names across pooled tests].
Groups hp_core caches on purpose (one per rank set, for the life of the pool)
are kept.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

__all__ = ["GroupMark", "mark", "release", "rewind"]


@dataclass(frozen=True)
class GroupMark:
    """The groups alive and the group-name counter when a test started."""

    groups: frozenset[Any]
    count: int


def live_groups() -> set[Any]:
    """Every process group this rank knows (the default one included)."""
    if not dist.is_initialized():
        return set()
    return set(c10d._world.pg_map.keys())


def cached_groups() -> set[Any]:
    """Groups hp_core keeps on purpose across tests (created once per rank set)."""
    mesh_mod = sys.modules.get("hp_core.mesh")
    cached = getattr(mesh_mod, "cached_groups", None)
    if cached is None:
        return set()
    try:
        return set(cached())
    except Exception:
        return set()


def mark() -> GroupMark:
    """What :func:`release` compares with after the test."""
    return GroupMark(frozenset(live_groups()), c10d._world.group_count)


# [Note: group names across pooled tests]
# torch names a group it creates without an explicit name after a process-wide
# counter ("1", "2", ... after the default "0") and resolves names through a
# registry (``_resolve_process_group``). Its caches compare device meshes by
# ranks, layout and dimension names, not by group names: the sharding
# propagation cache, the redistribution planner and transform caches hand a
# later, equal mesh the spec of an earlier one, whose group names are then
# resolved. In a fresh process (torch's harness spawns one per test) none of
# that exists; in a pooled rank it survives the test. torch's own
# ``destroy_process_group()`` resets the counter, "to allow consistent value to
# be generated when we re-create process groups", and the pool, which keeps the
# default group, skipped exactly that: two identical tests that built a 2-D
# mesh got names 1 and 3, then 5 and 7, and the second resolved the first's
# cached "3" ("Could not resolve the process group registered under the name
# 3"). So after destroying the test's groups the counter goes back to where the
# test found it, past any group still alive on any rank (the pool takes the
# largest of the ranks' :func:`release` and every rank :func:`rewind` s to it
# before the next test), and the next test names its groups as a fresh
# process would: a cached mesh of an identical earlier test resolves
# to this test's groups over the same ranks. A later test that creates groups
# in another order would be handed a cached mesh whose names now mean other
# ranks; the worker clears torch's mesh-keyed caches whenever it rewinds
# ([Note: torch's mesh caches across pooled tests] in hp_testing._worker).
def release(before: GroupMark) -> int | None:
    """Destroy the groups made since ``before`` (hp_core's cached ones aside).

    Returns the counter value this rank's next test may name groups from (past
    any group still alive here), or None when the test made no group. The pool
    takes the largest over the ranks (a group alive on its members only is
    unknown to the others) and hands it to every rank with the next test, for
    :func:`rewind`: rewinding here, from this rank's view alone, let the ranks'
    counters drift apart and their next ``new_group`` wait for each other.
    """
    if not dist.is_initialized():
        return None  # the test destroyed the default group: the worker re-creates it from scratch
    made = live_groups() - before.groups - cached_groups()
    for group in made:
        if group is not dist.GroupMember.WORLD:
            with contextlib.suppress(Exception):
                dist.destroy_process_group(group)
    # Every rank counts every new_group, member or not.
    if c10d._world.group_count == before.count:
        return None
    numbered = [int(name) for name in c10d._world.pg_names.values() if str(name).isdigit()]
    return max([before.count, *(n + 1 for n in numbered)])


def rewind(count: int, key: str) -> None:
    """Name the next groups from ``count`` (the same on every rank), under store keys under ``key``."""
    if not dist.is_initialized():
        return
    c10d._world.group_count = count
    _fresh_keys_for_names(key)


_BASE_STORE: dict[Any, Any] = {}  # the default group -> the store it was created with


def _fresh_keys_for_names(key: str) -> None:
    """A group's rendezvous keys are its name under the default group's store: move that store on.

    A name used again under the same keys would meet the destroyed group's
    addresses (gloo waits for peers that are gone); torch's own reset comes with
    a new default group and a new store, the pool keeps both, so the store the
    next groups are made under gets a fresh prefix (every rank the same one).
    """
    world = dist.GroupMember.WORLD
    if world is None:
        return  # no default group (as in :func:`rewind`): no store to move on
    backend, store = c10d._world.pg_map[world]
    if world not in _BASE_STORE:
        _BASE_STORE.clear()  # a re-created default group: the old one's store is gone
        _BASE_STORE[world] = store
    prefixed = dist.PrefixStore(f"hp-names/{key}/", _BASE_STORE[world])
    c10d._world.pg_map[world] = (backend, prefixed)
