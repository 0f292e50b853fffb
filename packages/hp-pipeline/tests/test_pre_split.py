"""torch's newest ``step(arg_mbs=, kwarg_mbs=, target_mbs=)``, as torchtitan calls it, and meshes as groups.

The pre-split form must give what the whole batch gives when the pieces are
the same, and what one process gives on the same pieces when they are not
(uneven, chosen by the caller): losses and every gradient. Keyword inputs
reach every stage of the rank they are given on, as in torch, so a
per-micro-batch gate passed through ``kwarg_mbs`` on every rank scales each
stage's output ([Note: pre-split micro-batches] in ``hp_pipeline._torch_api``).
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

import hp_core
import hp_pipeline
import pytest
import torch
import torch.distributed as dist
from hp_pipeline import (
    PipelineStage,
    PipelineStepError,
    Schedule1F1B,
    ScheduleInterleaved1F1B,
    ScheduleMPipe,
    stages_on_rank,
)
from hp_pipeline.schedules import PipelineSchedule
from torch import nn

tps = pytest.importorskip("torch.distributed.pipelining.schedules")

RTOL, ATOL = 1e-5, 1e-6
WIDTH = 4
M = 4

STEP_NAMES = [
    "args",
    "target",
    "losses",
    "return_outputs",
    "loss_kwargs",
    "arg_mbs",
    "kwarg_mbs",
    "target_mbs",
    "kwargs",
]
"""torch's newest ``step`` (nightly, 2026): its 2.13 keywords, then the pre-split lists, then ``**kwargs``."""


def close(actual: Any, expected: Any, what: str) -> None:
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


def _schedule_classes() -> list[type]:
    return [
        obj
        for obj in vars(hp_pipeline).values()
        if isinstance(obj, type) and issubclass(obj, PipelineSchedule) and obj is not PipelineSchedule
    ]


def test_step_and_eval_name_torchs_keywords_in_torchs_order() -> None:
    installed = [n for n in inspect.signature(tps.PipelineScheduleSingle.step).parameters if n != "self"]
    # What the installed torch has comes first, in its order; the pre-split lists follow loss_kwargs.
    if "arg_mbs" in installed:
        assert installed == STEP_NAMES, installed
    else:  # torch 2.13: the same keywords without the lists
        assert [n for n in STEP_NAMES if n in installed] == installed, installed
    classes = _schedule_classes()
    assert len(classes) >= 11
    for cls in classes:
        names = [n for n in inspect.signature(cls.step).parameters if n != "self"]
        if cls is ScheduleMPipe:  # its own keywords sit between torch's and **kwargs
            assert names == [*STEP_NAMES[:-1], "data", "preprocess_inputs", "kwargs"], names
        else:
            assert names == STEP_NAMES, (cls.__name__, names)
        params = inspect.signature(cls.step).parameters
        assert all(
            params[n].kind is inspect.Parameter.KEYWORD_ONLY for n in ("arg_mbs", "kwarg_mbs", "target_mbs")
        )
        evals = [n for n in inspect.signature(cls.eval).parameters if n != "self"]
        assert evals == ["args", "target", "losses", "arg_mbs", "kwarg_mbs", "target_mbs", "kwargs"], evals


# -- parity on two ranks -------------------------------------------------------------------------------


class GatedBlock(nn.Module):
    """A stage whose forward takes a keyword input, as torchtitan's blocks take masks."""

    def __init__(self, out: int) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, out)

    def forward(self, h: torch.Tensor, *, gate: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(h)) * gate


def _chain(num_stages: int) -> list[nn.Module]:
    torch.manual_seed(5)
    return [GatedBlock(WIDTH if s < num_stages - 1 else 2) for s in range(num_stages)]


def _reference_loss(
    modules: list[nn.Module], x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    h = x
    for module in modules:
        h = module(h, gate=gate)
    return nn.functional.mse_loss(h, y)


def _batch(rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(rows, WIDTH, generator=gen)
    gate = torch.rand(rows, 1, generator=gen) + 0.5
    y = torch.randn(rows, 2, generator=gen)
    return x, gate, y


CASES = {"1f1b": (Schedule1F1B, 1), "interleaved1f1b": (ScheduleInterleaved1F1B, 2)}


def _built(rank: int, case: str) -> tuple[Any, list[PipelineStage], list[nn.Module], list[int]]:
    cls, v = CASES[case]
    num_stages = 2 * v
    modules = _chain(num_stages)
    mine = stages_on_rank(rank, 2, v, style="loop")
    stages = [PipelineStage(copy.deepcopy(modules[s]), s, num_stages) for s in mine]
    schedule = cls(stages if v > 1 else stages[0], M, nn.functional.mse_loss)
    return schedule, stages, modules, mine


def _grads(stages: list[PipelineStage]) -> list[torch.Tensor]:
    return [p.grad.clone() for s in stages for p in s.submod.parameters()]


def _zero(stages: list[PipelineStage]) -> None:
    for s in stages:
        s.submod.zero_grad(set_to_none=True)


def _lists(pieces: list[tuple[torch.Tensor, ...]], first: bool, last: bool) -> dict[str, Any]:
    """torchtitan's call: ``arg_mbs`` where stage 0 is, ``kwarg_mbs`` on every rank, targets on the last."""
    return {
        "arg_mbs": [(xi,) for xi, _, _ in pieces] if first else None,
        "kwarg_mbs": [{"gate": gi} for _, gi, _ in pieces],
        "target_mbs": [yi for _, _, yi in pieces] if last else None,
    }


@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=pytest.mark.distributed(world_size=2, timeout=90), id=c) for c in CASES]
)
def test_pre_split_matches_whole_batch_and_one_process(rank: int, world_size: int, case: str) -> None:
    schedule, stages, modules, mine = _built(rank, case)
    first, last = 0 in mine, len(modules) - 1 in mine
    x, gate, y = _batch(10)  # 10 rows over 4 micro-batches: pieces of 3, 3, 2, 2

    # The whole batch: every rank passes the keyword input (it reaches each of its stages).
    whole: list[torch.Tensor] = []
    out_whole = schedule.step(
        *((x,) if first else ()), gate=gate, **({"target": y, "losses": whole} if last else {})
    )
    grads_whole = _grads(stages)
    _zero(stages)

    # The same pieces, pre-split, torchtitan's way.
    pieces = list(zip(x.tensor_split(M), gate.tensor_split(M), y.tensor_split(M), strict=True))
    pre: list[torch.Tensor] = []
    out_pre = schedule.step(**_lists(pieces, first, last), losses=pre if last else None)
    for got, want in zip(_grads(stages), grads_whole, strict=True):
        close(got, want, "gradient, pre-split against the whole batch")
    reference = copy.deepcopy(modules)
    torch.stack([_reference_loss(reference, *piece) for piece in pieces]).mean().backward()
    want_losses = torch.stack([_reference_loss(reference, *p) for p in pieces]).detach()
    for s, stage in zip(mine, stages, strict=True):
        for got, want in zip(stage.submod.parameters(), reference[s].parameters(), strict=True):
            close(got.grad, want.grad, f"stage {s} gradient against one process")
    if last:
        close(torch.stack(pre), torch.stack(whole), "losses, pre-split against the whole batch")
        close(torch.stack(pre), want_losses, "losses against one process")
        close(out_pre, out_whole, "merged output")
    else:
        assert out_pre is None and out_whole is None

    # Pieces of the caller's choosing (uneven, not tensor_split's), against one process. Shapes are
    # fixed at a schedule's first step, so these run on a schedule of their own.
    schedule, stages, modules, mine = _built(rank, case)
    cuts = [4, 1, 2, 3]
    uneven = list(zip(x.split(cuts), gate.split(cuts), y.split(cuts), strict=True))
    losses: list[torch.Tensor] = []
    schedule.step(**_lists(uneven, first, last), losses=losses if last else None, return_outputs=False)
    reference = copy.deepcopy(modules)
    ref_losses = torch.stack([_reference_loss(reference, *piece) for piece in uneven])
    ref_losses.mean().backward()
    for s, stage in zip(mine, stages, strict=True):
        for got, want in zip(stage.submod.parameters(), reference[s].parameters(), strict=True):
            close(got.grad, want.grad, f"stage {s} gradient, uneven pieces")
    if last:
        close(torch.stack(losses), ref_losses.detach(), "losses, uneven pieces")

    # eval takes the pre-split form too (torchtitan's validator): losses, no gradient touched.
    before = _grads(stages)
    evals: list[torch.Tensor] = []
    schedule.eval(**_lists(uneven, first, last), losses=evals if last else None)
    for got, want in zip(_grads(stages), before, strict=True):
        assert torch.equal(got, want), "eval changed a gradient"
    if last:
        close(torch.stack(evals), ref_losses.detach(), "eval losses, pre-split")


PRE_SPLIT_BAD = {
    # name: (rank 0's call, rank 1's call, message)
    "a batch and arg_mbs": (
        lambda s, x, g, y: s.step(x, arg_mbs=[(x,)] * M),
        lambda s, x, g, y: s.step(target_mbs=[y] * M),
        r"step\(\) got 1 positional input\(s\) and pre-split inputs; the two forms cannot be mixed: pass "
        r"micro-batch k's positional inputs as arg_mbs\[k\]",
    ),
    "a model keyword and kwarg_mbs": (
        lambda s, x, g, y: s.step(arg_mbs=[(x,)] * M, gate=g),
        lambda s, x, g, y: s.step(target_mbs=[y] * M),
        r"step\(\) got the model keyword\(s\) \['gate'\] and pre-split inputs; .* pass micro-batch k's "
        r"keyword inputs as kwarg_mbs\[k\]",
    ),
    "target and target_mbs": (
        lambda s, x, g, y: s.step(arg_mbs=[(x,)] * M),
        lambda s, x, g, y: s.step(target=y, target_mbs=[y] * M),
        r"step\(\) got target= and pre-split inputs; .* pass micro-batch k's target as target_mbs\[k\]",
    ),
    "arg_mbs shorter than n_microbatches": (
        lambda s, x, g, y: s.step(arg_mbs=[(x,)] * (M - 1)),
        lambda s, x, g, y: s.step(target_mbs=[y] * M),
        rf"step\(arg_mbs=...\) has {M - 1} entries but the schedule runs n_microbatches={M}; pass one "
        rf"entry per micro-batch, or build the schedule with n_microbatches={M - 1}",
    ),
    "target_mbs longer than n_microbatches": (
        lambda s, x, g, y: s.step(arg_mbs=[(x,)] * M),
        lambda s, x, g, y: s.step(target_mbs=[y] * (M + 2)),
        rf"step\(target_mbs=...\) has {M + 2} entries but the schedule runs n_microbatches={M}",
    ),
    "arg_mbs a tuple": (
        lambda s, x, g, y: s.step(arg_mbs=((x,),) * M),
        lambda s, x, g, y: s.step(target_mbs=[y] * M),
        r"step\(arg_mbs=...\) takes a list with one entry per micro-batch, got a tuple; pass a list of "
        rf"n_microbatches={M} entries",
    ),
    "arg_mbs of bare tensors": (
        lambda s, x, g, y: s.step(arg_mbs=[x] * M),
        lambda s, x, g, y: s.step(target_mbs=[y] * M),
        r"step\(arg_mbs=...\) must be a list of tuples, but arg_mbs\[0\] is a Tensor; e.g. "
        r"arg_mbs=\[\(x0,\), \(x1,\)\]",
    ),
    "kwarg_mbs of tuples": (
        lambda s, x, g, y: s.step(arg_mbs=[(x,)] * M, kwarg_mbs=[("gate", g)] * M),
        lambda s, x, g, y: s.step(target_mbs=[y] * M),
        r"step\(kwarg_mbs=...\) must be a list of dicts, but kwarg_mbs\[0\] is a tuple",
    ),
    "no target_mbs on the last stage": (
        lambda s, x, g, y: s.step(arg_mbs=[(x,)] * M),
        lambda s, x, g, y: s.step(kwarg_mbs=[{}] * M),
        r"rank 1 hosts the last stage \(1\) and the schedule has a loss_fn, but step\(\) got "
        r"target_mbs=None; pass the batch's targets there, e.g. schedule.step\(target_mbs=",
    ),
    "no arg_mbs on stage 0": (
        lambda s, x, g, y: s.step(target_mbs=[y] * M),
        lambda s, x, g, y: s.step(target_mbs=[y] * M),
        r"rank 0 hosts stage 0 but step\(\) got kwarg_mbs/target_mbs and no arg_mbs",
    ),
}


class Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, h: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        return self.linear(h) if gate is None else self.linear(h) * gate


@pytest.mark.parametrize(
    "case",
    [pytest.param(c, marks=pytest.mark.distributed(world_size=2, timeout=60), id=c) for c in PRE_SPLIT_BAD],
)
def test_bad_pre_split_inputs_raise_on_every_rank(rank: int, world_size: int, case: str) -> None:
    """A bad call on one rank: every rank raises the same error, before any compute; the next step runs."""
    first_call, last_call, message = PRE_SPLIT_BAD[case]
    torch.manual_seed(0)
    stage = PipelineStage(Plain(), rank, 2)
    schedule = Schedule1F1B(stage, M, nn.functional.mse_loss)
    x, g, y = torch.randn(2, WIDTH), torch.rand(2, 1), torch.randn(2, WIDTH)
    call = first_call if rank == 0 else last_call
    with pytest.raises(PipelineStepError, match=message):
        call(schedule, x, g, y)
    assert all(p.grad is None for p in stage.submod.parameters()), "a refused step computed"
    schedule.step(arg_mbs=[(x,)] * M) if rank == 0 else schedule.step(target_mbs=[y] * M)
    assert all(p.grad is not None for p in stage.submod.parameters())


# -- a DeviceMesh where a group is taken -----------------------------------------------------------------


@pytest.mark.distributed(world_size=2, timeout=60)
def test_a_mesh_is_taken_as_its_own_group(rank: int, world_size: int, monkeypatch: Any) -> None:
    """torch's and our 1-D meshes stand for the group they hold: the same object, no new group."""
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh

    ours = hp_core.init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    theirs = torch_mesh("cpu", (2,), mesh_dim_names=("pp",))

    def no_new_group(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a process group was created for a mesh that already holds one")

    monkeypatch.setattr(dist, "new_group", no_new_group)
    torch.manual_seed(0)
    module = Plain()
    for mesh in (ours, theirs):
        stage = PipelineStage(copy.deepcopy(module), rank, 2, group=mesh)
        assert stage.group is mesh.get_group()
        schedule = Schedule1F1B(stage, 2, nn.functional.mse_loss)
        x, y = torch.randn(4, WIDTH), torch.randn(4, WIDTH)
        schedule.step(x) if rank == 0 else schedule.step(target=y)
        assert all(p.grad is not None for p in stage.submod.parameters())
    two_d = torch_mesh("cpu", (1, 2), mesh_dim_names=("dp", "pp"))
    with pytest.raises(
        ValueError, match=r"group is a 2-D torch DeviceMesh .* pass the one dimension it runs over"
    ):
        PipelineStage(Plain(), rank, 2, group=two_d)


def test_get_mesh_is_taken_and_checked() -> None:
    def get_mesh(names: tuple[str, ...], layout: Any) -> Any:
        return None

    stage = PipelineStage(nn.Linear(2, 2), 0, 1, "cpu", group=None, get_mesh=get_mesh)
    assert stage.get_mesh is get_mesh
    with pytest.raises(
        TypeError, match=r"get_mesh='tp' is a str, not a callable; pass torch's GetMeshCallback"
    ):
        PipelineStage(nn.Linear(2, 2), 0, 1, "cpu", get_mesh="tp")
