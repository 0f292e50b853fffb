"""Start and stop the default process group, the same way under torchrun, hp-run and the test harness.

torchrun (and ``hp-run``) export ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR`` and ``MASTER_PORT``; :func:`init_distributed` reads them
through torch's ``env://`` rendezvous. The test harness initialises the
default group itself before running a test body, so :func:`init_distributed`
is a no-op when a default group exists: a training script that calls it runs
unchanged under torchrun, hp-run and pytest.
"""

from __future__ import annotations

import datetime
import os
import weakref
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

# Imported before any group exists, on purpose: this module binds ``group.WORLD`` into its
# functions' defaults when first imported (the first torch.optim optimizer imports it, through
# torch._dynamo). Imported after init, those defaults keep the default group alive past
# ``destroy_process_group()``, and gloo's worker threads with it, into interpreter exit, where a
# worker releasing its last work aborts the process ("terminate called without an active exception").
import torch.distributed.nn.functional  # noqa: F401
from torch.distributed import distributed_c10d as _c10d

from hp_core import mesh as _mesh_module
from hp_core.device import local_rank_from_env
from hp_core.mesh import clear_group_cache
from hp_core.platform import get_platform

if TYPE_CHECKING:
    from hp_core.mesh import DeviceMesh

__all__ = [
    "destroy_distributed",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "group_epoch",
    "init_distributed",
    "is_initialized",
    "mesh_group",
]

_REQUIRED_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def is_initialized() -> bool:
    """Whether the default process group exists."""
    return dist.is_available() and dist.is_initialized()


def _env_int(name: str) -> int:
    raw = os.environ[name]
    try:
        return int(raw)
    except ValueError:
        raise ValueError(
            f"{name}={raw!r} is not an integer; torchrun sets it to a non-negative integer."
        ) from None


def init_distributed(backend: str | None = None, *, timeout: datetime.timedelta | None = None) -> None:
    """Initialise the default process group from the environment (env://); no-op if it exists.

    ``backend`` defaults to the platform's (see :func:`hp_core.get_platform`):
    nccl on CUDA, hccl on Ascend, xccl on XPU, gloo on CPU. On an accelerator
    the ``LOCAL_RANK`` device is made current first, so each process drives
    its own device.
    """
    if backend is not None and (not isinstance(backend, str) or not backend):
        raise ValueError(f"init_distributed: backend must be a non-empty string or None, got {backend!r}.")
    if timeout is not None and not isinstance(timeout, datetime.timedelta):
        raise TypeError(
            f"init_distributed: timeout must be a datetime.timedelta, got {type(timeout).__name__} "
            f"({timeout!r}); e.g. datetime.timedelta(minutes=5)."
        )
    if not dist.is_available():
        raise RuntimeError("init_distributed: this torch build has no torch.distributed support.")
    if dist.is_initialized():
        return
    missing = [name for name in _REQUIRED_ENV if not os.environ.get(name)]
    if missing:
        raise RuntimeError(
            f"init_distributed: environment variable(s) {missing} are not set, so env:// cannot find its "
            "peers. Start the script with `torchrun --nproc-per-node N script.py` or "
            "`hp-run -n N script.py`, or export RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT yourself."
        )
    rank, world_size = _env_int("RANK"), _env_int("WORLD_SIZE")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(
            f"init_distributed: RANK={rank} and WORLD_SIZE={world_size} are inconsistent; "
            "need WORLD_SIZE >= 1 and 0 <= RANK < WORLD_SIZE."
        )
    platform = get_platform()
    if platform.handle.is_accelerator:
        platform.handle.set_device()
    chosen = backend if backend is not None else platform.backend
    if timeout is None:
        dist.init_process_group(backend=chosen, init_method="env://")
    else:
        dist.init_process_group(backend=chosen, init_method="env://", timeout=timeout)


def destroy_distributed() -> None:
    """Release every cached group, then the default group; safe to call when nothing is initialised."""
    clear_group_cache()
    _MESH_GROUPS.clear()
    if is_initialized():
        dist.destroy_process_group()


def get_rank(group: dist.ProcessGroup | None = None) -> int:
    """This process's rank in ``group`` (default: global).

    Before initialisation the global rank is read from ``RANK`` (0 if unset),
    so logging and file naming work before the group exists.
    """
    if is_initialized():
        return dist.get_rank(group)
    if group is not None:
        raise RuntimeError(
            "get_rank(group): the default process group is not initialised; call init_distributed() first."
        )
    return int(os.environ.get("RANK") or 0)


def get_world_size(group: dist.ProcessGroup | None = None) -> int:
    """Number of ranks in ``group`` (default: all); ``WORLD_SIZE`` (or 1) before initialisation."""
    if is_initialized():
        return dist.get_world_size(group)
    if group is not None:
        raise RuntimeError(
            "get_world_size(group): the default process group is not initialised; "
            "call init_distributed() first."
        )
    return int(os.environ.get("WORLD_SIZE") or 1)


def get_local_rank() -> int:
    """This process's index on its node (``LOCAL_RANK``, 0 if unset)."""
    return local_rank_from_env()


# -- cheap group freshness (see [Note: group epoch]) ------------------------------------------


# [Note: group epoch]
# ``DeviceMesh.get_group`` checks on every call that the mesh's groups are still
# alive (no ``clear_group_cache()``, default group not destroyed or re-created):
# right, but it costs about as much as a small op's whole dispatch, and
# hp-dtensor asks for a group before every collective. :func:`group_epoch`
# answers the same question for *all* groups at once with two reads: the
# mesh module's cache generation (bumped by ``clear_group_cache()``, which
# ``destroy_distributed()`` and the test harness call) and the identity of the
# default group (a destroyed and re-created default group is a new object, even
# when it was replaced behind our back with ``dist.destroy_process_group()``).
# :func:`mesh_group` memoises ``get_group`` per (mesh, dim) next to the epoch it
# was obtained in; when the epoch moved it asks ``get_group`` again, which then
# raises :class:`~hp_core.mesh.StaleMeshError` or returns the live group. So the
# memo is never more permissive than ``get_group`` itself.
def group_epoch() -> tuple[int, Any]:
    """A value that changes whenever process groups handed out earlier may be dead.

    Equal epochs mean: no ``clear_group_cache()`` ran and the default group is
    the same object, so a group that ``DeviceMesh.get_group`` returned in that
    epoch is still the one it would return now. Two attribute reads; meant for
    hot paths that cache groups (see :func:`mesh_group`).
    """
    # _world.default_pg is what dist.group.WORLD's property returns, minus the property call.
    return (_mesh_module._generation, _c10d._world.default_pg)


# (id(mesh), dim) -> (weak mesh, epoch, weak group). Weak, because the mesh module's group cache
# must stay the only owner of groups (see [Note: group cache] in hp_core.mesh): a memo that kept
# them alive would defeat clear_group_cache(). The mesh is compared on a hit, so a reused id of a
# collected mesh never matches.
_MESH_GROUPS: dict[tuple[int, Any], tuple[weakref.ref[Any], tuple[int, Any], weakref.ref[Any]]] = {}
_MAX_MESH_GROUPS = 4096


def mesh_group(mesh: DeviceMesh, dim: int | str | None = None) -> dist.ProcessGroup:
    """``mesh.get_group(dim)``, memoised per (mesh, dim) and re-checked with :func:`group_epoch`.

    Same result and same errors as ``get_group`` (a stale mesh raises
    :class:`~hp_core.mesh.StaleMeshError`), at the cost of one dict lookup and
    one epoch comparison when nothing changed. Use it where a group is looked
    up per collective (redistribution, sharded ops).
    """
    key = (id(mesh), dim)
    entry = _MESH_GROUPS.get(key)
    if entry is not None and entry[0]() is mesh and entry[1] == group_epoch():
        group = entry[2]()
        if group is not None:
            return group
    group = mesh.get_group(dim)  # validates dim, membership and freshness; raises if stale
    if len(_MESH_GROUPS) >= _MAX_MESH_GROUPS:
        _MESH_GROUPS.clear()
    _MESH_GROUPS[key] = (weakref.ref(mesh), group_epoch(), weakref.ref(group))
    return group
