"""MPipe multi-process parity: a small vision-language model against a single-process copy.

Every rank builds the same model (an MLP vision tower plus a tiny text
transformer cut into stages) from one seed and keeps a deep copy as the
reference. Five AdamW steps later the pipeline's per-micro-batch losses, every
gradient (stages and tower, on every rank) and the parameters after each step
must equal the reference's. The model runs in float64: AdamW divides each
gradient by its own magnitude, so an element whose gradient nearly cancels
turns fp32 round-off (a different but equally valid summation order in the
pipeline) into a visible difference of the parameter; in float64 the same
comparison is tight (rtol=1e-7, atol=1e-9).
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
import torch.distributed as dist
from hp_pipeline import (
    MetaStepType,
    PipelineStage,
    PipelineStepError,
    PPRankOwnedSampler,
    ScheduleMPipe,
    mpipe_owned_micros,
    stages_on_rank,
)
from hp_pipeline.mpipe import is_mpipe_kind, mpipe_base_layout
from hp_pipeline.mpipe.runner import MPipeRunner
from hp_testing import record_collectives
from torch import nn
from torch.utils.data import DataLoader, SequentialSampler

sys.path.insert(0, str(Path(__file__).parent))
from mpipe_testlib import Samples, schedule_for, token_mean, token_sum

RTOL, ATOL = 1e-7, 1e-9
D, PIX, NIMG, SEQ, VOCAB, MBS, STEPS = 8, 6, 2, 5, 13, 2, 5


class Tower(nn.Module):
    """``pixels -> (embeds, level, unused, mask)``: two used features, one unused, one integer."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(PIX, D)
        self.fc2 = nn.Linear(D, D)

    def forward(self, pixels: torch.Tensor) -> tuple[torch.Tensor, ...]:
        embeds = self.fc2(torch.nn.functional.gelu(self.fc1(pixels)))
        level = embeds.mean(dim=1)
        unused = embeds * 2.0  # stage 0 ignores it: its gradient counts as zero
        mask = torch.ones(pixels.shape[:2], dtype=torch.long, device=pixels.device)
        return embeds, level, unused, mask


def block() -> nn.Module:
    # No biases: the key bias has an exactly-zero gradient in theory, noise in practice, which
    # AdamW would blow up to a full step of either sign.
    return nn.TransformerEncoderLayer(D, 2, 2 * D, dropout=0.0, batch_first=True, bias=False)


class First(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.level = nn.Linear(D, D)
        self.block = block()

    def forward(self, ids, embeds, level, unused, mask):
        img = embeds * mask.unsqueeze(-1).to(embeds.dtype)
        h = torch.cat([img, self.embed(ids)], dim=1) + self.level(level).unsqueeze(1)
        return self.block(h)


class Mid(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = block()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.block(h)


class Last(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = block()
        self.head = nn.Linear(D, VOCAB)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(h)[:, NIMG:])


def build_model(num_stages: int, frozen: bool) -> tuple[Tower, list[nn.Module]]:
    torch.set_default_dtype(torch.float64)  # the harness restores the default after each test
    torch.manual_seed(2024)
    tower = Tower()
    if frozen:
        tower.requires_grad_(False)
    stages: list[nn.Module] = [First(), *[Mid() for _ in range(num_stages - 2)], Last()]
    return tower, stages


def ref_logits(
    tower: Tower, stages: list[nn.Module], pixels: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    h = stages[0](ids, *tower(pixels))
    for stage in stages[1:]:
        h = stage(h)
    return h


def make_samples(n: int) -> Samples:
    return Samples(n, seed=7, nimg=NIMG, pix=PIX, seq=SEQ, vocab=VOCAB)


@dataclass(frozen=True)
class Case:
    p: int
    m: int
    v: int = 1
    frozen: bool = False
    owner_backward: bool = True
    batched: bool = True
    loading: bool = False
    mode: str = "full"
    tokens: bool = True
    accumulate: int = 1  # step() calls per optimizer step
    base: str | None = None  # None: 1F1B (v == 1) or interleaved; else a name in MPIPE_BASES


CASES = {
    "p2-m4-owner-batched": Case(2, 4),
    "p2-m3-frozen-single-load-min": Case(2, 3, frozen=True, batched=False, loading=True, mode="min"),
    "p4-m6-recompute-load": Case(4, 6, owner_backward=False, loading=True),
    "p4-m4-single-min-mean-loss": Case(4, 4, batched=False, mode="min", tokens=False),
    "p2x2-interleaved-load": Case(2, 4, v=2, loading=True),
    "p4-m2-fewer-micros-than-ranks": Case(4, 2),
    "p2-m5-accumulate-load": Case(2, 5, loading=True, accumulate=2),
    "p4-m5-frozen-recompute-min-load": Case(
        4, 5, frozen=True, owner_backward=False, loading=True, mode="min"
    ),
    # Zero-bubble bases ([Note: MPipe bases]): stage 0's I, not B, yields dL/dfeatures.
    "p2-zbh1-m4-load": Case(2, 4, base="zb-h1", loading=True),
    "p4-zbh1-m6-recompute-single-min": Case(
        4, 6, base="zb-h1", owner_backward=False, batched=False, mode="min"
    ),
    "p2-zbv-m5-accumulate-load": Case(2, 5, v=2, base="zbv", loading=True, accumulate=2),
    "p2-zbv-m3-recompute-mean-loss": Case(2, 3, v=2, base="zbv", owner_backward=False, tokens=False),
    "p4-zbv-m6-min-load": Case(4, 6, v=2, base="zbv", loading=True, mode="min"),
    "p2-zbv-m3-frozen-single": Case(2, 3, v=2, base="zbv", frozen=True, batched=False),
}


def _param(name: str) -> Any:
    return pytest.param(name, marks=pytest.mark.distributed(world_size=CASES[name].p, timeout=90), id=name)


def close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL, msg=lambda msg: f"{what}: {msg}")


@pytest.mark.parametrize("name", [_param(n) for n in CASES])
def test_mpipe_matches_single_process(rank, world_size, name, monkeypatch):
    check_mpipe_parity(rank, CASES[name], monkeypatch)


def check_mpipe_parity(rank: int, case: Case, monkeypatch: Any) -> None:
    """Losses, every gradient and the parameters after each of ``STEPS`` AdamW steps, against one process.

    Also the collectives each step issues and where ``REDUCE_P`` found its sum
    ([Note: early tower reduction]). ``test_mpipe_bases.py`` runs it over the
    other bases.
    """
    # [Note: early tower reduction]: record whether each REDUCE_P found its sum already posted.
    found_posted: list[bool] = []
    reduce_tower = MPipeRunner._reduce_tower

    def recording(self: MPipeRunner) -> None:
        found_posted.append(self._pending_reduce is not None)
        reduce_tower(self)

    monkeypatch.setattr(MPipeRunner, "_reduce_tower", recording)
    p, m, v = case.p, case.m, case.v
    num_stages = p * v
    tower, modules = build_model(num_stages, case.frozen)
    ref_tower, ref_stages = copy.deepcopy(tower), copy.deepcopy(modules)
    mine = stages_on_rank(rank, p, v, style=mpipe_base_layout(case.base, v)[2])
    my_tower = copy.deepcopy(tower)
    if rank != 0:  # replicas start different: the schedule's broadcast must fix them
        with torch.no_grad():
            for param in my_tower.parameters():
                param.add_(0.5)
    stages = [PipelineStage(copy.deepcopy(modules[s]), s, num_stages) for s in mine]
    schedule = schedule_for(case, stages, my_tower, m, batched_recv=case.batched)
    coalescing = hp_core.capabilities_for(schedule.group or dist.group.WORLD).backend != "gloo"
    if p > 1 and 0 in mine and case.batched:
        # [Note: MPipe receive posting]: batched on gloo, list order where batches coalesce.
        assert schedule.batched is (not coalescing), f"batched={schedule.batched}, coalescing={coalescing}"
    params = [q for s in stages for q in s.submod.parameters()] + list(my_tower.parameters())
    opt = torch.optim.AdamW([q for q in params if q.requires_grad], lr=0.01)
    ref_params = [q for s in ref_stages for q in s.parameters()] + list(ref_tower.parameters())
    ref_opt = torch.optim.AdamW([q for q in ref_params if q.requires_grad], lr=0.01)

    step_size = m * MBS
    data = make_samples(STEPS * case.accumulate * step_size)
    owned = mpipe_owned_micros(p, m, rank, case.mode)  # type: ignore[arg-type]
    it = None
    if case.loading:
        sampler = PPRankOwnedSampler(
            SequentialSampler(data), owned, MBS, m, num_steps=STEPS * case.accumulate
        )
        it = iter(DataLoader(data, batch_size=MBS, sampler=sampler))
    has_last = num_stages - 1 in mine
    # Per step() on every rank, all on the pipeline group: the sync check's max and min of the
    # tower, the tower-gradient sum ([Note: tower gradient reduction]: one float64 buffer with a
    # flag per parameter), the token count, and on NCCL/HCCL the failure vote.
    numel, n_params = sum(q.numel() for q in my_tower.parameters()), len(list(my_tower.parameters()))
    group_ranks = tuple(range(p))
    expected_collectives = sorted(
        [("all_reduce", group_ranks, numel * 8)] * 2
        + [("all_reduce", group_ranks, (numel + n_params) * 8)] * int(not case.frozen)
        + [("all_reduce", group_ranks, 8)] * int(case.tokens)
        + [("all_reduce", group_ranks, 4)] * int(coalescing)
    )
    calls = 0
    for step in range(STEPS):
        opt.zero_grad()
        ref_opt.zero_grad()
        ref_losses = []
        losses: list[torch.Tensor] = []
        for _ in range(case.accumulate):
            lo, hi = calls * step_size, (calls + 1) * step_size
            calls += 1
            pixels, ids, labels = data.pixels[lo:hi], data.ids[lo:hi], data.labels[lo:hi]
            logits = ref_logits(ref_tower, ref_stages, pixels, ids)
            if case.tokens:
                count = int((labels != -100).sum())
                (token_sum(logits, labels) / count).backward()
                ref_losses += [
                    (token_sum(a, b) / count).detach()
                    for a, b in zip(logits.tensor_split(m), labels.tensor_split(m), strict=True)
                ]
            else:
                micro = [
                    token_mean(a, b)
                    for a, b in zip(logits.tensor_split(m), labels.tensor_split(m), strict=True)
                ]
                (torch.stack(micro).sum() / m).backward()
                ref_losses += [x.detach() for x in micro]
            with record_collectives() as log:
                if case.loading:
                    schedule.step(data=it, losses=losses)
                else:
                    schedule.step(ids, target=labels, losses=losses, preprocess_inputs=pixels)
            assert sorted((r.name, r.group_ranks, r.nbytes) for r in log) == expected_collectives, list(log)
        if has_last:
            assert len(losses) == m * case.accumulate
            for i, (got, want) in enumerate(zip(losses, ref_losses, strict=True)):
                close(got, want, f"step {step} loss {i}")
        else:
            assert losses == []
        for stage in stages:
            for (pname, got), want in zip(
                stage.submod.named_parameters(), ref_stages[stage.stage_index].parameters(), strict=True
            ):
                assert got.grad is not None, f"stage {stage.stage_index} {pname} has no grad"
                close(got.grad, want.grad, f"step {step} stage {stage.stage_index} {pname}.grad")
        for (pname, got), want in zip(my_tower.named_parameters(), ref_tower.parameters(), strict=True):
            if case.frozen:
                assert got.grad is None and want.grad is None
            else:
                close(got.grad, want.grad, f"step {step} tower {pname}.grad")
        opt.step()
        ref_opt.step()
        for stage in stages:
            for got, want in zip(
                stage.submod.parameters(), ref_stages[stage.stage_index].parameters(), strict=True
            ):
                close(got.detach(), want.detach(), f"step {step} stage {stage.stage_index} param")
        for got, want in zip(my_tower.parameters(), ref_tower.parameters(), strict=True):
            close(got.detach(), want.detach(), f"step {step} tower param")
    schedule.check_tower_sync()
    # One REDUCE_P per step with a trained tower; posted after the last PB wherever this rank has
    # one and the backend does not run its operations in one queue.
    has_pb = any(s.type is MetaStepType.PREPROCESS_BWD for s in schedule.order[rank])
    assert found_posted == ([] if case.frozen else [has_pb and not coalescing] * STEPS * case.accumulate)


@pytest.mark.distributed(world_size=2, timeout=60)
def test_tower_drift_is_detected_and_loading_needs_owners(rank, world_size):
    tower, modules = build_model(2, frozen=False)
    stage = PipelineStage(copy.deepcopy(modules[rank]), rank, 2)
    schedule = ScheduleMPipe(
        stage, 2, preprocess=tower, loss_fn=token_sum, normalize_by_tokens=True, check_tower_sync=True
    )
    data = make_samples(4)
    schedule.step(data.ids[:4], target=data.labels[:4], preprocess_inputs=data.pixels[:4])
    if rank == 1:
        with torch.no_grad():
            tower.fc1.weight[0, 0] += 1.0
    with pytest.raises(RuntimeError, match=r"replicas differ.*fc1\.weight"):
        schedule.step(data.ids[:4], target=data.labels[:4], preprocess_inputs=data.pixels[:4])
    # M < P with in-schedule loading: rank 1 would own nothing.
    stage1 = PipelineStage(copy.deepcopy(modules[rank]), rank, 2)
    if rank == 1:
        with pytest.raises(
            ValueError, match=r"owns no micro-batch.*raise the micro-batch count to at least 2"
        ):
            ScheduleMPipe(
                stage1,
                1,
                preprocess=tower,
                loss_fn=token_sum,
                in_schedule_loading=True,
                broadcast_tower=False,
            )
    else:
        ScheduleMPipe(
            stage1,
            1,
            preprocess=tower,
            loss_fn=token_sum,
            in_schedule_loading=True,
            broadcast_tower=False,
        )
    dist.barrier()


@pytest.mark.distributed(world_size=2, timeout=60)
def test_tower_failure_reaches_every_rank(rank, world_size):
    class Broken(Tower):
        def forward(self, pixels: torch.Tensor) -> Any:
            if dist.get_rank() == 1:
                raise ValueError("tower boom")
            return super().forward(pixels)

    torch.manual_seed(0)
    tower = Broken()
    _, modules = build_model(2, frozen=False)
    stage = PipelineStage(copy.deepcopy(modules[rank]), rank, 2)
    schedule = ScheduleMPipe(stage, 2, preprocess=tower, loss_fn=token_sum, normalize_by_tokens=True)
    data = make_samples(4)
    with pytest.raises(PipelineStepError, match=r"rank 1 raised ValueError: tower boom in step 1PF1"):
        schedule.step(data.ids, target=data.labels, preprocess_inputs=data.pixels)
    dist.barrier()


@pytest.mark.distributed(world_size=2, timeout=60)
def test_forward_only_and_global_clip(rank, world_size):
    tower, modules = build_model(2, frozen=False)
    ref_tower, ref_stages = copy.deepcopy(tower), copy.deepcopy(modules)
    data = make_samples(8)
    pixels, ids, labels = data.pixels, data.ids, data.labels
    # Forward only (no loss_fn): no tower backward, no reduction, the last stage gets the logits.
    stage = PipelineStage(copy.deepcopy(modules[rank]), rank, 2)
    infer = ScheduleMPipe(stage, 4, preprocess=copy.deepcopy(tower), loss_fn=None)
    assert not any(
        is_mpipe_kind(s.type) and s.type.name.endswith(("BWD", "REDUCE")) for s in infer.order[rank]
    )
    out = infer.step(ids, preprocess_inputs=pixels)
    if rank == 1:
        close(out, ref_logits(ref_tower, ref_stages, pixels, ids).detach(), "forward-only logits")
    # The global clip counts the tower once although every rank holds it.
    my_tower = copy.deepcopy(tower)
    stage = PipelineStage(copy.deepcopy(modules[rank]), rank, 2)
    train = ScheduleMPipe(stage, 4, preprocess=my_tower, loss_fn=token_sum, normalize_by_tokens=True)
    train.step(ids, target=labels, preprocess_inputs=pixels)
    token_mean(ref_logits(ref_tower, ref_stages, pixels, ids), labels).backward()
    norm = train.clip_grad_norm_(0.01)
    ref_params = [*ref_stages[0].parameters(), *ref_stages[1].parameters(), *ref_tower.parameters()]
    ref_norm = torch.nn.utils.clip_grad_norm_(ref_params, 0.01)
    # The pipeline's norm is accumulated in float32 (grads.py); compare at float32 precision.
    torch.testing.assert_close(norm.double(), ref_norm, rtol=1e-6, atol=0)
    for got, want in zip(my_tower.parameters(), ref_tower.parameters(), strict=True):
        close(got.grad, want.grad, "clipped tower grad")
    for got, want in zip(stage.submod.parameters(), ref_stages[rank].parameters(), strict=True):
        close(got.grad, want.grad, "clipped stage grad")


@pytest.mark.distributed(world_size=2, timeout=60)
def test_feature_shape_change_fails_on_every_rank(rank, world_size):
    tower, modules = build_model(2, frozen=False)
    stage = PipelineStage(copy.deepcopy(modules[rank]), rank, 2)
    schedule = ScheduleMPipe(stage, 2, preprocess=tower, loss_fn=token_sum, normalize_by_tokens=True)
    data = make_samples(4)
    schedule.step(data.ids, target=data.labels, preprocess_inputs=data.pixels)
    wider = torch.cat([data.pixels, data.pixels[:, :1]], dim=1)  # one more image token
    with pytest.raises(
        PipelineStepError, match=r"tower's output of micro-batch \d .*fixed at the first step"
    ):
        schedule.step(data.ids, target=data.labels, preprocess_inputs=wider)
    schedule.step(data.ids, target=data.labels, preprocess_inputs=data.pixels)  # still usable


@pytest.mark.distributed(world_size=2, timeout=60)
def test_step_takes_loss_kwargs_and_return_outputs(rank, world_size):
    """torch's ``step(loss_kwargs=, return_outputs=)``: the loss sees the kwargs, the model does not."""

    def weighted(logits: torch.Tensor, labels: torch.Tensor, weight: float = 1.0) -> torch.Tensor:
        return weight * token_sum(logits, labels)

    tower, modules = build_model(2, frozen=False)
    data = make_samples(4)
    results = {}
    for weight in (1.0, 3.0):
        stage = PipelineStage(copy.deepcopy(modules[rank]), rank, 2)
        schedule = ScheduleMPipe(stage, 2, preprocess=copy.deepcopy(tower), loss_fn=weighted)
        losses: list[torch.Tensor] = []
        out = schedule.step(
            data.ids,
            target=data.labels,
            losses=losses,
            preprocess_inputs=data.pixels,
            loss_kwargs={"weight": weight},
            return_outputs=False,
        )
        assert out is None
        results[weight] = losses
    if rank == 1:
        for plain, tripled in zip(results[1.0], results[3.0], strict=True):
            close(tripled, 3 * plain, "loss with loss_kwargs")


@pytest.mark.distributed(world_size=2, timeout=60)
def test_pre_split_inputs_match_the_whole_batch(rank, world_size):
    """torch's ``step(arg_mbs=, target_mbs=)``, tower inputs pre-split: the whole batch's losses and grads."""
    tower, modules = build_model(2, frozen=False)
    data = make_samples(4)
    m = 2
    results = {}
    for form in ("whole", "pre-split"):
        stage = PipelineStage(copy.deepcopy(modules[rank]), rank, 2)
        my_tower = copy.deepcopy(tower)
        schedule = ScheduleMPipe(stage, m, preprocess=my_tower, loss_fn=token_mean)
        losses: list[torch.Tensor] = []
        if form == "whole":
            schedule.step(data.ids, target=data.labels, losses=losses, preprocess_inputs=data.pixels)
        else:
            schedule.step(
                arg_mbs=[(ids,) for ids in data.ids.tensor_split(m)] if rank == 0 else None,
                target_mbs=list(data.labels.tensor_split(m)) if rank == 1 else None,
                losses=losses,
                preprocess_inputs=list(data.pixels.tensor_split(m)),
            )
        grads = [p.grad for p in [*stage.submod.parameters(), *my_tower.parameters()]]
        results[form] = (losses, grads)
    (whole_losses, whole_grads), (pre_losses, pre_grads) = results["whole"], results["pre-split"]
    assert all(g is not None for g in whole_grads)
    for got, want in zip(pre_grads, whole_grads, strict=True):
        close(got, want, "gradient, pre-split against the whole batch")
    if rank == 1:
        close(torch.stack(pre_losses), torch.stack(whole_losses), "losses, pre-split against the whole batch")
    stage = PipelineStage(copy.deepcopy(modules[rank]), rank, 2)
    schedule = ScheduleMPipe(stage, m, preprocess=copy.deepcopy(tower), loss_fn=token_mean)
    owned = schedule.owned_micros
    with pytest.raises(PipelineStepError, match=r"preprocess_inputs=...\) takes a list with one entry per"):
        schedule.step(
            arg_mbs=[(ids,) for ids in data.ids.tensor_split(m)] if rank == 0 else None,
            target_mbs=list(data.labels.tensor_split(m)) if rank == 1 else None,
            preprocess_inputs=data.pixels if owned else None,
        )
