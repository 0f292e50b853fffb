"""Profiler labels: every executed action of a schedule shows as ``PP:<action>``, as in torch pipelining."""

from __future__ import annotations

import pytest
import torch
from hp_pipeline import PipelineStage, Schedule1F1B
from torch import nn


@pytest.mark.distributed(world_size=2, timeout=60, mode="process")  # one profiler per process
def test_actions_are_labelled_in_a_profile(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    blocks = [nn.Linear(4, 4) for _ in range(2)]
    stage = PipelineStage(blocks[rank], rank, 2)
    schedule = Schedule1F1B(stage, 2, nn.functional.mse_loss)
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    schedule.step(x) if rank == 0 else schedule.step(target=y)  # warm-up: shapes, first-step checks
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        schedule.step(x) if rank == 0 else schedule.step(target=y)
    names = {event.name for event in prof.events()}
    expected = {f"PP:{rank}F0", f"PP:{rank}F1", f"PP:{rank}B0", f"PP:{rank}B1"}
    assert expected <= names, sorted(n for n in names if n.startswith("PP:"))
