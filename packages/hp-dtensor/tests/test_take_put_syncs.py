"""take and put on a cut tensor read nothing to the host: no device stall per call (2 ranks).

[Note: range check without a host sync] in ``ops/flat_index.py``: the
kernels select no values by mask, and only the CPU reads the index for its
range check (free there). On CPU, :func:`hp_testing.count_host_syncs` shows
the rest reads nothing; a meta tensor stands in for an accelerator's, whose
data any read would need (a read of a meta tensor raises). Values and
gradients against plain tensors; ``test_take_put.py`` covers the layouts.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hp_dtensor import DTensor, Partial, Shard, distribute_tensor, fallback_policy
from hp_testing import count_host_syncs

S0 = Shard(0)
INDEX = torch.tensor([[0, 7, -1], [13, 5, 5]])  # 3 x 7 = 21 elements: rows 0-1 on rank 0, row 2 on rank 1
UNIQUE = torch.tensor([1, 8, 20, -3])
ON_RANK_1 = torch.tensor([14, 20, 16])  # row 2 only: rank 0 owns none of them
CPU_RANGE_CHECK = ["hp_dtensor/ops/flat_index.py:_check_range"]


@pytest.mark.distributed(world_size=2)
def test_take_and_put_read_nothing_but_the_cpu_range_check(rank: int, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    x = torch.randn(3, 7, dtype=torch.float64)
    x[0, 0] = -0.0  # on rank 0, which owns none of ON_RANK_1: an added zero must keep its sign
    source = torch.randn(2, 3, dtype=torch.float64)
    values = torch.randn(4, dtype=torch.float64)
    leaf = x.clone().requires_grad_()
    dx = distribute_tensor(x.clone(), mesh, [S0]).detach().requires_grad_()
    with fallback_policy("error"), count_host_syncs(allow=CPU_RANGE_CHECK) as log:
        taken = torch.take(dx, INDEX)
        taken.sum().backward()  # take's backward is an accumulating put
        added = torch.put(dx.detach(), INDEX, source, accumulate=True)
        on_one = torch.put(dx.detach(), ON_RANK_1, torch.ones(3, dtype=torch.float64), accumulate=True)
        written = torch.put(dx.detach(), UNIQUE, values)
        inplace = dx.detach().clone()
        inplace.put_(UNIQUE, values)
    assert log.count == 0, log.report()
    assert len(log.allowed) > 0  # the CPU range check did run

    torch.take(leaf, INDEX).sum().backward()
    torch.testing.assert_close(taken.full_tensor(), torch.take(x, INDEX))
    torch.testing.assert_close(dx.grad.full_tensor(), leaf.grad)
    torch.testing.assert_close(added.full_tensor(), torch.put(x, INDEX, source, accumulate=True))
    expected = torch.put(x, ON_RANK_1, torch.ones(3, dtype=torch.float64), accumulate=True)
    assert torch.equal(on_one.full_tensor(), expected)
    assert torch.equal(torch.signbit(on_one.full_tensor()), torch.signbit(expected)), "-0.0 kept"
    torch.testing.assert_close(written.full_tensor(), torch.put(x, UNIQUE, values))
    torch.testing.assert_close(inplace.full_tensor(), x.clone().put_(UNIQUE, values))
    assert written.placements == inplace.placements == (S0,)


@pytest.mark.distributed(world_size=2)
def test_take_and_put_on_an_accelerator_read_no_data(rank: int, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """Meta stands in for an accelerator: reading its data raises, so the kernels must not read it."""
    mesh = device_mesh_factory((2,))
    meta = {"device": "meta"}
    x = DTensor.from_local(torch.empty(2 - dist.get_rank(), 7, **meta), mesh, [S0], shape=(3, 7))
    with fallback_policy("error"):
        taken = torch.take(x, INDEX.to("meta"))
        added = torch.put(x, INDEX.to("meta"), torch.empty(2, 3, **meta), accumulate=True)
        written = x.clone().put_(UNIQUE.to("meta"), torch.empty(4, **meta))
    assert taken.placements == (Partial("sum"),) and taken.shape == INDEX.shape
    assert added.placements == written.placements == (S0,)
    assert written.to_local().shape == (2 - rank, 7)
