"""The public helpers for libraries built on DTensor: ``local_tensor``, ``new_dtensor``, ``chunk_sizes``.

[Note: reading the local tensor without autograd] in ``hp_dtensor.access`` says why they exist:
hp_fsdp reads and writes shards in place on every step and must not depend on DTensor's
private attributes.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hp_dtensor import DTensor, Replicate, Shard, chunk_sizes, distribute_tensor, local_tensor, new_dtensor
from hp_testing import record_collectives
from torch import nn


@pytest.mark.parametrize("parts", [1, 2, 3, 4, 5])
def test_chunk_sizes_are_torch_chunk_sizes(parts: int) -> None:
    for size in range(0, 12):
        expected = [c.shape[0] for c in torch.empty(size).chunk(parts)]
        got = chunk_sizes(size, parts)
        assert got[: len(expected)] == expected, (size, parts)
        assert got[len(expected) :] == [0] * (parts - len(expected)), (size, parts)  # padded with empty ranks
        assert sum(got) == size and len(got) == parts


def test_chunk_sizes_refuses_no_parts() -> None:
    with pytest.raises(ValueError, match="parts must be positive, got 0"):
        chunk_sizes(5, 0)


@pytest.mark.distributed(world_size=2)
def test_local_tensor_is_the_piece_itself(rank: int, world_size: int, device_mesh_factory: Any) -> None:
    mesh = device_mesh_factory((2,))
    full = torch.arange(15.0).view(5, 3)
    dt = distribute_tensor(full, mesh, [Shard(0)])
    dt.requires_grad_(True)
    local = local_tensor(dt)
    assert local is local_tensor(dt)  # the same object each time, not a new view
    assert local.grad_fn is None and not local.requires_grad  # nothing recorded for autograd
    torch.testing.assert_close(local, dt.to_local().detach())
    assert local.shape == ((3, 3) if rank == 0 else (2, 3))  # torch.chunk sizes: 3, 2
    with torch.no_grad():
        local.mul_(2)  # a write through it changes the DTensor
    torch.testing.assert_close(dt.full_tensor().detach(), full * 2)
    param = nn.Parameter(distribute_tensor(full, mesh, [Replicate()]))
    assert isinstance(param, DTensor) and not local_tensor(param).requires_grad


@pytest.mark.distributed(world_size=2)
def test_new_dtensor_wraps_without_communication(
    rank: int, world_size: int, device_mesh_factory: Any
) -> None:
    mesh = device_mesh_factory((2,))
    full = torch.arange(14.0).view(7, 2)
    dt = distribute_tensor(full, mesh, [Shard(0)])
    layout = dt.layout_spec
    with record_collectives() as log:
        wrapped = new_dtensor(local_tensor(dt).clone(), layout)
    assert len(log) == 0
    assert wrapped.layout_spec == layout and wrapped.placements == (Shard(0),)
    assert tuple(wrapped.shape) == (7, 2) and not wrapped.requires_grad
    torch.testing.assert_close(wrapped.full_tensor(), full)
