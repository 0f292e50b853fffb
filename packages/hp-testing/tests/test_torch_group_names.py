"""Tests that build torch process groups one after another on the same pooled ranks.

Regression for "Could not resolve the process group registered under the name 3":
two identical 4-rank tests that run torch's ``fully_shard`` on a 2-D mesh and
``clip_grad_norm_``; the second used to fail because torch's caches handed it the
first test's mesh, whose groups the pool had destroyed ([Note: group names across
pooled tests] in ``hp_testing._test_groups``). Each test runs its tasks on one
pool directly, so their order and their ranks are fixed.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hp_testing import WorkerPool
from hp_testing._worker import Task

BODY = """
import copy

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

NAMES = []  # this rank's mesh group names, test after test (the module stays loaded in the rank)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).double()


def fsdp_step(rank):
    reference = _model()
    model = copy.deepcopy(reference)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    NAMES.append([mesh.get_group(d).group_name for d in range(2)])
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    x = torch.arange(24, dtype=torch.float64).reshape(3, 8) / 10
    model(x).square().sum().backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # a cached DTensor reduction
    reference(x).square().sum().backward()
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
    torch.testing.assert_close(norm.full_tensor(), expected, rtol=1e-12, atol=1e-12)
    for ours, theirs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(ours.grad.full_tensor(), theirs.grad, rtol=1e-12, atol=1e-12)


def hp_mesh_keeps_its_groups(rank):
    import hp_core

    mesh = hp_core.init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))  # cached: kept alive
    t = torch.ones(1)
    dist.all_reduce(t, group=mesh.get_group("a"))  # a group only its two members know
    assert t.item() == 2.0


def dtensor_add(rank):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    full = torch.arange(16.0).reshape(8, 2)
    y = distribute_tensor(full, mesh, [Shard(0), Replicate()]) + 1  # its sharding is cached
    # the output lives on this test's mesh, not on an equal mesh of an earlier test
    assert [y.device_mesh.get_group(d).group_name for d in range(2)] == [
        mesh.get_group(d).group_name for d in range(2)
    ]
    torch.testing.assert_close(y.full_tensor(), full + 1)


def another_group_then_dtensor_add(rank):
    other = dist.new_group([0, 1, 2, 3])  # shifts the names the mesh's groups get
    t = torch.ones(1)
    dist.all_reduce(t, group=other)
    assert t.item() == 4.0
    dtensor_add(rank)


def same_names_as_a_fresh_process(rank):
    assert len(NAMES) >= 2 and all(names == NAMES[0] for names in NAMES[:2]), NAMES
"""


def _task(body: Path, name: str) -> Task:
    return Task(
        nodeid=f"group_names_body.py::{name}",
        module_name="group_names_body",
        module_file=str(body),
        class_name=None,
        function_name=name,
        kwargs={"rank": None},
        sys_path=[str(body.parent), *sys.path],
    )


@pytest.fixture
def pool_of_4():
    pool = WorkerPool(4)
    try:
        yield pool
    finally:
        pool.shutdown()


def _run(pool: WorkerPool, body: Path, name: str) -> None:
    outcome = pool.run(_task(body, name), timeout_s=60.0)
    errors = "\n".join(r.error for r in outcome.results.values() if r.error)
    assert outcome.ok, f"{name}: {errors or outcome}"


def test_identical_fsdp_tests_on_one_pool_both_pass_and_name_groups_alike(
    pool_of_4: WorkerPool, tmp_path: Path
) -> None:
    body = tmp_path / "group_names_body.py"
    body.write_text(BODY)
    _run(pool_of_4, body, "fsdp_step")
    _run(pool_of_4, body, "fsdp_step")  # failed: "Could not resolve ... under the name 3"
    _run(pool_of_4, body, "same_names_as_a_fresh_process")  # as torch's harness, a process per test
    # Groups that outlive a test on their members only: every rank still names the next ones alike.
    _run(pool_of_4, body, "hp_mesh_keeps_its_groups")
    _run(pool_of_4, body, "fsdp_step")
    _run(pool_of_4, body, "fsdp_step")
    assert pool_of_4.reinits == 0 and pool_of_4.restarts == 0


def test_a_test_that_shifts_group_names_gets_its_own_mesh_from_torchs_caches(
    pool_of_4: WorkerPool, tmp_path: Path
) -> None:
    # [Note: torch's mesh caches across pooled tests] in hp_testing._worker: the second test's
    # cached DTensor output was placed on the first test's mesh, whose group names no longer
    # existed ("Could not resolve the process group registered under the name 3").
    body = tmp_path / "group_names_body.py"
    body.write_text(BODY)
    _run(pool_of_4, body, "dtensor_add")
    _run(pool_of_4, body, "another_group_then_dtensor_add")
    _run(pool_of_4, body, "dtensor_add")
    assert pool_of_4.reinits == 0 and pool_of_4.restarts == 0
