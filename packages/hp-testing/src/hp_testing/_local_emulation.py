"""The backend's contract on every rank of a local world: gloo's, or NCCL's / HCCL's under ``emulate``.

The emulation layer is installed in the process for the run and every rank's
calls go through it; the side channel is left off, since the in-memory backend
sees every rank's side of a call at once. Why, and what stays with the
multi-process mode: [Note: the emulation in local mode] (above :func:`emulated`).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist

from hp_testing import _p2p_notes
from hp_testing._local_backend import BACKEND
from hp_testing.profiles import Profile

__all__ = ["EMULATE", "emulated"]

EMULATE = {"nccl": "nccl-emu", "hccl": "hccl-emu"}
_GROUP_FACTORIES = ("new_group", "new_subgroups")
_NAMED_BACKENDS = ("gloo", "nccl", "hccl")


def _local_backend(factory: Callable[..., Any]) -> Callable[..., Any]:
    """``new_group(..., backend="nccl")`` (the platform's backend, asked for by name) in a local world."""
    signature = inspect.signature(factory)

    @functools.wraps(factory)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        backend = bound.arguments.get("backend")
        if isinstance(backend, str) and backend.lower() in _NAMED_BACKENDS:
            bound.arguments["backend"] = BACKEND
        return factory(*bound.args, **bound.kwargs)

    return wrapper


# [Note: the emulation in local mode]
# The multi-process mode checks a rank's calls in three places: the profile's
# rules on the calling rank (contiguity, reduce ops, dtypes, ``recv`` without
# ``src``, ``monitored_barrier``), the side channel that compares the ranks'
# calls through the store, and the emulation of what gloo lacks (``premul_sum``,
# uneven ``all_gather``, fp8 moved as bytes). In local mode the first and the
# last are the same code: the emulation layer is installed in the process for
# the run (the ``gloo`` profile, or ``nccl-emu`` / ``hccl-emu`` under
# ``emulate="nccl"`` / ``"hccl"``), and every rank's calls go through it, so a
# non-contiguous buffer is refused as gloo would corrupt it, even though the
# in-memory backend would not. The side channel is left off:
# the in-memory backend already sees every rank's side of a collective or a
# message at once and compares them there (argument agreement, shapes and
# dtypes, group membership by the group's own ranks, p2p matching in issue
# order, hangs). The layer maps tags to 0 under NCCL / HCCL, so the backend
# matches messages in issue order as those backends do; the layer's wrappers
# leave the backend a note of each op (the user's tag, batch and line), from
# which it checks the rest of NCCL's / HCCL's p2p contract with the side
# channel's errors (:mod:`hp_testing._local_contract`): tags that differ, a
# pair's ops posted in opposite orders, and NCCL's first batch on a group.
#
# What stays with the multi-process mode is what needs concurrency or the
# store: async hazards (strict mode), faults, timeouts.
@contextmanager
def emulated(emulate: str | None) -> Iterator[Profile]:
    """The layer installed for the run, with gloo's profile or ``emulate``'s; yields the profile."""
    if emulate is not None and emulate not in EMULATE:
        raise ValueError(
            f"run_local: emulate must be None, 'nccl' or 'hccl', got {emulate!r} (the profiles of "
            "backend='nccl-emu' / 'hccl-emu' in the multi-process mode)"
        )
    from hp_testing.emulation import active_layer, install, uninstall

    present = active_layer()
    if present is not None:
        raise RuntimeError(
            "run_local: this process already runs under the emulation layer "
            f"(profile {present.profile.name!r}); start local mode from a plain python or pytest process"
        )
    layer = install("gloo" if emulate is None else EMULATE[emulate], checks=False)
    saved = {name: getattr(dist, name) for name in _GROUP_FACTORIES}
    for name, factory in saved.items():
        setattr(dist, name, _local_backend(factory))
    notes = _p2p_notes.enable(True)
    try:
        yield layer.profile
    finally:
        _p2p_notes.enable(notes)
        for name, factory in saved.items():
            setattr(dist, name, factory)
        uninstall()
