"""PP x FSDP (2 x 2) with the real hp-fsdp: parity with one process, one reduce-scatter per stage and step.

Four ranks form an hp_core mesh ``(pp=2, dp=2)``. Each dp replica runs the
same pipeline on its half of the global batch; every stage module is wrapped
with ``hp_fsdp.fully_shard`` on the rank's ``dp`` submesh, so the pipeline
composes with FSDP only through [Note: FSDP protocol] in ``hp_pipeline.fsdp``
(hp-pipeline never imports hp-fsdp; this test does). Five AdamW steps in
float64 must match a single-process copy on the whole global batch: the loss
of every step, every gradient (``full_tensor`` of the sharded grads), every
parameter after the step. The collectives of each step are counted: one
reduce-scatter per stage (one ``fully_shard`` unit each), not one per
micro-batch, which is what ``set_requires_gradient_sync(False)`` plus
``REDUCE_GRAD`` buy, and one all-gather per stage (``UNSHARD``; the gathered
parameters survive every micro-batch's backward because the executor turns off
``reshard_after_backward`` for the step).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hp_dtensor import DTensor
from hp_fsdp import FSDPModule, fully_shard
from hp_pipeline import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBV,
    ScheduleZBVZeroBubble,
    ScheduleZeroBubble,
    stages_on_rank,
)
from hp_testing import record_collectives
from torch import nn

PP, DP = 2, 2
WIDTH = 5  # odd: the shards over dp=2 are uneven (3 + 2 rows)
GLOBAL_BATCH = 16  # 8 per dp replica
STEPS = 5
RTOL, ATOL = 1e-10, 1e-12  # float64: only reduction order differs

CASES: dict[str, tuple[type, int, int, str]] = {
    # name: (schedule class, stages per rank, micro-batches per replica, stage placement)
    "1f1b": (Schedule1F1B, 1, 4, "loop"),
    "gpipe": (ScheduleGPipe, 1, 4, "loop"),
    "interleaved": (ScheduleInterleaved1F1B, 2, 4, "loop"),
    # split backward: the weight step W runs after the input step I, so the gathered
    # parameters must survive I (the executor keeps them until RESHARD)
    "zb-h1": (ScheduleZeroBubble, 1, 4, "loop"),
    "zbv": (ScheduleZBV, 2, 4, "v"),
    "looped-bfs": (ScheduleLoopedBFS, 2, 4, "loop"),
    "interleaved-zb": (ScheduleInterleavedZeroBubble, 2, 4, "loop"),
    "zbv-zero-bubble": (ScheduleZBVZeroBubble, 2, 8, "v"),  # ScheduleZBV by torch's name; m > stages
    # overlapped pairs: each stage of a pair must stay gathered for both halves
    "dualpipev": (ScheduleDualPipeV, 2, 4, "v"),
    "dualpipev-m8": (ScheduleDualPipeV, 2, 8, "v"),
}


class StageNet(nn.Module):
    """Two linear layers with a tanh between (and after, except on the last stage)."""

    def __init__(self, last: bool) -> None:
        super().__init__()
        self.fc1 = nn.Linear(WIDTH, WIDTH)
        self.fc2 = nn.Linear(WIDTH, WIDTH)
        self.last = last

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = self.fc2(torch.tanh(self.fc1(h)))
        return h if self.last else torch.tanh(h)


def make_stages(num_stages: int) -> list[StageNet]:
    """The whole model, identical on every rank (seeded), in float64."""
    torch.manual_seed(4321)
    return [StageNet(last=s == num_stages - 1).double() for s in range(num_stages)]


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets of the whole step, identical on every rank."""
    gen = torch.Generator().manual_seed(500 + step)
    x = torch.randn(GLOBAL_BATCH, WIDTH, generator=gen, dtype=torch.float64)
    y = torch.randn(GLOBAL_BATCH, WIDTH, generator=gen, dtype=torch.float64)
    return x, y


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind a sharded DTensor (a collective over its mesh)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.distributed(world_size=PP * DP, timeout=120)) for n in CASES]
)
def test_pp_fsdp_2x2_matches_single_process(
    rank: int, world_size: int, device_mesh_factory: Any, name: str
) -> None:
    schedule_cls, per_rank, m, style = CASES[name]
    num_stages = PP * per_rank
    mesh = device_mesh_factory((PP, DP), ("pp", "dp"))
    pp_rank, dp_rank = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    pp_group, dp_group = mesh["pp"].get_group(), mesh["dp"].get_group()

    modules = make_stages(num_stages)
    reference = nn.Sequential(*copy.deepcopy(modules))
    local = stages_on_rank(pp_rank, PP, per_rank, style=style)
    stages = []
    for s in local:
        fully_shard(modules[s], mesh=mesh["dp"])
        assert isinstance(modules[s], FSDPModule)
        stages.append(PipelineStage(modules[s], s, num_stages, group=pp_group))
    schedule = schedule_cls(stages if per_rank > 1 else stages[0], m, nn.functional.mse_loss)
    assert any(step.type.is_fsdp for step in schedule.order[pp_rank]), "no FSDP steps were inserted"

    params = [p for s in local for p in modules[s].parameters()]
    assert all(isinstance(p, DTensor) for p in params)
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    has_first, has_last = 0 in local, num_stages - 1 in local
    half = GLOBAL_BATCH // DP
    mine = slice(dp_rank * half, (dp_rank + 1) * half)

    for step in range(STEPS):
        x, y = global_batch(step)
        ref_out = reference(x)
        ref_loss = nn.functional.mse_loss(ref_out, y)
        ref_loss.backward()

        losses: list[torch.Tensor] = []
        with record_collectives() as log:
            out = schedule.step(
                *((x[mine],) if has_first else ()), target=y[mine] if has_last else None, losses=losses
            )
        # [Note: FSDP protocol]: one reduce-scatter (REDUCE_GRAD) and one all-gather (UNSHARD) per
        # stage and step, on the stage's dp group, however many micro-batches ran.
        dp_ranks = tuple(dist.get_process_group_ranks(dp_group))
        for name in ("reduce_scatter_tensor", "all_gather_into_tensor"):
            issued = log.of(name)
            assert len(issued) == len(local), (
                f"step {step}: rank {rank} issued {len(issued)} {name} for stages {local} over {m} "
                f"micro-batches; expected {len(local)} (one per stage per step)"
            )
            assert all(r.group_ranks == dp_ranks for r in issued), (
                f"step {step}: a {name} ran outside this rank's dp group {dp_ranks}: {issued}"
            )

        if has_last:
            close(out, ref_out.detach()[mine], f"step {step} output")
            assert len(losses) == m
            total = torch.stack(losses).mean()
            dist.all_reduce(total, group=dp_group)  # SUM: every backend has it
            close(total / DP, ref_loss.detach(), f"step {step} loss")
        else:
            assert out is None and losses == []

        for s in local:
            for (pname, got), want in zip(
                modules[s].named_parameters(), reference[s].parameters(), strict=True
            ):
                assert got.grad is not None, f"step {step}: stage {s} {pname} has no grad"
                assert want.grad is not None
                close(full(got.grad), want.grad, f"step {step} stage {s} {pname}.grad")
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        for s in local:
            for (pname, got), want in zip(
                modules[s].named_parameters(), reference[s].parameters(), strict=True
            ):
                close(full(got.detach()), want.detach(), f"step {step} stage {s} {pname} after AdamW")


@pytest.mark.distributed(world_size=PP * DP, timeout=120)
def test_stage_wrapped_after_the_schedule_is_refused(rank: int, device_mesh_factory: Any) -> None:
    """``fully_shard`` after the schedule: a clear error on every rank, not a step that trains nothing.

    The schedule decides at construction whether a stage gets the FSDP steps;
    a stage wrapped later had units but no ``REDUCE_GRAD``, and the executor
    turned their gradient sync off: every gradient stayed ``None`` and AdamW
    moved nothing ([Note: units found at the first step]).
    """
    from hp_pipeline import PipelineStepError

    mesh = device_mesh_factory((PP, DP), ("pp", "dp"))
    pp_rank, dp_rank = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    modules = make_stages(PP)
    stage = PipelineStage(modules[pp_rank], pp_rank, PP, group=mesh["pp"].get_group())
    schedule = Schedule1F1B(stage, 4, nn.functional.mse_loss)
    assert not any(step.type.is_fsdp for step in schedule.order[pp_rank])
    fully_shard(modules[pp_rank], mesh=mesh["dp"])  # too late: the order is built
    x, y = global_batch(0)
    mine = slice(dp_rank * 8, (dp_rank + 1) * 8)
    refusal = r"stage \d's module holds fully_shard units.*before building"
    with pytest.raises(PipelineStepError, match=refusal):
        schedule.step(*((x[mine],) if pp_rank == 0 else ()), target=y[mine] if pp_rank == PP - 1 else None)
    assert all(p.grad is None for p in modules[pp_rank].parameters())
