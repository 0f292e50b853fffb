"""``_foreach_max`` and ``_foreach_powsum`` as partial values: no gather, one all-reduce when read.

Against the same ops on the plain tensors, bit for bit in float64; uneven
cuts, an empty piece (one row over two ranks), Shard, Replicate and an
integer element; the ops themselves communicate nothing and take no fallback.
"""

from __future__ import annotations

import math

import pytest
import torch
from hp_dtensor import Partial, Replicate, Shard, distribute_tensor, fallback_stats
from hp_testing import record_collectives

SHAPES = [(5, 3), (1, 4), (4, 7), (6,)]
PLACEMENTS = [[Shard(0)], [Shard(0)], [Shard(1)], [Replicate()]]


def _elements(mesh):  # type: ignore[no-untyped-def]
    torch.manual_seed(3)
    plain = [torch.randn(s, dtype=torch.float64) for s in SHAPES]
    plain.append(torch.randint(-50, 50, (5,), dtype=torch.int64))
    dts = [distribute_tensor(t, mesh, p) for t, p in zip(plain, [*PLACEMENTS, [Shard(0)]], strict=True)]
    return plain, dts


@pytest.mark.distributed(world_size=2)
def test_foreach_max_stays_partial(rank, device_mesh_factory):  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    plain, dts = _elements(mesh)
    before = fallback_stats()
    with record_collectives() as log:
        maxes = torch._foreach_max(dts)
    assert log.count() == 0, log.counts()
    assert [m.placements for m in maxes] == [(Partial("max"),)] * 3 + [(Replicate(),), (Partial("max"),)]
    for got, want in zip(maxes, torch._foreach_max(plain), strict=True):
        assert torch.equal(got.full_tensor(), want)
    floats = maxes[:4]
    with record_collectives() as log:  # the inf norm of the list: one all-reduce of the stack
        total = torch.stack(floats).max().full_tensor()
    assert log.counts() == {"all_reduce": 1}, log.counts()
    assert total == torch.stack(torch._foreach_max(plain[:4])).max()
    assert fallback_stats() == before


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("ord", [2, 3, 0, 1.5, math.inf])
def test_foreach_powsum_stays_partial(rank, device_mesh_factory, ord):  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    plain, dts = _elements(mesh)
    plain, dts = plain[:4], dts[:4]
    before = fallback_stats()
    with record_collectives() as log:
        sums = torch._foreach_powsum(dts, ord)
        sums32 = torch._foreach_powsum(dts, ord, dtype=torch.float32)
    assert log.count() == 0, log.counts()
    assert [s.placements for s in sums] == [(Partial("sum"),)] * 3 + [(Replicate(),)]
    for got, want in zip(sums, torch._foreach_powsum(plain, ord), strict=True):
        torch.testing.assert_close(got.full_tensor(), want, rtol=1e-12, atol=0)
    for got, want in zip(sums32, torch._foreach_powsum(plain, ord, dtype=torch.float32), strict=True):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.full_tensor(), want)
    assert fallback_stats() == before


@pytest.mark.distributed(world_size=2)
def test_foreach_max_of_an_empty_tensor_raises(rank, device_mesh_factory):  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    empty = distribute_tensor(torch.empty(0, 3), mesh, [Shard(1)])
    with pytest.raises(RuntimeError, match=r"global shape \(0, 3\) \(no elements\)"):
        torch._foreach_max([empty])
