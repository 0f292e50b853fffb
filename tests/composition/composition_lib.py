"""The model, the wrappings and the single-process reference of the composition matrix.

One case is a combination a user writes: data parallelism (FSDP or HSDP), how
``fully_shard`` is applied (per block, per stage, nested), tensor parallelism
inside the blocks or not, a pipeline schedule or none, fp32 or bf16 mixed
precision, activation checkpointing off or on. Each case trains a few steps
and is compared with a deep copy trained in one process on the whole global
batch: the loss of every step, every gradient, every parameter after the step,
and the data-parallel collectives of every step against FSDP's figures.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

WIDTH = 8
HIDDEN = 12  # even: TP over 2 ranks cuts it evenly
BLOCKS_PER_STAGE = 2
MICRO = 4  # micro-batches per dp replica and step
PER_MICRO = 2  # samples per micro-batch
STEPS = 3
LR = 0.05

# schedule name -> (hp_pipeline class name, stages per rank, placement style)
SCHEDULES: dict[str, tuple[str, int, str]] = {
    "gpipe": ("ScheduleGPipe", 1, "loop"),
    "1f1b": ("Schedule1F1B", 1, "loop"),
    "interleaved": ("ScheduleInterleaved1F1B", 2, "loop"),
    "zb-h1": ("ScheduleZeroBubble", 1, "loop"),
    "zbv": ("ScheduleZBV", 2, "v"),
    "looped-bfs": ("ScheduleLoopedBFS", 2, "loop"),
    "interleaved-zb": ("ScheduleInterleavedZeroBubble", 2, "loop"),
    "dualpipev": ("ScheduleDualPipeV", 2, "v"),  # needs MICRO >= 2 * pp
}


@dataclass(frozen=True)
class Case:
    """One combination; ``id`` names it in the test report."""

    dp: str = "fsdp"  # "fsdp": 1-D dp mesh; "hsdp": (replicate, shard)
    wrap: str = "nested"  # "block": each block; "stage": each stage module; "nested": both, bottom-up
    tp: bool = False
    pipeline: str | None = None  # a SCHEDULES key, or None for a plain training loop
    bf16: bool = False
    ac: bool = False
    compile: bool = False  # each block compiled (aot_eager) after fully_shard, torchtitan's way

    @property
    def id(self) -> str:
        parts = [self.dp, self.wrap, "tp" if self.tp else "notp", self.pipeline or "nopp"]
        parts += ["bf16" if self.bf16 else "fp32", "ac" if self.ac else "noac"]
        return "-".join(parts + ["compiled"] * self.compile)

    @property
    def mesh_dims(self) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """The smallest mesh that holds the case: pp=2 with a pipeline, rep=2 for HSDP, tp=2 with TP."""
        sizes: list[int] = []
        names: list[str] = []
        for size, name, used in (
            (2, "pp", self.pipeline is not None),
            (2, "rep", self.dp == "hsdp"),
            (2, "dp", True),
            (2, "tp", self.tp),
        ):
            if used:
                sizes.append(size)
                names.append(name)
        return tuple(sizes), tuple(names)

    @property
    def world_size(self) -> int:
        n = 1
        for size in self.mesh_dims[0]:
            n *= size
        return n


class Block(nn.Module):
    """``h + fc2(tanh(fc1(h)))``; activation checkpointing recomputes the MLP in backward."""

    def __init__(self, ac: bool) -> None:
        super().__init__()
        self.fc1 = nn.Linear(WIDTH, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, WIDTH)
        self.ac = ac

    def _mlp(self, h: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(h)))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.ac and torch.is_grad_enabled():
            return h + checkpoint(self._mlp, h, use_reentrant=False)
        return h + self._mlp(h)


class Stage(nn.Module):
    """A few blocks, plus (when the stage module is wrapped) an output layer of the stage's own.

    With ``head`` the stage's root unit manages parameters itself, so nested
    wrapping has parameters on both levels; a stage wrapped only per block has
    no parameters outside the blocks (anything outside would not be data-parallel).
    """

    def __init__(self, ac: bool, head: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(ac) for _ in range(BLOCKS_PER_STAGE)])
        self.head = nn.Linear(WIDTH, WIDTH) if head else None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            h = block(h)
        return h if self.head is None else torch.tanh(self.head(h))


def build_stages(case: Case, num_stages: int) -> list[Stage]:
    """The whole model, identical on every rank (seeded), fp32."""
    torch.manual_seed(2024)
    return [Stage(case.ac, head=case.wrap != "block") for _ in range(num_stages)]


def global_batch(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(700 + step)
    return torch.randn(n, WIDTH, generator=gen), torch.randn(n, WIDTH, generator=gen)


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out.float(), target)


def param_units(stage: Stage, wrap: str) -> int:
    """``fully_shard`` units of one stage that manage parameters (one all-gather / reduce-scatter each)."""
    return {"block": len(stage.blocks), "stage": 1, "nested": len(stage.blocks) + 1}[wrap]


class Reference:
    """The same model in one process on the whole batch; bf16 runs the compute on a bf16 copy."""

    def __init__(self, stages: list[Stage], bf16: bool) -> None:
        self.model = nn.Sequential(*copy.deepcopy(stages))
        self.bf16 = bf16
        self.opt = torch.optim.SGD(self.model.parameters(), lr=LR)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Forward and backward; the gradients land on ``self.model`` in fp32."""
        self.opt.zero_grad()
        if not self.bf16:
            loss = loss_fn(self.model(x), y)
            loss.backward()
            return loss.detach()
        work = copy.deepcopy(self.model).to(torch.bfloat16)
        loss = loss_fn(work(x.to(torch.bfloat16)), y)
        loss.backward()
        for p, q in zip(self.model.parameters(), work.parameters(), strict=True):
            p.grad = None if q.grad is None else q.grad.float()
        return loss.detach()

    def stage(self, s: int) -> nn.Module:
        module: nn.Module = self.model[s]
        return module


def named_pairs(module: nn.Module, ref: nn.Module) -> Iterator[tuple[str, Any, torch.Tensor]]:
    """``(name, ours, reference)`` for every parameter, by name (wrapping keeps the names)."""
    want = dict(ref.named_parameters())
    got = dict(module.named_parameters())
    assert set(got) == set(want), f"parameter names differ: {sorted(set(got) ^ set(want))}"
    for name in want:
        yield name, got[name], want[name]


@dataclass(frozen=True)
class Tol:
    rtol: float
    atol: float


def tolerance(case: Case) -> Tol:
    # bf16 compute: the reference reduces the whole batch's gradient in bf16 once, the ranks
    # their shares, so results agree to bf16's precision (eps 2**-8), not to fp32's.
    return Tol(3e-2, 1e-2) if case.bf16 else Tol(1e-5, 1e-6)
