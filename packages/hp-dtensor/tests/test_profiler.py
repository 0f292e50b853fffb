"""Profiler labels: redistribution shows as ``hp_dtensor::redistribute`` (forward and backward)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hp_dtensor import Replicate, Shard, distribute_tensor


@pytest.mark.distributed(world_size=2, mode="process")  # one profiler per process
def test_redistribute_is_labelled_in_a_profile(rank: int, device_mesh_factory: Any) -> None:
    mesh = device_mesh_factory((2,), ("tp",))
    x = distribute_tensor(torch.randn(7, 4, requires_grad=True), mesh, [Shard(0)])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        x.redistribute(placements=[Replicate()]).to_local().sum().backward()
    labels = [event.name for event in prof.events() if event.name == "hp_dtensor::redistribute"]
    assert len(labels) >= 2, labels  # the all-gather forward, the local cut backward
    assert x.grad is not None
    torch.testing.assert_close(x.grad.full_tensor(), torch.ones(7, 4))
    # without a profiler nothing is recorded and the result is the same
    torch.testing.assert_close(x.redistribute(placements=[Replicate()]).to_local(), x.full_tensor())
