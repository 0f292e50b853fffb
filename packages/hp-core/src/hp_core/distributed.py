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

import torch.distributed as dist

from hp_core.device import local_rank_from_env
from hp_core.mesh import clear_group_cache
from hp_core.platform import get_platform

__all__ = [
    "destroy_distributed",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "is_initialized",
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
