"""Debug logs of a schedule: order built, comms inserted, runner made; each step's action at DETAIL only.

The tests count calls into torch.distributed or read process-wide loggers, so their ranks
run as processes (``mode="process"``), not as threads of one process.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager

import hp_core
import pytest
import torch
from hp_pipeline import PipelineStage, Schedule1F1B
from torch import nn


@contextmanager
def pipeline_log(level: str) -> Iterator[list[str]]:
    """The ``hp_pipeline`` logger's lines at DEBUG, under ``HP_DISTRIBUTED_DEBUG=level``."""
    previous = hp_core.set_debug_level(level)
    try:
        with hp_core.collect_log_lines("hp_pipeline") as lines:
            yield lines
    finally:
        hp_core.set_debug_level(previous)


def _train_one_step(rank: int) -> tuple[Schedule1F1B, list[torch.Tensor]]:
    """One 1F1B step on 2 ranks, checked against the same two layers in one process."""
    torch.manual_seed(0)
    blocks = [nn.Linear(4, 4, dtype=torch.float64) for _ in range(2)]
    reference = nn.Sequential(*copy.deepcopy(blocks))
    x, y = torch.randn(4, 4, dtype=torch.float64), torch.randn(4, 4, dtype=torch.float64)
    schedule = Schedule1F1B(PipelineStage(blocks[rank], rank, 2), 2, nn.functional.mse_loss)
    losses: list[torch.Tensor] = []
    schedule.step(x) if rank == 0 else schedule.step(target=y, losses=losses)
    ref_losses = [
        nn.functional.mse_loss(reference(xs), ys) for xs, ys in zip(x.chunk(2), y.chunk(2), strict=True)
    ]
    torch.stack(ref_losses).mean().backward()
    if rank == 1:
        torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses).detach())
    for got, want in zip(blocks[rank].parameters(), reference[rank].parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad)
    return schedule, losses


@pytest.mark.distributed(world_size=2, timeout=60, mode="process")
def test_info_logs_the_schedule_decisions(rank: int, world_size: int) -> None:
    with pipeline_log("INFO") as lines:
        schedule, _ = _train_one_step(rank)
    prefix = f"[rank {rank}/2] Schedule1F1B: "
    compute = sum(1 for row in schedule.order.values() for s in row if s.type.is_compute)
    assert lines[:3] == [
        f"{prefix}order built for 2 ranks, 2 micro-batches: {compute} compute steps",
        f"{prefix}comms inserted: {sum(len(r) for r in schedule.order.values()) - compute} transfer steps",
        f"{prefix}runner StepRunner for rank {rank}: {len(schedule.order[rank])} steps",
    ], lines
    assert not [line for line in lines if "PP step" in line], "each step's action is DETAIL's"


@pytest.mark.distributed(world_size=2, timeout=60, mode="process")
def test_detail_logs_each_steps_action(rank: int, world_size: int) -> None:
    with pipeline_log("DETAIL") as lines:
        schedule, _ = _train_one_step(rank)
    actions = [line.removeprefix(f"[rank {rank}/2] PP step ") for line in lines if " PP step " in line]
    assert actions == [str(s) for s in schedule.order[rank] if s.type.is_compute], lines
    assert sorted(actions) == sorted([f"{rank}F0", f"{rank}F1", f"{rank}B0", f"{rank}B1"]), lines
