"""Multi-process parity: every schedule against a single-process copy of the same model and data.

Each rank builds the whole model from one seed, keeps a deep copy as the
reference, and cuts its own stages out of another copy. Five training steps
later the pipeline's outputs, losses, every gradient and the parameters after
SGD must equal the reference's (fp32, rtol=1e-5, atol=1e-6).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hp_pipeline import (
    PipelineScheduleMulti,
    PipelineStage,
    PipelineStepError,
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
from torch import nn

RTOL, ATOL = 1e-5, 1e-6
WIDTH, BATCH, STEPS = 6, 24, 5


class Block(nn.Module):
    """``(h, mask) -> (tanh(linear(h)) * mask, mask)``: a float that needs grad, an int passed through."""

    def __init__(self, last: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.last = last

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> Any:
        h = torch.tanh(self.linear(h)) * mask.to(h.dtype)
        return h if self.last else (h, mask)


class Reference(nn.Module):
    def __init__(self, blocks: list[Block]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        out: Any = (h, mask)
        for block in self.blocks:
            out = block(*out) if isinstance(out, tuple) else out
        return out


def make_blocks(num_stages: int) -> list[Block]:
    torch.manual_seed(1234)
    return [Block(last=i == num_stages - 1) for i in range(num_stages)]


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    x = torch.randn(BATCH, WIDTH, generator=gen)
    mask = (torch.rand(BATCH, 1, generator=gen) > 0.2).long()
    y = torch.randn(BATCH, WIDTH, generator=gen)
    return x, mask, y


SCHEDULES = {
    # name: (class, world size, n_microbatches, stages per rank, placement)
    "gpipe-2": (ScheduleGPipe, 2, 4, 1, "loop"),
    "1f1b-4": (Schedule1F1B, 4, 8, 1, "loop"),
    "interleaved-2x2": (ScheduleInterleaved1F1B, 2, 4, 2, "loop"),
    "interleaved-4x2": (ScheduleInterleaved1F1B, 4, 4, 2, "loop"),
    "zb-h1-4": (ScheduleZeroBubble, 4, 6, 1, "loop"),
    "zbv-2": (ScheduleZBV, 2, 4, 2, "v"),
    # the schedules named after torch's: m equal to the stage count, and larger
    "looped-bfs-2x2-m4": (ScheduleLoopedBFS, 2, 4, 2, "loop"),
    "looped-bfs-2x2-m6": (ScheduleLoopedBFS, 2, 6, 2, "loop"),
    "looped-bfs-4x2-m8": (ScheduleLoopedBFS, 4, 8, 2, "loop"),
    "looped-bfs-4x2-m12": (ScheduleLoopedBFS, 4, 12, 2, "loop"),
    "interleaved-zb-2x2-m4": (ScheduleInterleavedZeroBubble, 2, 4, 2, "loop"),
    "interleaved-zb-2x2-m6": (ScheduleInterleavedZeroBubble, 2, 6, 2, "loop"),
    "interleaved-zb-4x2-m8": (ScheduleInterleavedZeroBubble, 4, 8, 2, "loop"),
    "interleaved-zb-4x2-m12": (ScheduleInterleavedZeroBubble, 4, 12, 2, "loop"),
    "zbv-zero-bubble-2-m6": (ScheduleZBVZeroBubble, 2, 6, 2, "v"),
    "zbv-zero-bubble-4-m8": (ScheduleZBVZeroBubble, 4, 8, 2, "v"),
    "zbv-zero-bubble-4-m12": (ScheduleZBVZeroBubble, 4, 12, 2, "v"),
    "dualpipev-2-m4": (ScheduleDualPipeV, 2, 4, 2, "v"),
    "dualpipev-2-m6": (ScheduleDualPipeV, 2, 6, 2, "v"),
    "dualpipev-4-m8": (ScheduleDualPipeV, 4, 8, 2, "v"),
    "dualpipev-4-m12": (ScheduleDualPipeV, 4, 12, 2, "v"),
}


def _params(name: str) -> Any:
    return pytest.param(
        name, marks=pytest.mark.distributed(world_size=SCHEDULES[name][1], timeout=90), id=name
    )


def build(
    name: str, rank: int, loss_fn: Any = None, **options: Any
) -> tuple[Any, list[PipelineStage], Reference]:
    cls, p, m, v, style = SCHEDULES[name]
    num_stages = p * v
    blocks = make_blocks(num_stages)
    reference = Reference(copy.deepcopy(blocks))
    mine = stages_on_rank(rank, p, v, style=style)
    stages = [PipelineStage(copy.deepcopy(blocks[s]), s, num_stages) for s in mine]
    if loss_fn is None:
        loss_fn = nn.functional.mse_loss
    schedule = cls(stages if v > 1 else stages[0], m, loss_fn, **options)
    return schedule, stages, reference


def close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("name", [_params(n) for n in SCHEDULES])
def test_schedule_matches_single_process(rank, world_size, name):
    check_parity(name, rank)


@pytest.mark.parametrize(
    ("name", "lookahead"),
    [
        pytest.param(
            n, k, marks=pytest.mark.distributed(world_size=SCHEDULES[n][1], timeout=90), id=f"{n}-{k}"
        )
        for n in ("1f1b-4", "interleaved-4x2", "zbv-2", "dualpipev-2-m6")
        for k in (1, 2)
    ],
)
def test_bounded_recv_lookahead_matches_single_process(rank, world_size, name, lookahead):
    """[Note: receive lookahead]: receives posted 1 or 2 compute steps ahead give the same results."""
    check_parity(name, rank, recv_lookahead=lookahead)


def check_parity(name: str, rank: int, **options: Any) -> None:
    schedule, stages, reference = build(name, rank, **options)
    _, _, m, _, _ = SCHEDULES[name]
    num_stages = schedule.num_stages
    opt = torch.optim.SGD([p for s in stages for p in s.submod.parameters()], lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(STEPS):
        x, mask, y = batch(step)
        opt.zero_grad()
        ref_opt.zero_grad()
        ref_out = reference(x, mask)
        ref_loss = nn.functional.mse_loss(ref_out, y)
        ref_loss.backward()
        ref_micro_losses = [
            nn.functional.mse_loss(reference(a, b), c).detach()
            for a, b, c in zip(x.tensor_split(m), mask.tensor_split(m), y.tensor_split(m), strict=True)
        ]
        losses: list[torch.Tensor] = []
        has_first = 0 in schedule._stages
        has_last = num_stages - 1 in schedule._stages
        out = schedule.step(*((x, mask) if has_first else ()), target=y if has_last else None, losses=losses)
        if has_last:
            close(out, ref_out.detach(), f"step {step} output")
            assert len(losses) == m
            for i, (got, want) in enumerate(zip(losses, ref_micro_losses, strict=True)):
                close(got, want, f"step {step} loss of micro-batch {i}")
        else:
            assert out is None and losses == []
        for stage in stages:
            ref_block = reference.blocks[stage.stage_index]
            for (pname, got), want in zip(
                stage.submod.named_parameters(), ref_block.parameters(), strict=True
            ):
                assert got.grad is not None, f"stage {stage.stage_index} {pname} has no grad"
                close(got.grad, want.grad, f"step {step} stage {stage.stage_index} {pname}.grad")
        opt.step()
        ref_opt.step()
        for stage in stages:
            ref_block = reference.blocks[stage.stage_index]
            for got, want in zip(stage.submod.parameters(), ref_block.parameters(), strict=True):
                close(got.detach(), want.detach(), f"step {step} stage {stage.stage_index} param")


@pytest.mark.distributed(world_size=2, timeout=60)
def test_forward_only_and_unscaled_grads(rank, world_size):
    # Without loss_fn the schedule runs forwards only; scale_grads=False sums micro-batch grads.
    blocks = make_blocks(2)
    reference = Reference(copy.deepcopy(blocks))
    stage = PipelineStage(copy.deepcopy(blocks[rank]), rank, 2)
    x, mask, y = batch(0)
    infer = Schedule1F1B(stage, 2)
    out = infer.step(x, mask) if rank == 0 else infer.step()
    if rank == 1:
        close(out, reference(x, mask).detach(), "forward-only output")
    assert all(p.grad is None for p in stage.submod.parameters())
    train = ScheduleGPipe(stage, 4, nn.functional.mse_loss, scale_grads=False)
    train.step(x, mask) if rank == 0 else train.step(target=y)
    nn.functional.mse_loss(reference(x, mask), y).backward()
    for got, want in zip(stage.submod.parameters(), reference.blocks[rank].parameters(), strict=True):
        close(got.grad, want.grad * 4, "unscaled grad (sum over 4 micro-batches)")


@pytest.mark.distributed(world_size=2, timeout=60)
def test_forward_only_dualpipev(rank, world_size):
    """Without loss_fn a pair runs its forward half only."""
    blocks = make_blocks(4)
    reference = Reference(copy.deepcopy(blocks))
    mine = stages_on_rank(rank, 2, 2, style="v")
    stages = [PipelineStage(copy.deepcopy(blocks[s]), s, 4) for s in mine]
    schedule = ScheduleDualPipeV(stages, 4)
    assert any(s.sub_steps is not None for s in schedule.order[rank])
    x, mask, _ = batch(0)
    out = schedule.step(x, mask) if rank == 0 else schedule.step()
    if rank == 0:  # the V puts the last stage on rank 0
        close(out, reference(x, mask).detach(), "forward-only output")
    else:
        assert out is None
    assert all(p.grad is None for s in stages for p in s.submod.parameters())


# -- failures ----------------------------------------------------------------------


class Exploding(nn.Module):
    """Wraps a block and raises in the forward of chosen calls."""

    def __init__(self, inner: nn.Module, fail_on_calls: set[int]) -> None:
        super().__init__()
        self.inner = inner
        self.calls = 0
        self.fail_on_calls = fail_on_calls

    def forward(self, *args: Any) -> Any:
        self.calls += 1
        if self.calls in self.fail_on_calls:
            raise ValueError(f"boom in call {self.calls}")
        return self.inner(*args)


@pytest.mark.parametrize(
    "schedule_name, failing_stage, fail_call",
    [
        pytest.param(
            "1f1b-4", 2, 2, marks=pytest.mark.distributed(world_size=4, timeout=60), id="1f1b-first-step"
        ),
        pytest.param(
            "1f1b-4", 0, 11, marks=pytest.mark.distributed(world_size=4, timeout=60), id="1f1b-later-step"
        ),
        pytest.param(
            "zbv-2", 3, 7, marks=pytest.mark.distributed(world_size=2, timeout=60), id="zbv-later-step"
        ),
        # call 7 of stage 3 is the forward half of the pair (3F2;0B0) on the second step
        pytest.param(
            "dualpipev-2-m4",
            3,
            7,
            marks=pytest.mark.distributed(world_size=2, timeout=60),
            id="dualpipev-in-a-pair",
        ),
    ],
)
def test_exception_reaches_every_rank(rank, world_size, schedule_name, failing_stage, fail_call):
    cls, p, m, v, style = SCHEDULES[schedule_name]
    num_stages = p * v
    blocks = make_blocks(num_stages)
    mine = stages_on_rank(rank, p, v, style=style)
    modules = {
        s: Exploding(copy.deepcopy(blocks[s]), {fail_call} if s == failing_stage else set()) for s in mine
    }
    stages = [PipelineStage(modules[s], s, num_stages) for s in mine]
    schedule = cls(stages if v > 1 else stages[0], m, nn.functional.mse_loss)
    failing_rank = next(r for r in range(p) if failing_stage in stages_on_rank(r, p, v, style=style))
    x, mask, y = batch(0)
    args = (x, mask) if 0 in mine else ()
    target = y if num_stages - 1 in mine else None
    raised = None
    for _ in range(3):  # the failure comes on the first step or on the second
        try:
            schedule.step(*args, target=target)
        except PipelineStepError as exc:
            raised = exc
            break
    assert raised is not None, "no rank saw the failure"
    text = str(raised)
    assert f"rank {failing_rank}" in text and f"boom in call {fail_call}" in text, text
    assert [f.rank for f in raised.failures] == [failing_rank]
    if rank == failing_rank:
        assert isinstance(raised.__cause__, ValueError)
    # Nothing hangs and the communicator still works: the next step runs on every rank.
    for stage in stages:
        stage.submod.zero_grad()
    losses: list[torch.Tensor] = []
    schedule.step(*args, target=target, losses=losses)
    if target is not None:
        assert len(losses) == m and all(torch.isfinite(t) for t in losses)
    dist.barrier()


@pytest.mark.distributed(world_size=2, timeout=60)
def test_missing_input_is_reported_everywhere(rank, world_size):
    blocks = make_blocks(2)
    stage = PipelineStage(copy.deepcopy(blocks[rank]), rank, 2)
    schedule = Schedule1F1B(stage, 2, nn.functional.mse_loss)
    with pytest.raises(PipelineStepError, match=r"rank 0 .*got no inputs"):
        schedule.step(target=batch(0)[2]) if rank == 1 else schedule.step()


# -- tied weights and global clipping ------------------------------------------------

VOCAB = 11


class First(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(self.embed(ids)))


class Mid(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(h))


class Last(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.linear(h)))


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


@pytest.mark.parametrize(
    "name",
    [
        pytest.param("1f1b", marks=pytest.mark.distributed(world_size=2, timeout=60)),
        pytest.param("zbv", marks=pytest.mark.distributed(world_size=2, timeout=60)),
    ],
)
def test_tied_embedding_and_global_clip(rank, world_size, name):
    v, style, cls = (1, "loop", Schedule1F1B) if name == "1f1b" else (2, "v", ScheduleZBV)
    num_stages = world_size * v
    torch.manual_seed(7)
    ref = nn.ModuleList([First(), *[Mid() for _ in range(num_stages - 2)], Last()])
    ref[-1].head.weight = ref[0].embed.weight  # the single-process model really shares the weight
    mine = stages_on_rank(rank, world_size, v, style=style)
    stages = [PipelineStage(copy.deepcopy(ref[s]), s, num_stages) for s in mine]
    with torch.no_grad():  # make the pipeline's copies start different: tie_parameters must fix it
        for stage in stages:
            if stage.stage_index == num_stages - 1:
                stage.submod.head.weight.add_(1.0)
    schedule = cls(stages if v > 1 else stages[0], 4, lm_loss)
    schedule.tie_parameters("embedding", {0: "embed.weight", num_stages - 1: "head.weight"})
    by_stage = {s.stage_index: s.submod for s in stages}
    if num_stages - 1 in by_stage:
        close(by_stage[num_stages - 1].head.weight.detach(), ref[0].embed.weight.detach(), "synced value")
    opt = torch.optim.SGD([p for s in stages for p in s.submod.parameters()], lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for step in range(3):
        gen = torch.Generator().manual_seed(step)
        ids = torch.randint(0, VOCAB, (8, 3), generator=gen)
        target = torch.randint(0, VOCAB, (8, 3), generator=gen)
        opt.zero_grad()
        ref_opt.zero_grad()
        h = ids
        for module in ref:
            h = module(h)
        lm_loss(h, target).backward()
        schedule.step(
            *((ids,) if 0 in by_stage else ()), target=target if num_stages - 1 in by_stage else None
        )
        tied_grad = ref[0].embed.weight.grad
        if 0 in by_stage:
            close(by_stage[0].embed.weight.grad, tied_grad, f"step {step} embedding grad")
        if num_stages - 1 in by_stage:
            close(by_stage[num_stages - 1].head.weight.grad, tied_grad, f"step {step} lm_head grad")
        norm = schedule.clip_grad_norm_(0.05)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        close(norm, ref_norm, f"step {step} global grad norm")
        assert norm > 0.05, "the test must actually clip"
        for stage in stages:
            for (pname, got), want in zip(
                stage.submod.named_parameters(), ref[stage.stage_index].parameters(), strict=True
            ):
                close(got.grad, want.grad, f"step {step} stage {stage.stage_index} {pname}.grad after clip")
        opt.step()
        ref_opt.step()
        for stage in stages:
            for got, want in zip(stage.submod.parameters(), ref[stage.stage_index].parameters(), strict=True):
                close(got.detach(), want.detach(), f"step {step} stage {stage.stage_index} param")


# -- FSDP protocol, meta-device stages -----------------------------------------------


class FakeSharded(nn.Module):
    """Implements the FSDP protocol by counting calls and checking when they happen."""

    def __init__(self, inner: nn.Module, name: str = "", log: list[str] | None = None) -> None:
        super().__init__()
        self.inner = inner
        self.name = name
        self.log: list[str] = [] if log is None else log
        self.gathered = False
        self.sync = True

    def _note(self, what: str) -> None:
        self.log.append(f"{self.name}{what}")

    def unshard(self, async_op: bool = False) -> None:
        self._note("unshard")
        self.gathered = True

    def reshard(self) -> None:
        self._note("reshard")
        self.gathered = False

    def set_requires_gradient_sync(self, requires: bool) -> None:
        self._note(f"sync={requires}")
        self.sync = requires

    def set_reshard_after_backward(self, reshard: bool) -> None:
        self._note(f"reshard_after_backward={reshard}")

    def reduce_grad(self) -> None:
        assert self.sync, "reduce_grad must run with gradient sync on"
        self._note("reduce_grad")

    def forward(self, *args: Any) -> Any:
        assert self.gathered, f"forward of unit {self.name!r} ran on resharded parameters"
        self._note("F")
        return self.inner(*args)


class FakeShardedWithFlag(FakeSharded):
    """A unit that also exposes ``reshard_after_forward``, which the executor turns off for the step."""

    def __init__(self, inner: nn.Module, name: str, log: list[str]) -> None:
        super().__init__(inner, name, log)
        self.reshard_after_forward: bool | None = None  # the fully_shard default: True but on the root

    def set_reshard_after_forward(self, value: bool | None, *, recurse: bool = True) -> None:
        assert recurse is False, "the executor sets this flag unit by unit"
        self._note(f"reshard_after_forward={value}")
        self.reshard_after_forward = value


@pytest.mark.distributed(world_size=2, timeout=60)
def test_fsdp_protocol_calls(rank, world_size):
    blocks = make_blocks(2)
    module = FakeSharded(copy.deepcopy(blocks[rank]))
    stage = PipelineStage(module, rank, 2)
    schedule = Schedule1F1B(stage, 4, nn.functional.mse_loss)
    assert any(s.type.is_fsdp for s in schedule.order[rank])
    x, mask, y = batch(0)
    for _ in range(2):
        module.log.clear()
        schedule.step(x, mask) if rank == 0 else schedule.step(target=y)
        log = module.log
        assert log.count("unshard") == 1 and log.count("reshard") == 1 and log.count("reduce_grad") == 1
        assert log.count("F") == 4
        assert log[:3] == ["sync=False", "reshard_after_backward=False", "unshard"]
        assert log[-4:] == ["sync=True", "reduce_grad", "reshard_after_backward=True", "reshard"]


@pytest.mark.distributed(world_size=2, timeout=60)
def test_fsdp_protocol_reaches_nested_units(rank, world_size):
    """Blocks wrapped inside a wrapped stage: every unit is gathered and resharded, the outer one reduces."""
    blocks = make_blocks(2)
    log: list[str] = []
    inner = FakeShardedWithFlag(copy.deepcopy(blocks[rank]), "inner:", log)
    module = FakeSharded(inner, "outer:", log)
    stage = PipelineStage(module, rank, 2)
    schedule = Schedule1F1B(stage, 4, nn.functional.mse_loss)
    x, mask, y = batch(0)
    for _ in range(2):
        log.clear()
        schedule.step(x, mask) if rank == 0 else schedule.step(target=y)
        assert log[:4] == [
            "outer:sync=False",
            "outer:reshard_after_backward=False",  # the outer unit's setters cover the units below
            "inner:reshard_after_forward=False",  # per unit: no micro-batch frees what UNSHARD gathered
            "outer:unshard",
        ]
        assert log[4] == "inner:unshard"
        assert log.count("outer:F") == log.count("inner:F") == 4
        assert log[-6:] == [
            "outer:sync=True",
            "outer:reduce_grad",  # covers the nested unit: one reduction per unit
            "outer:reshard_after_backward=True",
            "inner:reshard_after_forward=None",  # put back as it was read
            "outer:reshard",
            "inner:reshard",  # every unit holds its shards after the step
        ]
        assert log.count("inner:reshard") == 1 and log.count("inner:reduce_grad") == 0
        assert not inner.gathered and not module.gathered


@pytest.mark.distributed(world_size=2, timeout=60)
def test_stage_built_on_meta(rank, world_size):
    blocks = make_blocks(2)
    with torch.device("meta"):
        module = Block(last=rank == 1)
    stage = PipelineStage(module, rank, 2)
    assert stage.device.type != "meta"
    schedule = ScheduleGPipe(stage, 2, nn.functional.mse_loss)
    x, mask, y = batch(0)
    args, target = ((x, mask), None) if rank == 0 else ((), y)
    with pytest.raises(PipelineStepError, match="meta device"):
        schedule.step(*args, target=target)
    module.to_empty(device=stage.device)
    module.load_state_dict(blocks[rank].state_dict())
    schedule.step(*args, target=target)
    if rank == 1:
        assert all(m.shape == (BATCH // 2, WIDTH) for m in stage.inputs_meta[0][:1])
        assert stage.inputs_meta[0][1].dtype == torch.int64 and not stage.inputs_meta[0][1].requires_grad


@pytest.mark.distributed(world_size=2, timeout=60)
def test_schedule_rejects_wrong_placement(rank, world_size):
    with pytest.raises(ValueError, match=rf"rank {rank} of 2 must host stages \[{rank}\]"):
        Schedule1F1B(PipelineStage(nn.Linear(2, 2), 1 - rank, 2), 2)
    with pytest.raises(ValueError, match=r"runs 4 stages.*num_stages=\[2\]"):
        ScheduleInterleaved1F1B([PipelineStage(nn.Linear(2, 2), rank, 2)] * 2, 2)
    with pytest.raises(ValueError, match="exactly 2 stages per rank"):
        ScheduleZBV([PipelineStage(nn.Linear(2, 2), rank, 4)], 2)
    with pytest.raises(ValueError, match=r"must host stages \[0, 3\]|must host stages \[1, 2\]"):
        ScheduleZBV([PipelineStage(nn.Linear(2, 2), rank, 4), PipelineStage(nn.Linear(2, 2), rank + 2, 4)], 2)


@pytest.mark.distributed(world_size=2, timeout=60)
def test_bad_configurations_fail_before_any_communication(rank, world_size, monkeypatch):
    """Each error names the value and the fix, raised while building: no rank has communicated."""

    def communicated(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a bad configuration reached torch.distributed communication")

    for name in (
        "isend",
        "irecv",
        "send",
        "recv",
        "batch_isend_irecv",
        "all_reduce",
        "all_gather",
        "all_gather_object",
        "broadcast",
        "broadcast_object_list",
        "barrier",
    ):
        monkeypatch.setattr(dist, name, communicated)

    def stage(index: int, num_stages: int = 4) -> PipelineStage:
        return PipelineStage(nn.Linear(2, 2), index, num_stages)

    v_stages = [stage(s) for s in stages_on_rank(rank, 2, 2, style="v")]
    loop_stages = [stage(s) for s in stages_on_rank(rank, 2, 2)]
    with pytest.raises(ValueError, match=r"n_microbatches=3; use n_microbatches >= 4"):
        ScheduleDualPipeV(v_stages, 3)
    with pytest.raises(
        ValueError, match=r"ScheduleDualPipeV: rank \d of 2 must host stages \[(0, 3|1, 2)\] \(v"
    ):
        ScheduleDualPipeV(loop_stages, 4)
    with pytest.raises(ValueError, match=r"ScheduleDualPipeV runs exactly 2 stages per rank .*, got 1"):
        ScheduleDualPipeV(v_stages[:1], 4)
    with pytest.raises(
        ValueError, match=r"ScheduleLoopedBFS: rank \d of 2 must host stages \[(0, 2|1, 3)\] \(loop"
    ):
        ScheduleLoopedBFS(v_stages, 4)
    with pytest.raises(ValueError, match=r"stages_on_rank\(\d, 2, 2, style='loop'\)"):
        ScheduleInterleavedZeroBubble(v_stages, 4)
    with pytest.raises(ValueError, match=r"n_microbatches=5 cannot be split .* e\.g\. 4 or 6"):
        ScheduleInterleavedZeroBubble(loop_stages, 5)
    with pytest.raises(
        ValueError, match=r"ScheduleLoopedBFS over 2 ranks .* runs 4 stages.*num_stages=\[2\]"
    ):
        ScheduleLoopedBFS([stage(rank, 2), stage(1 - rank, 2)], 4)
    with pytest.raises(TypeError, match="PipelineScheduleMulti is a base class"):
        PipelineScheduleMulti(loop_stages, 4)
    # The same stages in the right schedule build, still without communicating.
    ScheduleDualPipeV(v_stages, 4)
    ScheduleLoopedBFS(loop_stages, 4)
    ScheduleInterleavedZeroBubble(loop_stages, 6)
