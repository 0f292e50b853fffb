"""``reshard_after_forward=N``: after forward, keep the parameters sharded over groups of N ranks.

An int ``N`` dividing the shard dim's ``S`` ranks: each rank keeps ``1/N``
of the gathered unit after forward, so backward all-gathers over its group of
``N`` consecutive ranks only (on a cluster, one node's fast links). What is
kept, how the groups are built and which values are valid: [Note: reshard to
groups of N ranks] below.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

from hp_core import DeviceMesh
from hp_core.distributed import get_world_size

__all__ = [
    "PostForwardMesh",
    "build_post_forward_mesh",
    "check_reshard_after_forward",
    "group_sizes",
    "resolve",
]


# [Note: reshard to groups of N ranks]
# With ``reshard_after_forward=True`` a unit frees its gathered parameters
# after forward and gathers them again over the whole shard group (``S`` ranks)
# for backward. With an int ``N`` (FSDP2's third form) each rank instead keeps
# ``1/N`` of the gathered buffer after forward, so backward's all-gather runs
# over ``N`` ranks only: on a real cluster ``N`` is the ranks of one node, and
# the backward gather stays on the fast intra-node links. The price is memory:
# ``S/N`` shards per rank between forward and backward instead of one.
#
# The ranks are split like FSDP2's ``mesh.view(-1, N)``: the shard line of
# ``S`` ranks is cut into ``S/N`` groups of ``N`` consecutive ranks, and every
# group holds the whole unit. The gathered buffer of a parameter is ``S``
# padded chunks, rank-major ([Note: padded shards] in :mod:`hp_fsdp.param`);
# rank ``j`` of a group keeps chunks ``j*S/N`` to ``(j+1)*S/N - 1``, one
# contiguous slice. Gathering those ``N`` slices over the group rebuilds the
# same buffer in the same order, so the backward gather reuses the forward's
# copy-out unchanged, with ``N`` in place of ``S``. Each rank's input to
# that gather is ``S/N`` chunks instead of one, and its output (the payload)
# is the unit's whole padded size, as in forward; what is smaller is the
# traffic per rank, ``(N-1)/N`` of the payload instead of ``(S-1)/S``, and the
# links it crosses (the group only).
#
# Values: ``N`` must divide ``S``; ``N == S`` is ``True`` (every rank keeps
# its own chunk, which is the shard) and ``N == 1`` is ``False`` (a rank keeps
# all chunks: nothing is freed), with a warning that ``1`` is not ``True``, as
# in FSDP2. The pieces serve the backward of the forward that kept them: a
# forward run without grad (evaluation, or the first forward of reentrant
# checkpointing) reshards fully, since no backward will come, and every full
# reshard (after backward, by the root at the end of the iteration,
# ``reshard()``, ``model.to(...)``) drops them.
#
# The groups are new process groups. hp_core creates a group collectively
# over the default group, every rank for every group in the same order
# ([Note: group cache] in :mod:`hp_core.mesh`), and caches it by its ranks, so
# each rank builds every group's 1-D mesh from the mesh's rank table, which is
# the same on every rank only when the mesh spans the whole world. A slice of
# a larger mesh (``mesh["dp"]`` beside ``tp`` or ``pp``) shows each rank only
# its own line: that case is refused for now (see
# :func:`check_reshard_after_forward`), unless ``N`` is 1
# or ``S``, which need no group.


@dataclass(frozen=True)
class PostForwardMesh:
    """This rank's group of ``size`` ranks that holds a unit between forward and backward."""

    group: Any  # the process group of ``ranks``
    size: int
    rank: int  # this rank's index in ``ranks``, also its rank in ``group``
    ranks: tuple[int, ...]  # global ranks


def group_sizes(shard_size: int) -> list[int]:
    """The valid ints for ``reshard_after_forward`` on a shard dim of ``shard_size`` ranks: its divisors."""
    return [n for n in range(1, shard_size + 1) if shard_size % n == 0]


def check_reshard_after_forward(what: str, value: Any, mesh: DeviceMesh | None = None) -> None:
    """``reshard_after_forward`` is True, False, None or a group size; refuse anything else up front.

    An int ``N`` is FSDP2's "reshard to groups of N ranks" ([Note: reshard to
    groups of N ranks]): it must divide the
    ranks of ``mesh``'s shard dim (checked when ``mesh`` is given). ``1`` is
    accepted as FSDP2 does, with a warning, since it means False.
    """
    if value is None or isinstance(value, bool):
        return
    if not isinstance(value, int):
        raise TypeError(
            f"{what}: reshard_after_forward={value!r} is a {type(value).__name__}; pass True, False, None "
            "(None: True for every unit but the root) or an int N (reshard to groups of N ranks)."
        )
    if mesh is None:
        if value < 1:
            raise ValueError(
                f"{what}: reshard_after_forward={value} is an int, which means a group size (reshard to "
                "groups of N ranks after forward) and must be at least 1; pass False to keep the parameters "
                "gathered after forward, True to free them."
            )
        return
    size = mesh.size(mesh.ndim - 1)
    valid = group_sizes(size)
    if value not in valid:
        kind = "must be at least 1" if value < 1 else f"must divide the {size} ranks of the mesh's shard dim"
        raise ValueError(
            f"{what}: reshard_after_forward={value} is an int, which means a group size (after forward each "
            f"group of N ranks keeps the parameters sharded among itself), and it {kind} (mesh "
            f"{tuple(mesh.shape)}). Pass one of {valid} ({size}: like True; 1: like False), or True / False."
        )
    if 1 < value < size and mesh.size() != get_world_size():
        raise NotImplementedError(
            f"{what}: reshard_after_forward={value} needs new process groups of {value} ranks, which hp_fsdp "
            f"builds from the mesh's ranks; this mesh {mesh!r} spans {mesh.size()} of the {get_world_size()} "
            "ranks (a slice beside 'tp' or 'pp'), and each rank sees only its own line. "
            f"Pass a mesh over all ranks, or reshard_after_forward in (True, False, 1, {size})."
        )
    if value == 1:
        warnings.warn(
            f"{what}: reshard_after_forward=1 (an int) means groups of 1 rank: every rank keeps the whole "
            "gathered parameters after forward, like False. Pass False to say so, or True to free them.",
            UserWarning,
            stacklevel=3,
        )


def resolve(value: bool | int, shard_size: int) -> tuple[bool, int | None]:
    """Whether to reshard after forward, and the group size when it is a strict divisor of ``shard_size``.

    ``value`` was validated already (``check_reshard_after_forward``): an
    int here divides ``shard_size``. ``1`` and ``shard_size`` are ``False``
    and ``True`` (see [Note: reshard to groups of N ranks]).
    """
    if isinstance(value, bool):
        return value, None
    if value == 1:
        return False, None
    if value == shard_size:
        return True, None
    return True, value


def build_post_forward_mesh(mesh: DeviceMesh, size: int) -> PostForwardMesh:
    """The group of ``size`` consecutive ranks along ``mesh``'s shard dim that holds this rank.

    Every rank builds the 1-D mesh of every group, in the same order, so
    hp_core's cache creates each group once, collectively; a second unit
    with the same mesh and size only looks them up. ``mesh`` must span the
    world (its rank table is then the same on every rank; see [Note:
    reshard to groups of N ranks]).
    """
    me = mesh.get_rank()
    rows = mesh.mesh.reshape(-1, size).tolist()  # the last dim is the shard dim: rows stay inside it
    mine: DeviceMesh | None = None
    ranks: tuple[int, ...] = ()
    for row in rows:
        line = DeviceMesh(mesh.device_type, row)
        if me in row:
            mine, ranks = line, tuple(row)
    if mine is None:  # pragma: no cover - fully_shard only runs on members of its mesh
        raise RuntimeError(f"rank {me} is not in the mesh {mesh!r}; fully_shard runs on its mesh's ranks.")
    return PostForwardMesh(mine.get_group(), size, mine.get_local_rank(), ranks)
