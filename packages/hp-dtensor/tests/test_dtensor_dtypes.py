"""DTensors of the dtypes gloo cannot take as they are (int16, wide unsigned, bool, float8).

hp_core carries them ([Note: dtype carriers] in hp_core.carriers): these
check the user-facing transitions (gather a shard, reshard, reduce a partial)
against the plain tensor, bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from hp_dtensor import DTensor, Partial, Replicate, Shard, distribute_tensor

DTYPES = [torch.int16, torch.uint16, torch.uint32, torch.uint64, torch.bool, torch.float8_e4m3fn]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_shards_gather_and_reshard(rank, device_mesh_factory, dtype):  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    full = (torch.arange(35).reshape(7, 5) % 9).to(dtype)  # 7 rows: an uneven cut
    x = distribute_tensor(full, mesh, [Shard(0)])
    assert torch.equal(_bits(x.full_tensor()), _bits(full))
    moved = x.redistribute(mesh, [Shard(1)])
    assert torch.equal(_bits(moved.to_local()), _bits(full.tensor_split(2, dim=1)[rank]))
    assert torch.equal(_bits(moved.redistribute(mesh, [Replicate()]).to_local()), _bits(full))


@pytest.mark.distributed(world_size=2)
def test_int16_partial_sum_is_exact(rank, device_mesh_factory):  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    terms = [
        torch.tensor([30000, -30000, 7, 1], dtype=torch.int16),
        torch.tensor([30000, -5, 9, -1], dtype=torch.int16),
    ]
    expected = terms[0] + terms[1]  # wraps around modulo 2**16, as int16 arithmetic does
    partial = DTensor.from_local(terms[rank], mesh, [Partial("sum")])
    assert torch.equal(partial.full_tensor(), expected)
    scattered = DTensor.from_local(terms[rank], mesh, [Partial("sum")]).redistribute(mesh, [Shard(0)])
    assert torch.equal(scattered.to_local(), expected.chunk(2)[rank])
    x = distribute_tensor(torch.arange(-9, 12, dtype=torch.int16), mesh, [Shard(0)])
    assert x.sum().full_tensor().item() == sum(range(-9, 12))
    assert x.amax().full_tensor().item() == 11
