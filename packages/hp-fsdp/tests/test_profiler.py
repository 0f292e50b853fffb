"""Profiler labels: one FSDP step under torch.profiler shows FSDP2's label names."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

LABELS = {
    "FSDP::root_pre_forward",
    "FSDP::pre_forward",
    "FSDP::post_forward",
    "FSDP::all_gather",
    "FSDP::all_gather_copy_out",
    "FSDP::pre_backward",
    "FSDP::post_backward",
    "FSDP::post_backward_reduce",
    "FSDP::post_backward_rs_wait",
    "FSDP::root_post_backward_callback",
}


@pytest.mark.distributed(world_size=2, mode="process")  # one profiler per process
def test_fsdp_step_is_labelled_in_a_profile(rank: int, device_mesh_factory: Any) -> None:
    from hp_fsdp import fully_shard

    mesh = device_mesh_factory((2,), ("dp",))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 4))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    x = torch.randn(3, 4)
    model(x).sum().backward()  # warm-up: lazy init outside the profile
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(x).sum().backward()
    # a label names its unit after it, "FSDP::all_gather (0)" (test_trace_labels.py): compare the kinds
    names = {event.name.split(" (")[0] for event in prof.events()}
    assert names >= LABELS, sorted(LABELS - names)
    assert not any(n.startswith("FSDP::") for n in names - LABELS), sorted(names - LABELS)
