"""Collectives per step against FSDP2's figures, counted by patching hp_core's collectives.

For N wrapped blocks plus the root: forward N+1 all-gathers; backward N+1
reduce-scatters and N (default ``reshard_after_forward=None``: the root keeps
its parameters), N+1 (an explicit True, which applies to the root too as in
FSDP2, or the root told to reshard by the setter) or 0 (no resharding)
all-gathers; HSDP adds one all-reduce per unit when syncing.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from hp_fsdp_testlib import build, count_collectives, global_batch, loss_fn, shard_blocks

N = 3  # wrapped blocks


def _step(model: Any, rank: int, world: int, step: int) -> tuple[dict[str, int], dict[str, int], list[int]]:
    tokens, targets = global_batch(step, world)
    mine = slice(2 * rank, 2 * rank + 2)
    with count_collectives() as counter:
        loss = loss_fn(model, tokens[mine], targets[mine])
        forward = dict(counter.calls)
        gather_bytes = list(counter.gather_bytes)
        counter.reset()
        loss.backward()
        backward = dict(counter.calls)
    return forward, backward, gather_bytes


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("mode", ["default", "explicit_true", "root_reshards", "no_reshard"])
def test_fsdp_counts(rank: int, world_size: int, mode: str) -> None:
    model = build(n_blocks=N)
    kwargs = {"default": {}, "explicit_true": {"reshard_after_forward": True}, "root_reshards": {}}
    shard_blocks(model, **kwargs.get(mode, {"reshard_after_forward": False}))
    if mode == "root_reshards":
        model.set_reshard_after_forward(True, recurse=False)
    expected_backward_gathers = {
        "default": N,
        "explicit_true": N + 1,
        "root_reshards": N + 1,
        "no_reshard": 0,
    }[mode]
    for step in range(2):
        forward, backward, _ = _step(model, rank, world_size, step)
        assert forward == {"all_gather": N + 1, "reduce_scatter": 0, "all_reduce": 0}, (step, forward)
        assert backward == {
            "all_gather": expected_backward_gathers,
            "reduce_scatter": N + 1,
            "all_reduce": 0,
        }, (step, backward)
        model.zero_grad()


@pytest.mark.distributed(world_size=2)
def test_unfused_counts_one_per_param(rank: int, world_size: int) -> None:
    model = build(n_blocks=1)
    shard_blocks(model, comm_fusion=False)
    forward, backward, _ = _step(model, rank, world_size, 0)
    n_params = len(list(model.parameters()))
    assert forward["all_gather"] == n_params
    assert backward["reduce_scatter"] == n_params


@pytest.mark.distributed(world_size=4)
@pytest.mark.parametrize("all_reduce", [True, False])
def test_hsdp_counts(rank: int, world_size: int, device_mesh_factory: Any, all_reduce: bool) -> None:
    mesh = device_mesh_factory((2, 2), ("replicate", "shard"))
    model = build(n_blocks=N)
    shard_blocks(model, mesh=mesh)
    model.set_requires_all_reduce(all_reduce)
    forward, backward, _ = _step(model, rank, world_size, 0)
    assert forward == {"all_gather": N + 1, "reduce_scatter": 0, "all_reduce": 0}
    assert backward == {"all_gather": N, "reduce_scatter": N + 1, "all_reduce": (N + 1) if all_reduce else 0}


@pytest.mark.distributed(world_size=2)
def test_no_sync_communicates_nothing_in_backward(rank: int, world_size: int) -> None:
    model = build(n_blocks=N)
    shard_blocks(model)
    model.set_requires_gradient_sync(False)
    _, backward, _ = _step(model, rank, world_size, 0)
    assert backward["reduce_scatter"] == 0 and backward["all_reduce"] == 0
    assert all(p.grad is None for p in model.parameters())  # kept unreduced until a synced step


@pytest.mark.distributed(world_size=4)
def test_all_gather_bytes_near_lower_bound(rank: int, world_size: int) -> None:
    model = build(n_blocks=1)
    units = [list(model.blocks[0].parameters())]
    units.append([p for p in model.parameters() if all(p is not q for q in units[0])])
    elem = torch.empty((), dtype=torch.float64).element_size()
    expected_received = []
    for params in units:
        unit_bytes = sum(p.numel() for p in params) * elem
        padding = 0
        for p in params:
            rows = p.shape[0]
            per_rank = -(-rows // world_size)
            padding += (world_size * per_rank - rows) * (p.numel() // rows) * elem
        expected_received.append((world_size - 1) / world_size * (unit_bytes + padding))
    shard_blocks(model)
    _, _, gather_bytes = _step(model, rank, world_size, 0)
    # forward order: the root first, then the block
    received = [b * (world_size - 1) / world_size for b in gather_bytes]
    for got, want in zip(received, [expected_received[1], expected_received[0]], strict=True):
        assert abs(got - want) <= 0.01 * want, (got, want)
