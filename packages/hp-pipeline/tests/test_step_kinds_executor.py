"""A plug-in kind runs in the executor: its handler, its around-forward context, its per-step begin.

The kind ``TEST_NOTE`` is a local step after each forward whose handler
records what the forward saved for backward; its ``around`` wraps every ``F``
in ``saved_tensors_hooks`` (the shape an activation swap takes) and counts what
each micro-batch's forward packs. Training must match the plain schedule exactly.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hp_pipeline import MetaStep, MetaStepType, PipelineStage, Schedule1F1B, StepKind, register_step_kind
from hp_pipeline.ir import Order
from hp_pipeline.kinds import register_step_handler
from torch import nn

_KEY = "test-note"


def _packing(runner: Any, step: MetaStep) -> Any:
    """Around every F: count the tensors autograd saves for micro-batch ``step.micro_index``."""
    packed = runner.state[_KEY]["packed"]

    def pack(t: torch.Tensor) -> torch.Tensor:
        packed[step.micro_index] = packed.get(step.micro_index, 0) + 1
        return t

    @contextmanager
    def hooks() -> Any:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield

    return hooks() if runner.training else None


def _begin(runner: Any) -> None:
    runner.state[_KEY] = {"packed": {}, "notes": []}


def _note(runner: Any, step: MetaStep) -> None:
    state = runner.state[_KEY]
    state["notes"].append((str(step), state["packed"].get(step.micro_index, 0)))


NOTE = register_step_kind(
    StepKind(
        "TEST_NOTE",
        "TNOTE",
        "a test kind: note what each forward saved",
        group="test",
        needs=lambda view, step: [MetaStep(step.micro_index, MetaStepType.FWD, step.stage_index)],
        wraps=("F",),
        around=_packing,
        begin=_begin,
    )
)
register_step_handler(NOTE, _note)


class NotedSchedule(Schedule1F1B):
    """1F1B with a ``TNOTE`` after every forward (a schedule adds a kind through its order)."""

    def build_order(self, p: int, m: int) -> Order:
        order = super().build_order(p, m)
        return {
            rank: [
                s
                for step in steps
                for s in (
                    [step, MetaStep(step.micro_index, NOTE, step.stage_index)]
                    if step.type is MetaStepType.FWD
                    else [step]
                )
            ]
            for rank, steps in order.items()
        }


@pytest.mark.distributed(world_size=2)
def test_plugin_handler_context_and_begin_run_in_the_executor(rank: int, world_size: int) -> None:
    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh())
    plain_model = copy.deepcopy(model)
    mine = slice(0, 2) if rank == 0 else slice(2, 4)
    loss_fn = nn.MSELoss()
    noted = NotedSchedule(PipelineStage(model[mine], rank, 2, torch.device("cpu")), 2, loss_fn)
    plain = Schedule1F1B(PipelineStage(plain_model[mine], rank, 2, torch.device("cpu")), 2, loss_fn)
    assert MetaStep(0, NOTE, rank) in noted.order[rank]
    x, y = torch.randn(4, 4, generator=torch.Generator().manual_seed(1)), torch.randn(4, 4)
    for _ in range(2):  # the first step (blocking, shapes learned) and a later one
        outs = [
            schedule.step(*((x,) if rank == 0 else ()), target=y if rank == 1 else None)
            for schedule in (noted, plain)
        ]
        notes = noted._runner.state[_KEY]["notes"]
        assert [text for text, _ in notes] == [f"{rank}TNOTE0", f"{rank}TNOTE1"]
        assert all(count > 0 for _, count in notes), notes  # the context saw each forward's saves
        if rank == 1:
            torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    for a, b in zip(model[mine].parameters(), plain_model[mine].parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)
    dist.barrier()


def test_a_kind_without_a_handler_fails_at_construction() -> None:
    from hp_pipeline.executor import StepRunner

    orphan = register_step_kind(StepKind("TEST_ORPHAN", "TORPHAN", group="test"))
    runner = object.__new__(StepRunner)  # the check needs no process group
    runner.steps = [MetaStep(0, MetaStepType.FWD, 0), MetaStep(0, orphan, 0)]
    with pytest.raises(ValueError, match=r"no executor handler for the step kinds \['TEST_ORPHAN'\]"):
        runner._bind_kinds({})
