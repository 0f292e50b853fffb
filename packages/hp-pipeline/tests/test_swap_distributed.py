"""Activation swap across processes: parity with one process and with no swap; accounting vs the simulator.

Each case builds the whole model from one seed on every rank, keeps a deep copy
as the single-process reference and runs two pipelines of the same stages: one
with ``swap_policy=SwapPolicy(keep_newest=0, min_bytes=0)`` (every saved
activation that can move goes to host memory) and one without. For three
training steps both must match the reference (losses, outputs, every gradient,
the parameters after SGD) and each other bit for bit: a swap copies values and
changes no arithmetic. After each step the executor's accounting must agree
with the simulator: the rank's peak of resident saved activations is the
simulated peak of resident micro-batches times one micro-batch's bytes, and the
micro-batches swapped out are the rank's ``SWAP_OUT`` steps.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hp_pipeline import (
    MetaStepType,
    PipelineStage,
    PipelineStepError,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
    ScheduleZeroBubble,
    SwapError,
    SwapPolicy,
    simulate,
    stages_on_rank,
)
from torch import nn

RTOL, ATOL = 1e-5, 1e-6
# Every m here divides BATCH: uneven micro-batches would weigh the mean loss differently from one process.
WIDTH, BATCH, STEPS = 16, 48, 3
POLICY = SwapPolicy(keep_newest=0, min_bytes=0)

CASES: dict[str, tuple[type, int, int, int, str]] = {
    # name: (class, world size, n_microbatches, stages per rank, placement)
    "1f1b-2": (Schedule1F1B, 2, 4, 1, "loop"),  # nothing to gain, so nothing swaps: accounting only
    "1f1b-4": (Schedule1F1B, 4, 8, 1, "loop"),
    "gpipe-2": (ScheduleGPipe, 2, 4, 1, "loop"),
    "interleaved-2x2": (ScheduleInterleaved1F1B, 2, 4, 2, "loop"),
    "zb-h1-4": (ScheduleZeroBubble, 4, 8, 1, "loop"),  # split backward: held until W
    "dualpipev-2-m4": (ScheduleDualPipeV, 2, 4, 2, "v"),  # overlapped pairs
    # torch's other schedules, at 2 and 4 ranks, m equal to and larger than the stage count
    "looped-bfs-2x2-m4": (ScheduleLoopedBFS, 2, 4, 2, "loop"),
    "looped-bfs-4x2-m12": (ScheduleLoopedBFS, 4, 12, 2, "loop"),
    "interleaved-zb-2x2-m6": (ScheduleInterleavedZeroBubble, 2, 6, 2, "loop"),
    "interleaved-zb-4x2-m8": (ScheduleInterleavedZeroBubble, 4, 8, 2, "loop"),
    "zbv-2-m4": (ScheduleZBVZeroBubble, 2, 4, 2, "v"),
    "zbv-4-m12": (ScheduleZBVZeroBubble, 4, 12, 2, "v"),
    "dualpipev-2-m6": (ScheduleDualPipeV, 2, 6, 2, "v"),
    "dualpipev-4-m8": (ScheduleDualPipeV, 4, 8, 2, "v"),
}
# The default run takes each of torch's other schedules once, on one backend
# each; HP_COMPOSITION=full (tox -e composition) runs every case on all three.
FULL = os.environ.get("HP_COMPOSITION") == "full"
NEW_SCHEDULES = [
    n for n in CASES if n.startswith(("looped-bfs", "interleaved-zb", "zbv", "dualpipev-2-m6", "dualpipev-4"))
]
BACKENDS = ("gloo", "nccl-emu", "hccl-emu")


class Block(nn.Module):
    """``fc2(gelu(fc1(h)))``: two managed tensors per micro-batch (gelu's input and output)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(WIDTH, WIDTH)
        self.fc2 = nn.Linear(WIDTH, WIDTH)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.fc2(nn.functional.gelu(self.fc1(h)))


def make_blocks(num_stages: int) -> list[Block]:
    torch.manual_seed(2024)
    return [Block() for _ in range(num_stages)]


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(300 + step)
    return torch.randn(BATCH, WIDTH, generator=gen), torch.randn(BATCH, WIDTH, generator=gen)


def close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


def _cases(names: list[str], backends: tuple[str, ...]) -> list[Any]:
    return [
        pytest.param(
            name,
            marks=pytest.mark.distributed(world_size=CASES[name][1], backend=backend, timeout=120),
            id=f"{name}-{backend}",
        )
        for name in names
        for backend in backends
    ]


@pytest.mark.parametrize(
    "name",
    _cases(["gpipe-2", "1f1b-4"], BACKENDS)
    + _cases(["1f1b-2", "interleaved-2x2", "zb-h1-4", "dualpipev-2-m4"], ("gloo",) if not FULL else BACKENDS)
    + (
        _cases(NEW_SCHEDULES, BACKENDS)
        if FULL
        else _cases(["looped-bfs-2x2-m4"], ("gloo",))
        + _cases(["interleaved-zb-2x2-m6"], ("nccl-emu",))
        + _cases(["zbv-4-m12"], ("hccl-emu",))
        + _cases(["dualpipev-4-m8"], ("nccl-emu",))
    ),
)
def test_swap_matches_single_process_and_no_swap(rank: int, world_size: int, name: str) -> None:
    cls, p, m, v, style = CASES[name]
    num_stages = p * v
    blocks = make_blocks(num_stages)
    reference = nn.Sequential(*copy.deepcopy(blocks))
    mine = stages_on_rank(rank, p, v, style=style)
    runs: dict[str, tuple[Any, list[PipelineStage]]] = {}
    for label, policy in (("swap", POLICY), ("plain", None)):
        stages = [PipelineStage(copy.deepcopy(blocks[s]), s, num_stages) for s in mine]
        schedule = cls(stages if v > 1 else stages[0], m, nn.functional.mse_loss, swap_policy=policy)
        runs[label] = (schedule, stages)
    swap_schedule = runs["swap"][0]
    outs = [s for s in swap_schedule.order[rank] if s.type.name == "SWAP_OUT"]
    swapping = sum(s.type.name == "SWAP_OUT" for steps in swap_schedule.order.values() for s in steps)
    assert (swapping == 0) == (name == "1f1b-2"), f"{name}: {swapping} swaps in the pipeline"
    assert runs["plain"][0].activation_memory() is None
    opts = {
        label: torch.optim.SGD([q for s in st for q in s.submod.parameters()], lr=0.1)
        for label, (_, st) in runs.items()
    }
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    has_first, has_last = 0 in mine, num_stages - 1 in mine
    for step in range(STEPS):
        x, y = batch(step)
        ref_opt.zero_grad()
        ref_out = reference(x)
        nn.functional.mse_loss(ref_out, y).backward()
        results = {}
        for label, (schedule, stages) in runs.items():
            opts[label].zero_grad()
            losses: list[torch.Tensor] = []
            out = schedule.step(*((x,) if has_first else ()), target=y if has_last else None, losses=losses)
            grads = [q.grad.clone() for s in stages for q in s.submod.parameters()]
            results[label] = (out, losses, grads)
            if has_last:
                close(out, ref_out.detach(), f"{label} step {step} output")
            for stage in stages:
                for got, want in zip(
                    stage.submod.parameters(), reference[stage.stage_index].parameters(), strict=True
                ):
                    close(got.grad, want.grad, f"{label} step {step} stage {stage.stage_index} grad")
        (out_a, losses_a, grads_a), (out_b, losses_b, grads_b) = results["swap"], results["plain"]
        for a, b in zip([*losses_a, *grads_a], [*losses_b, *grads_b], strict=True):
            assert torch.equal(a, b), f"step {step}: swap changed a value"
        if has_last:
            assert torch.equal(out_a, out_b)
        check_accounting(swap_schedule, rank, len(outs))
        for label in runs:
            opts[label].step()
        ref_opt.step()


def check_accounting(schedule: Any, rank: int, swap_outs: int) -> None:
    """The executor's figures against the simulator's ([Note: activation accounting] in hp_pipeline.swap)."""
    stats = schedule.activation_memory()
    assert stats.bytes_by_micro and 0 not in stats.bytes_by_micro.values(), stats
    simulated = simulate(schedule.order).peak_device_bytes(rank, stats.bytes_by_micro)
    assert stats.peak_bytes == simulated, (
        f"rank {rank}: measured peak {stats.peak_bytes} B, simulated {simulated} B "
        f"(micro-batches: {stats.bytes_by_micro})"
    )
    assert stats.swapped_out == swap_outs and stats.swapped_in == swap_outs
    assert stats.resident_bytes == 0 and stats.host_bytes == 0, "a step left activations behind"


@pytest.mark.distributed(world_size=4, timeout=120)
def test_keep_newest_and_stage_choice_follow_the_order(rank: int, world_size: int) -> None:
    """A partial policy: only stage 0 swaps, keeping its newest micro-batch; accounting still agrees."""
    blocks = make_blocks(4)
    stage = PipelineStage(copy.deepcopy(blocks[rank]), rank, 4)
    policy = SwapPolicy(keep_newest=1, stages={0}, min_bytes=0)
    schedule = Schedule1F1B(stage, 8, nn.functional.mse_loss, swap_policy=policy)
    swaps = [s for s in schedule.order[rank] if s.type is MetaStepType("SWAP_OUT")]
    assert bool(swaps) == (rank == 0)
    x, y = batch(0)
    schedule.step(*((x,) if rank == 0 else ()), target=y if rank == 3 else None)
    check_accounting(schedule, rank, len(swaps))
    if rank == 0:
        assert simulate(schedule.order).peak_device_activations_per_rank[0] == 3  # 4 without swap


@pytest.mark.distributed(world_size=2, timeout=60)
def test_impossible_policy_fails_before_communicating(rank: int, world_size: int) -> None:
    """A policy naming a stage the pipeline lacks is refused in the constructor, on every rank alike."""
    stage = PipelineStage(make_blocks(2)[rank], rank, 2)
    with pytest.raises(SwapError, match=r"stages=\[0, 2\] names stage\(s\) \[2\].*stages 0 .. 1"):
        Schedule1F1B(stage, 4, nn.functional.mse_loss, swap_policy=SwapPolicy(stages={0, 2}))
    with pytest.raises(TypeError, match="swap_policy must be a SwapPolicy or None"):
        Schedule1F1B(stage, 4, nn.functional.mse_loss, swap_policy="all")
    dist.barrier()  # the group is still usable: nothing was half-sent


@pytest.mark.parametrize(
    "backend",
    [
        pytest.param(b, marks=pytest.mark.distributed(world_size=4, backend=b, timeout=120), id=b)
        for b in ("gloo", "nccl-emu")
    ],
)
def test_swap_under_pp_x_fsdp(rank: int, world_size: int, device_mesh_factory: Any, backend: str) -> None:
    """PP x FSDP (2 x 2), float64: swap on matches swap off and one process; gathered weights unmanaged."""
    from hp_dtensor import DTensor
    from hp_fsdp import fully_shard

    mesh = device_mesh_factory((2, 2), ("pp", "dp"))
    pp_rank, dp_rank = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    torch.manual_seed(77)
    blocks = [Block().double() for _ in range(2)]
    reference = nn.Sequential(*copy.deepcopy(blocks))
    runs = {}
    for label, policy in (("swap", POLICY), ("plain", None)):
        module = copy.deepcopy(blocks[pp_rank])
        fully_shard(module, mesh=mesh["dp"])
        stage = PipelineStage(module, pp_rank, 2, group=mesh["pp"].get_group())
        runs[label] = (ScheduleGPipe(stage, 4, nn.functional.mse_loss, swap_policy=policy), module)
    swap_outs = sum(s.type is MetaStepType("SWAP_OUT") for s in runs["swap"][0].order[pp_rank])
    assert swap_outs > 0  # GPipe: each stage's micro-batches wait on the host for their backward
    half = BATCH // 2
    mine = slice(dp_rank * half, (dp_rank + 1) * half)
    for step in range(2):
        x, y = (t.double() for t in batch(step))
        reference.zero_grad()
        nn.functional.mse_loss(reference(x), y).backward()
        grads = {}
        for label, (schedule, module) in runs.items():
            module.zero_grad()
            schedule.step(*((x[mine],) if pp_rank == 0 else ()), target=y[mine] if pp_rank == 1 else None)
            full = [
                g.full_tensor() if isinstance(g, DTensor) else g
                for g in (p.grad for p in module.parameters())
            ]
            for got, want in zip(full, reference[pp_rank].parameters(), strict=True):
                torch.testing.assert_close(got, want.grad, rtol=1e-10, atol=1e-12)
            grads[label] = full
        for a, b in zip(grads["swap"], grads["plain"], strict=True):
            assert torch.equal(a, b), f"step {step}: swap changed a gradient under FSDP"
        check_accounting(runs["swap"][0], pp_rank, swap_outs)


@pytest.mark.distributed(world_size=2, timeout=60)
def test_swap_without_host_memory_is_refused_before_communicating(rank: int, world_size: int) -> None:
    """A platform whose tensors live on 'meta' has no memory to swap to: a clear error in the constructor."""
    from hp_core import Platform, use_platform

    stage = PipelineStage(make_blocks(2)[rank], rank, 2, device="cpu")
    with use_platform(Platform("cpu", "gloo", "meta")):
        with pytest.raises(SwapError, match=r"tensors live on 'meta'.*pass swap_policy=None"):
            Schedule1F1B(stage, 4, nn.functional.mse_loss, swap_policy=SwapPolicy())
    dist.barrier()  # nothing was sent: the group still works


class Exploding(nn.Module):
    """A block whose forward raises on one chosen call."""

    def __init__(self, inner: nn.Module, fail_on_call: int | None) -> None:
        super().__init__()
        self.inner, self.calls, self.fail_on_call = inner, 0, fail_on_call

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.fail_on_call:
            raise ValueError(f"boom in call {self.calls}")
        return self.inner(h)


@pytest.mark.distributed(world_size=4, timeout=120)
def test_failed_step_with_swap_leaves_nothing_behind(rank: int, world_size: int) -> None:
    """Stage 0 fails in its 3rd forward of step 2, with micro-batches 0 and 1 on the host; step 3 is whole."""
    module = Exploding(make_blocks(4)[rank], 11 if rank == 0 else None)
    schedule = Schedule1F1B(PipelineStage(module, rank, 4), 8, nn.functional.mse_loss, swap_policy=POLICY)
    x, y = batch(0)
    args, target = ((x,) if rank == 0 else ()), (y if rank == 3 else None)
    schedule.step(*args, target=target)
    with pytest.raises(PipelineStepError, match="boom in call 11"):
        schedule.step(*args, target=target)
    schedule.step(*args, target=target)
    swap_outs = sum(s.type is MetaStepType("SWAP_OUT") for s in schedule.order[rank])
    check_accounting(schedule, rank, swap_outs)
