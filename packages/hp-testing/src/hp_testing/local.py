"""Local mode: every rank of a world in this process, for world sizes a laptop cannot fork.

``run_local(fn, world_size)`` runs ``fn(rank)`` once per rank, each rank a
thread with its own default process group over the in-memory ``hplocal``
backend and its own copy of the process state a rank owns (see
[Note: one process, many ranks' state] and [Note: cooperative ranks]). The
marker's ``mode="local"`` and ``hp-run --local`` are built on it.

Why threads: [Note: threads rather than LocalTensor] (above :func:`run_local`);
what it refuses: [Note: what local mode leaves to processes].
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

from hp_testing._local_backend import BACKEND, register
from hp_testing._local_contract import report_unmatched
from hp_testing._local_emulation import emulated
from hp_testing._local_profiler import refusing_profilers
from hp_testing._local_state import Slots
from hp_testing._local_world import LocalHangError, RankOutcome, World

__all__ = [
    "BACKEND",
    "ConcurrencyNeededError",
    "LocalHangError",
    "LocalModeFailed",
    "RankOutcome",
    "run_local",
    "run_local_outcomes",
]

# Imported before the ranks copy their state, so each rank starts from the state an import leaves.
_HP_MODULES = ("hp_core", "hp_testing.collectives", "hp_dtensor", "hp_fsdp", "hp_pipeline")


# [Note: what local mode leaves to processes]
# Local mode cannot do what needs ranks that run at the same time: async hazards
# (a touch of a pending collective's buffer is only a race when the collective
# runs concurrently), fault injection (killing or stalling a process) and
# timeouts; nor what torch keeps once per process, as its profiler
# ([Note: torch's profiler in local mode] in :mod:`hp_testing._local_profiler`).
# Those stay with the multi-process mode, and asking for them here raises
# :class:`ConcurrencyNeededError`.
class ConcurrencyNeededError(RuntimeError):
    """A feature that needs ranks running at the same time, or a process each, was asked for in local mode."""


class LocalModeFailed(RuntimeError):
    """At least one rank of :func:`run_local` raised; the message holds every failing rank's traceback."""

    def __init__(self, message: str, outcomes: list[RankOutcome]) -> None:
        super().__init__(message)
        self.outcomes = outcomes


def refuse_concurrency(feature: str, process_mode: str) -> None:
    """Raise :class:`ConcurrencyNeededError` naming ``feature`` and how to get the multi-process mode."""
    raise ConcurrencyNeededError(
        f"{feature} needs ranks that run at the same time, and local mode runs them one at a time in "
        f"one process; use the multi-process mode instead: {process_mode}"
    )


def _torchrun_env(world_size: int) -> Callable[[int], dict[str, str]]:
    """The variables ``hp-run`` gives a rank (torchrun's names), without the rest of the environment."""
    from hp_testing.launcher import rank_env

    def env(rank: int) -> dict[str, str]:
        return {
            key: value
            for key, value in rank_env(rank, world_size, 0, base={}).items()
            if key != "OMP_NUM_THREADS"
        }

    return env


def _import_state_modules(packages: Sequence[str]) -> None:
    """Import hp's packages (those installed) and the caller's before the ranks copy their globals."""
    importlib.import_module("hp_core")  # needed here: the backend semantics seam
    for name in (*_HP_MODULES, *packages):
        if importlib.util.find_spec(name) is not None:
            importlib.import_module(name)


def run_local_outcomes(
    fn: Callable[[int], Any],
    world_size: int,
    *,
    state_packages: Sequence[str] = (),
    emulate: str | None = None,
) -> list[RankOutcome]:
    """Run ``fn(rank)`` on ``world_size`` local ranks; every rank's outcome, failures included.

    Each rank's default group is initialised (backend ``hplocal``) before
    ``fn`` runs, so ``hp_core.init_distributed()`` is a no-op there.
    ``state_packages`` names your own top-level packages whose module globals
    hold per-process state (a cache of groups, a rank): each rank then gets
    its own copy, as hp's packages do (see [Note: one process, many ranks' state]).
    ``emulate="nccl"`` / ``"hccl"`` applies that backend's contract as
    ``backend="nccl-emu"`` / ``"hccl-emu"`` does in the multi-process mode,
    but for the checks that need concurrency (see :mod:`hp_testing._local_emulation`).
    """
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"run_local: world_size must be an int >= 1, got {world_size!r}")
    if dist.is_initialized():
        raise RuntimeError(
            "run_local: this process already has a default process group (it is a rank itself, e.g. under "
            "torchrun); local mode simulates a whole world and needs a process without one. Run it "
            "from plain pytest or python."
        )
    register()
    _import_state_modules(state_packages)
    from hp_core import set_backend_semantics

    def body(rank: int) -> Any:
        dist.init_process_group(BACKEND, store=dist.HashStore(), rank=rank, world_size=world_size)
        return fn(rank)

    with emulated(emulate) as profile, refusing_profilers():
        # hp_core judges the ranks' groups as the profile's backend (gloo unless emulating)
        previous = set_backend_semantics(BACKEND, profile.backend)
        world = World(world_size, Slots(state_packages), p2p_tags=profile.p2p_tags)
        isolate = _thread_isolation(True)
        try:
            outcomes = world.run(body, _torchrun_env(world_size))
            # a send never received or a receive never sent: the process mode's end-of-test check
            report_unmatched(world, outcomes)
            return outcomes
        finally:
            _thread_isolation(isolate)
            set_backend_semantics(BACKEND, previous)


# [Note: threads rather than LocalTensor]
# Why threads and not torch's ``LocalTensor``: ``LocalTensorMode`` runs the
# program once over tensors that hold every rank's value, so a rank's Python
# control flow (``if rank == 0``, a shard size computed from the mesh
# coordinate, a pipeline stage per rank) must become symbolic per-rank ints,
# and only torch's own ``DeviceMesh`` methods are patched to produce them.
# hp's packages compute with plain ints from their own mesh, and a test body
# written for the multi-process harness branches on ``rank``; running each rank
# as its own thread runs that code unchanged, the same body in both modes.
def run_local(
    fn: Callable[[int], Any],
    world_size: int,
    *,
    state_packages: Sequence[str] = (),
    emulate: str | None = None,
) -> list[Any]:
    """``[fn(0), ..., fn(world_size - 1)]``, each run as its own rank; raises if any rank raised."""
    outcomes = run_local_outcomes(fn, world_size, state_packages=state_packages, emulate=emulate)
    failed = [o for o in outcomes if not o.ok]
    if failed:
        parts = [f"{'-' * 20} rank {o.rank} failed {'-' * 20}\n{o.error.rstrip()}" for o in failed]
        raise LocalModeFailed(
            f"run_local: rank(s) {[o.rank for o in failed]} of {world_size} failed\n" + "\n".join(parts),
            outcomes,
        )
    return [o.value for o in outcomes]


def _thread_isolation(on: bool) -> bool:
    """Give each thread its own c10d group-name registry (every rank names its groups alike)."""
    from torch._C import _distributed_c10d as c10d_ext

    c10d_ext._set_thread_isolation_mode(on)  # type: ignore[attr-defined]
    return False
