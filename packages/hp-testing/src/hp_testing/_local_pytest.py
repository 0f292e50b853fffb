"""The marker's ``mode="local"``: a test body run on every rank of a local world, reported like the pool's.

The body, its fixtures and its report are the multi-process harness's:
``rank``, ``world_size`` and ``device_mesh_factory`` are each rank's own,
every other fixture reaches each rank as its own unpickled copy (as it would
cross the pool's pipe), and the outcome is the pool's :class:`Outcome`, so a
failure reads the same in both modes.
"""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import pytest

from hp_testing._local_patches import RankMonkeyPatch
from hp_testing._local_world import current
from hp_testing._worker import RANK_LOCAL_FIXTURES, TaskResult, _rank_local_value
from hp_testing.local import run_local_outcomes
from hp_testing.pool import Outcome

__all__ = ["MODES", "run_local_test"]

MODES = ("process", "local")


def run_local_test(item: pytest.Function, world_size: int, backend: str = "gloo") -> Outcome:
    """Run ``item``'s body on ``world_size`` local ranks; one :class:`TaskResult` per rank.

    ``backend`` is the marker's: ``"nccl-emu"`` / ``"hccl-emu"`` run it under
    ``emulate="nccl"`` / ``"hccl"`` (see :mod:`hp_testing._local_emulation`).
    """
    emulate = None if backend == "gloo" else backend.removesuffix("-emu")
    shared = {name: item.funcargs[name] for name in item._fixtureinfo.argnames}
    blobs = {name: pickle.dumps(value) for name, value in shared.items() if name not in RANK_LOCAL_FIXTURES}
    function = item.obj

    def body(rank: int) -> None:
        kwargs = {name: pickle.loads(blob) for name, blob in blobs.items()}
        patches = []
        for name in shared:
            if name == "monkeypatch":  # patches the process: in place only while this rank runs
                patch = kwargs[name] = RankMonkeyPatch()
                current()[0].states[rank].patches.append(patch)
                patches.append(patch)
            elif name in RANK_LOCAL_FIXTURES:
                kwargs[name] = _rank_local_value(name, SimpleNamespace(rank=rank, world_size=world_size))  # type: ignore[arg-type]
        try:
            function(**kwargs)
        finally:
            for patch in patches:
                patch.undo()

    outcome = Outcome(world_size)
    for ranked in run_local_outcomes(body, world_size, emulate=emulate):
        outcome.results[ranked.rank] = TaskResult(
            rank=ranked.rank, ok=ranked.ok, error=ranked.error, stdout=ranked.stdout, stderr=ranked.stderr
        )
    return outcome
