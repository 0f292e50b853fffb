"""A local rank's ``os.environ`` is its own, as a process's is: torchrun's variables and its own writes.

Code reads ``RANK`` / ``LOCAL_RANK`` / ``WORLD_SIZE`` from the environment and
sets variables itself, without ``monkeypatch`` (a script picks a device or a
port, a test saves and restores a variable). In local mode the ranks share one
process environment; each rank's is swapped in with the rest of its state.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from hp_testing.local import run_local

BOTH_MODES = [
    pytest.param("process", marks=pytest.mark.distributed(world_size=4, mode="process"), id="process"),
    pytest.param("local", marks=pytest.mark.distributed(world_size=4, mode="local"), id="local"),
]
PROBE = "HP_LOCAL_ENVIRON_PROBE"


def _set_then_all_reduce(rank: int, world_size: int) -> None:
    """Write the environment without monkeypatch, then block in a collective while the others write theirs."""
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"]) == (str(rank), str(world_size))
    assert os.getenv("LOCAL_RANK") == str(rank)
    os.environ[PROBE] = f"rank {rank}"
    os.environ["LOCAL_RANK"] = str(world_size - 1 - rank)  # a script remapping its device
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    assert total.item() == sum(range(world_size))
    assert os.environ[PROBE] == f"rank {rank}"
    assert os.environ["LOCAL_RANK"] == str(world_size - 1 - rank) and os.environ["RANK"] == str(rank)
    # a test's save-and-restore of the environment around a collective restores this rank's own
    with mock.patch.dict(os.environ, {PROBE: f"patched by {rank}"}):
        dist.all_reduce(total)
        assert os.environ[PROBE] == f"patched by {rank}"
    assert os.environ[PROBE] == f"rank {rank}"


@pytest.mark.parametrize("mode", BOTH_MODES)
def test_a_ranks_own_environment_writes_stay_its_own(mode: str, rank: int, world_size: int) -> None:
    try:
        _set_then_all_reduce(rank, world_size)
    finally:  # a pooled process runs later tests: put its environment back
        os.environ.pop(PROBE, None)
        os.environ["LOCAL_RANK"] = str(rank)


def test_the_ranks_environments_stay_out_of_the_launching_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HP_LOCAL_ENVIRON_HOST", "host")
    before = dict(os.environ)

    def body(rank: int) -> str | None:
        if rank == 0:
            del os.environ["HP_LOCAL_ENVIRON_HOST"]  # gone for rank 0 only
        _set_then_all_reduce(rank, 2)
        return os.environ.get("HP_LOCAL_ENVIRON_HOST")

    assert run_local(body, 2) == [None, "host"]
    assert dict(os.environ) == before


@pytest.mark.parametrize("mode", BOTH_MODES)
def test_a_ranks_monkeypatched_cwd_and_sys_path_are_its_own(
    mode: str, rank: int, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    mine = tmp_path / f"rank{rank}"
    mine.mkdir()
    monkeypatch.chdir(mine)
    monkeypatch.syspath_prepend(str(mine))
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)  # every other rank moved to its own folder meanwhile
    Path("written.txt").write_text(f"rank {rank}")  # a relative path: this rank's folder
    assert (mine / "written.txt").read_text() == f"rank {rank}" and Path.cwd() == mine
    assert sys.path[0] == str(mine) and not any(
        entry.startswith(str(tmp_path / "rank")) for entry in sys.path[1:]
    )
    monkeypatch.undo()
    assert Path.cwd() != mine and str(mine) not in sys.path
