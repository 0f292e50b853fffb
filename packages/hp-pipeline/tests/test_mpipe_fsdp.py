"""MPipe x FSDP on a (pp=2, dp=2) mesh: parity with one process on the whole global batch.

Four ranks form an hp_core mesh ``(pp, dp)``. Each dp replica runs its own
MPipe pipeline over ``mesh["pp"]`` on its half of the global batch; the text
stages are wrapped with ``hp_fsdp.fully_shard`` on ``mesh["dp"]`` (they take
part through [Note: FSDP protocol], hp-pipeline never imports hp-fsdp), and
the vision tower is a plain replica on all four ranks: summed over the
pipeline group by ``REDUCE_P`` and averaged over ``dp_group`` ([Note: MPipe
with data parallelism] in ``hp_pipeline.mpipe.schedule``); every collective of
each step is recorded and checked by name, group and bytes. Five AdamW steps in
float64 must match a single-process copy trained on the whole global batch:
the losses, every gradient (``full_tensor`` of the sharded ones, the tower's
on every rank), every parameter after the step. The replicas' towers start
different on purpose: the construction broadcast must make them equal.
"""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hp_core
import pytest
import torch
import torch._dynamo
import torch.distributed as dist
from hp_dtensor import DTensor
from hp_fsdp import FSDPModule, fully_shard
from hp_fsdp.collectives import TAG_BITS
from hp_pipeline import PipelineStage, PPRankOwnedSampler, mpipe_owned_micros, stages_on_rank
from hp_pipeline.mpipe import mpipe_base_layout
from hp_testing import record_collectives
from torch import nn
from torch.utils.data import DataLoader, SequentialSampler, Subset

sys.path.insert(0, str(Path(__file__).parent))
from mpipe_testlib import Samples, schedule_for, token_mean, token_sum

PP, DP = 2, 2
D, PIX, NIMG, SEQ, VOCAB, MBS, STEPS = 6, 5, 2, 4, 11, 2, 5
RTOL, ATOL = 1e-7, 1e-9


class Tower(nn.Module):
    """``pixels -> (embeds, pooled)``: two features, both used by stage 0."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(PIX, D)
        self.fc2 = nn.Linear(D, D)

    def forward(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        embeds = self.fc2(torch.tanh(self.fc1(pixels)))
        return embeds, embeds.mean(dim=1)


class First(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.pool = nn.Linear(D, D)
        self.fc = nn.Linear(D, D)

    def forward(self, ids: torch.Tensor, embeds: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        h = torch.cat([embeds, self.embed(ids)], dim=1) + self.pool(pooled).unsqueeze(1)
        return torch.tanh(self.fc(h))


class Mid(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(h)) + h


class Last(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.fc(h))[:, NIMG:])


def build(num_stages: int) -> tuple[Tower, list[nn.Module]]:
    torch.manual_seed(99)
    tower = Tower().double()
    stages = [First(), *[Mid() for _ in range(num_stages - 2)], Last()]
    return tower, [s.double() for s in stages]


def make_samples(n: int) -> Samples:
    return Samples(n, seed=11, nimg=NIMG, pix=PIX, seq=SEQ, vocab=VOCAB, dtype=torch.float64)


@dataclass(frozen=True)
class Case:
    m: int  # micro-batches per replica
    base: str | None = None
    owner_backward: bool = True
    loading: bool = False
    tokens: bool = True
    mode: str = "full"
    nested: bool = False  # fully_shard each stage's ``fc`` first, then the stage (two units a stage)
    compiled: bool = False  # each stage module compiled (aot_eager) after fully_shard


CASES = {
    "1f1b-load-tokens": Case(4, loading=True),
    "zbh1-recompute-mean-loss": Case(3, base="zb-h1", owner_backward=False, tokens=False),
    "zbv-load-tokens-min": Case(3, base="zbv", loading=True, mode="min"),
    "1f1b-nested": Case(4, nested=True),
    "zbv-load-nested": Case(3, base="zbv", loading=True, nested=True),
    "1f1b-load-compiled": Case(4, loading=True, compiled=True),
    # Stage 0's input gradient inside OVERLAP_F_B pairs ([Note: MPipe over overlapped pairs]).
    "dualpipev-load-tokens": Case(4, base="dualpipev", loading=True),
}


def units(stage: nn.Module, nested: bool) -> list[list[nn.Parameter]]:
    """The parameters of each ``fully_shard`` unit: its ``fc`` and the rest (if any) when nested."""
    if not nested:
        return [list(stage.parameters())]
    fc = list(stage.fc.parameters())
    rest = [p for p in stage.parameters() if all(p is not q for q in fc)]
    return [fc, rest] if rest else [fc]  # a stage of only ``fc`` has a root unit without parameters


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL, msg=lambda msg: f"{what}: {msg}")


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.distributed(world_size=PP * DP, timeout=150)) for n in CASES]
)
def test_mpipe_fsdp_2x2_matches_single_process(
    rank: int, world_size: int, device_mesh_factory: Any, name: str
) -> None:
    case = CASES[name]
    m = case.m
    _, v, style = mpipe_base_layout(case.base, None)
    num_stages = PP * v
    mesh = device_mesh_factory((PP, DP), ("pp", "dp"))
    pp_rank, dp_rank = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    pp_group, dp_group = mesh["pp"].get_group(), mesh["dp"].get_group()

    tower, modules = build(num_stages)
    ref_tower, ref_stages = copy.deepcopy(tower), copy.deepcopy(modules)
    my_tower = copy.deepcopy(tower)
    if rank != 0:  # every replica but global rank 0's starts different: the broadcasts must fix it
        with torch.no_grad():
            for param in my_tower.parameters():
                param.add_(0.25 * rank)
    local = stages_on_rank(pp_rank, PP, v, style=style)  # type: ignore[arg-type]
    stages = []
    for s in local:
        if case.nested:
            fully_shard(modules[s].fc, mesh=mesh["dp"])
        fully_shard(modules[s], mesh=mesh["dp"])
        assert isinstance(modules[s], FSDPModule)
        if case.compiled:
            torch._dynamo.reset()  # pooled ranks are reused: empty caches and counters
            torch._dynamo.utils.counters.clear()
            modules[s].compile(backend="aot_eager")
        stages.append(PipelineStage(modules[s], s, num_stages, group=pp_group))
    schedule = schedule_for(case, stages, my_tower, m, dp_group=dp_group)
    assert any(step.type.is_fsdp for step in schedule.order[pp_rank]), "no FSDP steps were inserted"
    stage_params = [p for s in local for p in modules[s].parameters()]
    assert all(isinstance(p, DTensor) for p in stage_params)
    opt = torch.optim.AdamW(stage_params, lr=1e-2)
    tower_opt = torch.optim.AdamW(my_tower.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(
        [
            *ref_stages[0].parameters(),
            *[p for s in ref_stages[1:] for p in s.parameters()],
            *ref_tower.parameters(),
        ],
        lr=1e-2,
    )

    half = m * MBS  # samples per replica and step
    data = make_samples(STEPS * DP * half)
    it = None
    if case.loading:
        # This replica's share of every step, read in step order by the owners of its pipeline.
        share = [t * DP * half + dp_rank * half + j for t in range(STEPS) for j in range(half)]
        owned = mpipe_owned_micros(PP, m, pp_rank, case.mode)  # type: ignore[arg-type]
        subset = Subset(data, share)
        sampler = PPRankOwnedSampler(SequentialSampler(subset), owned, MBS, m, num_steps=STEPS)
        it = iter(DataLoader(subset, batch_size=MBS, sampler=sampler))
    has_last = num_stages - 1 in local
    # Every collective of a step ([Note: MPipe with data parallelism]): the tower sync check's max
    # and min over the pipeline and the dp group, the tower-gradient sum over the pipeline then its
    # average over dp (one float64 buffer with a flag per parameter), the token count over both,
    # the failure vote on NCCL/HCCL, and per fully_shard unit of a local stage FSDP's one all-gather
    # and one reduce-scatter of the unit's padded parameters on dp.
    pp_ranks, dp_ranks = (tuple(dist.get_process_group_ranks(g)) for g in (pp_group, dp_group))
    numel, n_params = sum(q.numel() for q in my_tower.parameters()), len(list(my_tower.parameters()))
    coalescing = hp_core.capabilities_for(pp_group).backend != "gloo"
    padded = [
        sum(DP * -(-q.shape[0] // DP) * (q.numel() // q.shape[0]) * 8 for q in unit)
        for s in local
        for unit in units(ref_stages[s], case.nested)
    ]
    # a reduce-scatter also sends, in each rank's chunk, a flag per parameter and the unit's tag
    # ([Note: gradient flags] and [Note: one unit's reduction met another's] in hp_fsdp.collectives)
    trailer = [DP * (len(unit) + TAG_BITS) * 8 for s in local for unit in units(ref_stages[s], case.nested)]
    want_collectives = sorted(
        [("all_reduce", g, numel * 8) for g in (pp_ranks, dp_ranks) for _ in range(2)]
        + [("all_reduce", g, (numel + n_params) * 8) for g in (pp_ranks, dp_ranks)]
        + [("all_reduce", g, 8) for g in (pp_ranks, dp_ranks)] * int(case.tokens)
        + [("all_reduce", pp_ranks, 4)] * int(coalescing)
        + [("all_gather_into_tensor", dp_ranks, size) for size in padded]
        + [
            ("reduce_scatter_tensor", dp_ranks, size + extra)
            for size, extra in zip(padded, trailer, strict=True)
        ]
    )

    for step in range(STEPS):
        lo = step * DP * half
        pixels, ids, labels = (t[lo : lo + DP * half] for t in (data.pixels, data.ids, data.labels))
        h = ref_stages[0](ids, *ref_tower(pixels))
        for module in ref_stages[1:]:
            h = module(h)
        micro_logits, micro_labels = h.tensor_split(DP * m), labels.tensor_split(DP * m)
        if case.tokens:
            count = int((labels != -100).sum())
            (token_sum(h, labels) / count).backward()
            # [Note: MPipe with data parallelism]: a replica divides by count / DP.
            ref_losses = [
                (token_sum(a, b) / (count / DP)).detach()
                for a, b in zip(micro_logits, micro_labels, strict=True)
            ]
        else:
            means = [token_mean(a, b) for a, b in zip(micro_logits, micro_labels, strict=True)]
            (torch.stack(means).sum() / (DP * m)).backward()
            ref_losses = [x.detach() for x in means]
        mine = slice(dp_rank * half, (dp_rank + 1) * half)
        losses: list[torch.Tensor] = []
        with record_collectives() as log:
            if case.loading:
                schedule.step(data=it, losses=losses)
            else:
                schedule.step(ids[mine], target=labels[mine], losses=losses, preprocess_inputs=pixels[mine])
        issued = sorted((r.name, r.group_ranks, r.nbytes) for r in log)
        assert issued == want_collectives, f"step {step} rank {rank}: {issued}"
        if has_last:
            want = ref_losses[dp_rank * m : (dp_rank + 1) * m]
            assert len(losses) == m
            for i, (got, expected) in enumerate(zip(losses, want, strict=True)):
                close(got, expected, f"step {step} replica {dp_rank} loss {i}")
        else:
            assert losses == []
        for s in local:
            for (pname, got), want in zip(
                modules[s].named_parameters(), ref_stages[s].parameters(), strict=True
            ):
                assert got.grad is not None, f"step {step}: stage {s} {pname} has no grad"
                close(full(got.grad), want.grad, f"step {step} stage {s} {pname}.grad")
        for (pname, got), want in zip(my_tower.named_parameters(), ref_tower.parameters(), strict=True):
            close(got.grad, want.grad, f"step {step} tower {pname}.grad on rank {rank}")
        opt.step()
        tower_opt.step()
        ref_opt.step()
        for o in (opt, tower_opt, ref_opt):
            o.zero_grad()
        for s in local:
            for (pname, got), want in zip(
                modules[s].named_parameters(), ref_stages[s].parameters(), strict=True
            ):
                close(full(got.detach()), want.detach(), f"step {step} stage {s} {pname} after AdamW")
        for (pname, got), want in zip(my_tower.named_parameters(), ref_tower.parameters(), strict=True):
            close(got.detach(), want.detach(), f"step {step} tower {pname} after AdamW on rank {rank}")
    schedule.check_tower_sync()
    if case.compiled:
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0, "no stage was compiled"
