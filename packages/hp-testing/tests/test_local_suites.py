"""Local mode runs hp's own suites unchanged: regressions found running them under HP_TEST_MODE=local.

Each test here is a pattern taken from a package's suite that failed in local
mode, written as the suite writes it, and runs in both modes so the body
stays a faithful multi-process test.
"""

from __future__ import annotations

import os
import warnings
from unittest import mock

import pytest
import torch
import torch.distributed as dist

BOTH_MODES = [
    pytest.param("process", marks=pytest.mark.distributed(world_size=4, mode="process"), id="process"),
    pytest.param("local", marks=pytest.mark.distributed(world_size=4, mode="local"), id="local"),
]


def _agree_then_warn(rank: int) -> torch.Tensor:
    """A call that communicates, then warns (as ``fully_shard`` checks its arguments across ranks)."""
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    warnings.warn(f"rank {rank} saw a total of {int(total.item())}", UserWarning, stacklevel=2)
    return total


@pytest.mark.parametrize("mode", BOTH_MODES)
def test_pytest_warns_around_a_collective_sees_the_ranks_own_warning(
    mode: str, rank: int, world_size: int
) -> None:
    # hp-fsdp's test_reshard_groups.py::test_int_values_that_mean_true_or_false: every rank
    # enters pytest.warns, blocks in a collective inside it and warns after.
    with pytest.warns(UserWarning) as seen:
        total = _agree_then_warn(rank)
    assert total.item() == sum(range(world_size))
    texts = [str(w.message) for w in seen]
    assert texts == [f"rank {rank} saw a total of {sum(range(world_size))}"]


@pytest.mark.parametrize("mode", BOTH_MODES)
def test_a_ranks_warning_filters_are_its_own(mode: str, rank: int) -> None:
    # One rank turns warnings into errors for a block; the others, blocked in the same
    # collective meanwhile, still only record theirs.
    if rank == 0:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(UserWarning, match="rank 0 saw"):
                _agree_then_warn(rank)
    else:
        with pytest.warns(UserWarning, match=f"rank {rank} saw"):
            _agree_then_warn(rank)


@pytest.mark.parametrize("mode", BOTH_MODES)
def test_a_ranks_monkeypatch_is_its_own(mode: str, rank: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # hp-core's test_mesh.py::test_2x2_concatenate_and_permute: a rank patches torch.distributed
    # after a call that communicates, while the other ranks are still inside that call.
    group = dist.new_group([0, 1, 2, 3])  # rank 0 gets here again only after patching

    def no_new_group(*args: object, **kwargs: object) -> None:
        raise AssertionError("this rank's patch")

    monkeypatch.setattr(dist, "new_group", no_new_group)
    monkeypatch.setenv("HP_LOCAL_SUITES_PROBE", str(rank))
    total = torch.tensor([1.0])
    dist.all_reduce(total, group=group)  # every rank patched its own world meanwhile
    assert total.item() == 4.0 and dist.new_group is no_new_group
    assert os.environ["HP_LOCAL_SUITES_PROBE"] == str(rank)
    monkeypatch.undo()
    assert dist.new_group is not no_new_group and "HP_LOCAL_SUITES_PROBE" not in os.environ


@pytest.mark.parametrize("mode", BOTH_MODES)
def test_a_ranks_mock_patch_of_torch_distributed_is_its_own(mode: str, rank: int) -> None:
    # hp-core's test_mesh_from_torch.py: every rank patches dist.new_group for a block that
    # communicates; interleaved in one process, each block saved another rank's patch as the
    # original and the patch outlived them all.
    real = dist.new_group

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("this rank's patch")

    with mock.patch.object(dist, "new_group", refuse):
        total = torch.tensor([1.0])
        dist.all_reduce(total)
        assert total.item() == 4.0 and dist.new_group is refuse
    assert dist.new_group is real
    dist.barrier()  # every rank's block has ended: the function is still the real one
    assert dist.new_group is real
    dist.new_group([0, 1, 2, 3])
