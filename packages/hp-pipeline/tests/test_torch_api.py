"""torch.distributed.pipelining's calls on our schedules: signatures, step()'s keywords, eval, specs.

A user moving from torch keeps their calls. What torch takes and we take too
must mean the same (``loss_kwargs`` reaching the loss, ``return_outputs``,
``eval``, torch's spec objects, ``output_merge_spec`` in torch's form,
``PipelineStage(submodule=...)``); a structured target is split per
micro-batch, not handed whole to each. The multi-process tests compare with
a single-process copy of the same model on the same data.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from collections import namedtuple
from typing import Any

import hp_pipeline
import pytest
import torch
from hp_pipeline import (
    REPLICATE,
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
    TensorChunkSpec,
    _checks,
    merge_chunks,
    microbatch,
    split_args_kwargs,
    stages_on_rank,
)
from hp_pipeline.schedules import PipelineSchedule
from torch import nn

tmb = pytest.importorskip("torch.distributed.pipelining.microbatch")
tps = pytest.importorskip("torch.distributed.pipelining.schedules")
tstage = pytest.importorskip("torch.distributed.pipelining.stage")

RTOL, ATOL = 1e-5, 1e-6
WIDTH = 4


def close(actual: Any, expected: Any, what: str) -> None:
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


# -- signatures ------------------------------------------------------------------------------------

TORCH_CLASSES = [
    "PipelineScheduleSingle",
    "PipelineScheduleMulti",
    "ScheduleGPipe",
    "Schedule1F1B",
    "ScheduleInterleaved1F1B",
    "ScheduleLoopedBFS",
    "ScheduleInterleavedZeroBubble",
    "ScheduleZBVZeroBubble",
    "ScheduleDualPipeV",
]


def _names(init: Any) -> list[str]:
    return [n for n in inspect.signature(init).parameters if n != "self"]


@pytest.mark.parametrize("name", TORCH_CLASSES)
def test_constructor_names_torchs_arguments_in_torchs_order(name: str) -> None:
    ours, theirs = _names(getattr(hp_pipeline, name).__init__), _names(getattr(tps, name).__init__)
    assert ours[:3] == theirs[:3]
    positions = [ours.index(n) if n in ours else -1 for n in theirs]
    missing = [n for n in theirs if n not in ours]
    assert not missing, f"{name} lacks torch's {missing}"
    assert positions == sorted(positions), f"{name}: torch's order {theirs}, ours {ours}"
    # Ours follow torch's, keyword-only (as they always were here).
    params = inspect.signature(getattr(hp_pipeline, name).__init__).parameters
    assert ours[-3:] == ["abort_timeout", "recv_lookahead", "swap_policy"]
    assert all(params[n].kind is inspect.Parameter.KEYWORD_ONLY for n in ours[3:])


def test_every_schedule_shows_its_options_and_takes_them() -> None:
    classes = [
        obj
        for obj in vars(hp_pipeline).values()
        if isinstance(obj, type) and issubclass(obj, PipelineSchedule) and obj is not PipelineSchedule
    ]
    assert len(classes) >= 11, classes
    for cls in classes:
        params = inspect.signature(cls).parameters.values()
        assert all(p.kind is not inspect.Parameter.VAR_KEYWORD for p in params), cls.__name__
        shown = {p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY}
        assert cls._options <= shown, (cls.__name__, cls._options - shown)
    assert "preprocess" in inspect.signature(hp_pipeline.ScheduleMPipe).parameters


def test_a_subclass_signature_leaves_its_parents_alone() -> None:
    """torch's base PipelineScheduleMulti takes use_full_backward; its schedules take defer_pp_recv."""
    base, child = _names(PipelineScheduleMulti.__init__), _names(ScheduleInterleaved1F1B.__init__)
    assert "use_full_backward" in base and "defer_pp_recv" not in base
    assert "defer_pp_recv" in child and "use_full_backward" not in child
    assert ScheduleGPipe.__init__ is not PipelineScheduleSingle.__init__
    assert ScheduleGPipe.__init__.__qualname__ == "ScheduleGPipe.__init__"
    assert _names(ScheduleGPipe.__init__) == _names(PipelineScheduleSingle.__init__)
    assert "defer_pp_recv" in _names(ScheduleDualPipeV.__init__)


def test_pipeline_stage_takes_torchs_argument_names() -> None:
    ours = _names(PipelineStage.__init__)
    theirs = _names(tstage.PipelineStage.__init__)
    assert ours[:4] == theirs[:4] == ["submodule", "stage_index", "num_stages", "device"]
    # torch's keywords we take, in torch's order: group=, then get_mesh= (torch 2.13's last).
    assert ours[4:] == ["group", "get_mesh"] and theirs[-1] == "get_mesh"
    assert [n for n in theirs if n in ours] == ours
    stage = PipelineStage(submodule=nn.Linear(2, 2), stage_index=0, num_stages=1, device="cpu")
    assert isinstance(stage.submod, nn.Linear)
    # torch's arguments we cannot honour are refused by Python, not silently dropped.
    for name in ("input_args", "output_args", "output_grads", "input_grads", "dw_builder"):
        with pytest.raises(TypeError, match=name):
            PipelineStage(nn.Linear(2, 2), 0, 1, **{name: None})


# -- torch's spec objects ---------------------------------------------------------------------------


def test_torch_chunk_specs_are_taken_as_ours() -> None:
    as_chunk_spec = microbatch.as_chunk_spec
    assert as_chunk_spec(tmb.TensorChunkSpec(1)) == TensorChunkSpec(1)
    assert as_chunk_spec(tmb._Replicate()) is REPLICATE and as_chunk_spec(tmb._Replicate) is REPLICATE
    _checks.check_chunk_specs("here", tmb.TensorChunkSpec.from_tuple((0, 1)), {"m": tmb._Replicate()})
    x = torch.arange(24.0).reshape(4, 6)
    args, kwargs = split_args_kwargs(
        (x, x), {"m": x}, 2, tmb.TensorChunkSpec.from_tuple((0, 1)), {"m": tmb._Replicate()}
    )
    assert [a[0].shape for a in args] == [torch.Size([2, 6])] * 2
    assert [a[1].shape for a in args] == [torch.Size([4, 3])] * 2
    assert all(k["m"] is x for k in kwargs)


def test_output_merge_spec_in_torchs_form_merges_as_torch() -> None:
    single = [torch.ones(2, 3), torch.zeros(1, 3)]
    pairs = [(torch.ones(2, 3), torch.ones(3, 2)), (torch.zeros(2, 3), torch.zeros(3, 1))]
    scalars = [(torch.ones(2), torch.tensor(1.0)), (torch.zeros(2), torch.tensor(2.0))]
    cases = [
        (single, (tmb.TensorChunkSpec(0),)),  # a 1-tuple back, as torch gives it
        (pairs, [tmb.TensorChunkSpec(0), tmb.TensorChunkSpec(1)]),
        (pairs, (tmb.TensorChunkSpec(1), tmb.TensorChunkSpec(1))),
        (scalars, (tmb.TensorChunkSpec(0), tmb.sum_reducer)),
        ([(t, 7) for t in single], (tmb.TensorChunkSpec(0), None)),  # None: the same value from each
    ]
    for chunks, spec in cases:
        want = tmb.merge_chunks(list(chunks), spec)
        got = merge_chunks(chunks, spec)
        assert type(got) is type(want) and len(got) == len(want), spec
        for g, w in zip(got, want, strict=True):
            if isinstance(w, torch.Tensor):
                close(g, w, f"merge by {spec}")
            else:
                assert g == w, spec
    # Ours spelled the same way, and ints as leaves.
    close(merge_chunks(pairs, (TensorChunkSpec(0), 1))[1], torch.cat([p[1] for p in pairs], 1), "int leaf")
    assert merge_chunks([(t, 3) for t in single], (0, REPLICATE))[1] == 3
    with pytest.raises(ValueError, match=r"1 leaves but micro-batch 0's output .* has 2 \(a tuple of 2\)"):
        merge_chunks(pairs, (TensorChunkSpec(0),))
    with pytest.raises(ValueError, match=r"output leaf 1 has the merge spec REPLICATE but micro-batch 1"):
        merge_chunks(scalars, (0, REPLICATE))


# -- micro-batches of structured values ------------------------------------------------------------------

Pair = namedtuple("Pair", ["a", "b"])


def test_tensors_inside_arguments_are_split() -> None:
    """torch splits every tensor of the argument tree; a tuple of tensors was handed whole to each piece."""
    x = torch.arange(10.0).reshape(10, 1)
    words = ["no", "tensor"]
    args, kwargs = split_args_kwargs(((x, "tag"), words), {"d": {"k": x, "n": 3}, "p": Pair(x, 1)}, 4)
    assert [a[0][0].shape[0] for a in args] == [3, 3, 2, 2]
    assert all(a[0][1] == "tag" and isinstance(a[0], tuple) for a in args)
    assert all(a[1] is words for a in args)  # no tensor inside: the same object
    torch.testing.assert_close(torch.cat([k["d"]["k"] for k in kwargs]), x)
    assert all(k["d"]["n"] == 3 and isinstance(k["p"], Pair) and k["p"].b == 1 for k in kwargs)
    torch.testing.assert_close(torch.cat([k["p"].a for k in kwargs]), x)


def test_split_target_cuts_every_tensor_in_it() -> None:
    split_target = microbatch.split_target
    y, w = torch.arange(6.0).reshape(6, 1), torch.arange(6.0) * 10
    for target in [(y, w), {"labels": y, "weights": w}, [y, w]]:
        pieces = split_target(target, 4)
        assert len(pieces) == 4 and all(type(p) is type(target) for p in pieces)
        values = [list(p.values()) if isinstance(p, dict) else list(p) for p in pieces]
        torch.testing.assert_close(torch.cat([v[0] for v in values]), y)
        torch.testing.assert_close(torch.cat([v[1] for v in values]), w)
    assert [p.shape[0] for p in split_target(y, 4)] == [2, 2, 1, 1]
    with pytest.raises(ValueError, match=r"target\[1\] has size 6 along dim 0 but .* n_microbatches=8"):
        split_target((torch.ones(8), w), 8)


# -- step() and eval() on two ranks ----------------------------------------------------------------


class Head(nn.Module):
    """A forward without ``**kwargs``: a keyword meant for the loss that reached it would raise."""

    def __init__(self, out: int) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, out)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(h))


def _chain(num_stages: int, out: int = 2) -> list[nn.Module]:
    torch.manual_seed(7)
    return [Head(WIDTH if s < num_stages - 1 else out) for s in range(num_stages)]


def _reference(modules: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
    for module in modules:
        x = module(x)
    return x


def _data(batch: int, out: int = 2) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(batch, WIDTH, generator=gen)
    y = torch.randn(batch, out, generator=gen)
    w = torch.rand(batch, 1, generator=gen)
    return x, y, w


def _two_stages(rank: int, cls: type, loss_fn: Any) -> tuple[PipelineStage, Any, list[nn.Module]]:
    """This rank's stage of a two-stage chain, its schedule, and a single-process copy of the chain."""
    modules = _chain(2)
    reference = copy.deepcopy(modules)
    stage = PipelineStage(copy.deepcopy(modules[rank]), rank, 2)
    return stage, cls(stage, 4, loss_fn), reference


def _same_grads(stage: PipelineStage, reference: nn.Module, what: str) -> None:
    for got, want in zip(stage.submod.parameters(), reference.parameters(), strict=True):
        close(got.grad, want.grad, what)


def scaled_mse(out: torch.Tensor, y: torch.Tensor, *, scale: float = 1.0, column: Any = None) -> torch.Tensor:
    err = (out - y) ** 2
    if column is not None:
        err = err * column
    return err.mean() * scale


@pytest.mark.distributed(world_size=2, timeout=60)
def test_loss_kwargs_reach_the_loss_of_every_micro_batch(rank: int, world_size: int) -> None:
    """torch passes loss_kwargs whole to each micro-batch's loss; they were dropped (or sent to the model)."""
    stage, schedule, reference = _two_stages(rank, Schedule1F1B, scaled_mse)
    x, y, _ = _data(6)
    column = torch.tensor([1.0, 0.25])  # per output column: a whole-batch value, not split
    loss_kwargs = {"scale": 3.0, "column": column}
    losses: list[torch.Tensor] = []
    # Every rank may pass them (torch's idiom); the model's forward never sees them.
    out = (
        schedule.step(x, loss_kwargs=loss_kwargs)
        if rank == 0
        else schedule.step(target=y, losses=losses, loss_kwargs=loss_kwargs)
    )
    pieces = list(zip(x.tensor_split(4), y.tensor_split(4), strict=True))
    want = [scaled_mse(_reference(reference, xi), yi, **loss_kwargs) for xi, yi in pieces]
    torch.stack(want).mean().backward()
    if rank == 1:
        close(torch.stack(losses), torch.stack(want).detach(), "losses")
        close(out, _reference(reference, x).detach(), "output")
    _same_grads(stage, reference[rank], "gradient")
    # return_outputs=False: no merged output, the losses still come.
    losses.clear()
    out = (
        schedule.step(x, return_outputs=False)
        if rank == 0
        else schedule.step(target=y, losses=losses, return_outputs=False, loss_kwargs=loss_kwargs)
    )
    assert out is None
    if rank == 1:
        close(torch.stack(losses), torch.stack(want).detach(), "losses without outputs")


def weighted_mse(out: torch.Tensor, target: Any) -> torch.Tensor:
    labels, weights = (target["labels"], target["weights"]) if isinstance(target, dict) else target
    return ((out - labels) ** 2 * weights).mean()


@pytest.mark.distributed(world_size=2, timeout=60)
def test_a_structured_target_is_split_per_micro_batch(rank: int, world_size: int) -> None:
    """A (labels, weights) target was given whole to every micro-batch's loss."""
    stage, schedule, reference = _two_stages(rank, ScheduleGPipe, weighted_mse)
    x, y, w = _data(6)  # 6 rows over 4 micro-batches: uneven pieces
    pieces = list(zip(x.tensor_split(4), y.tensor_split(4), w.tensor_split(4), strict=True))
    want = torch.stack([weighted_mse(_reference(reference, xi), (yi, wi)) for xi, yi, wi in pieces])
    want.mean().backward()
    for target in [(y, w), {"labels": y, "weights": w}]:
        stage.submod.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        schedule.step(x) if rank == 0 else schedule.step(target=target, losses=losses)
        if rank == 1:
            close(torch.stack(losses), want.detach(), f"losses of a {type(target).__name__} target")
        _same_grads(stage, reference[rank], "gradient")


EVAL_CASES = {
    # name: (class, stages per rank, placement, n_microbatches)
    "1f1b": (Schedule1F1B, 1, "loop", 4),
    "zbv": (ScheduleZBVZeroBubble, 2, "v", 4),
    "dualpipev": (ScheduleDualPipeV, 2, "v", 4),
}


@pytest.mark.parametrize(
    "case",
    [pytest.param(c, marks=pytest.mark.distributed(world_size=2, timeout=90), id=c) for c in EVAL_CASES],
)
def test_eval_is_a_forward_without_gradients(rank: int, world_size: int, case: str) -> None:
    """eval(): a no_grad forward's outputs and losses, no .grad anywhere; training steps around it match."""
    cls, v, style, m = EVAL_CASES[case]
    num_stages = 2 * v
    modules = _chain(num_stages)
    reference = copy.deepcopy(modules)
    mine = stages_on_rank(rank, 2, v, style=style)
    stages = [PipelineStage(copy.deepcopy(modules[s]), s, num_stages) for s in mine]
    schedule = cls(stages if v > 1 else stages[0], m, scaled_mse)
    first, last = 0 in mine, num_stages - 1 in mine
    x, y, _ = _data(8)
    pieces = list(zip(x.tensor_split(m), y.tensor_split(m), strict=True))
    with torch.no_grad():
        want_out = _reference(reference, x)
        want_losses = torch.stack([scaled_mse(_reference(reference, xi), yi) for xi, yi in pieces])
    torch.stack([scaled_mse(_reference(reference, xi), yi) for xi, yi in pieces]).mean().backward()
    params = [p for s in stages for p in s.submod.parameters()]
    ref_grads = [p.grad for s in mine for p in reference[s].parameters()]

    def run(method: str, **extra: Any) -> tuple[Any, list[torch.Tensor]]:
        losses: list[torch.Tensor] = []
        call = getattr(schedule, method)
        inputs = (x,) if first else ()
        kwargs: dict[str, Any] = {"target": y, "losses": losses} if last else {}
        return call(*inputs, **kwargs, **extra), losses

    for round_ in range(2):  # eval first (nothing learned yet), then after a training step
        grads_before = [None if p.grad is None else p.grad.clone() for p in params]
        out, losses = run("eval")
        for p, before in zip(params, grads_before, strict=True):
            assert (p.grad is None) if before is None else torch.equal(p.grad, before), "eval touched a grad"
        if last:
            assert not out.requires_grad and not any(loss.requires_grad for loss in losses)
            close(out, want_out, f"eval output, round {round_}")
            close(torch.stack(losses), want_losses, f"eval losses, round {round_}")
        else:
            assert out is None
        for p in params:
            p.grad = None
        # Round 1 trains under no_grad: the executor turns autograd on for its own steps (torch
        # refuses, hence its backward_requires_autograd; ours takes that flag and needs no such care).
        with torch.no_grad() if round_ else contextlib.nullcontext():
            run("step")
        for got, want in zip([p.grad for p in params], ref_grads, strict=True):
            close(got, want, f"gradient after eval, round {round_}")
    # Its keywords reach eval as they reach step.
    out, losses = run("eval", return_outputs=False, loss_kwargs={"scale": 2.0})
    assert out is None
    if last:
        close(torch.stack(losses), want_losses * 2, "eval losses with loss_kwargs")


@pytest.mark.distributed(world_size=2, timeout=60)
def test_torch_spec_objects_and_a_nested_argument_in_a_step(rank: int, world_size: int) -> None:
    class Gate(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(WIDTH, WIDTH)

        def forward(self, pair: tuple[torch.Tensor, torch.Tensor], factor: float) -> torch.Tensor:
            h, gate = pair
            return self.linear(h) * gate * factor

    torch.manual_seed(11)
    modules: list[nn.Module] = [Gate(), Head(2)]
    reference = copy.deepcopy(modules)
    stage = PipelineStage(copy.deepcopy(modules[rank]), rank, 2)
    schedule = Schedule1F1B(
        stage,
        2,
        nn.functional.mse_loss,
        args_chunk_spec=(None, tmb._Replicate()),
        output_merge_spec=(tmb.TensorChunkSpec(0),),
    )
    x, y, w = _data(4)
    out = schedule.step((x, w), 0.5) if rank == 0 else schedule.step(target=y)
    pieces = zip(x.tensor_split(2), w.tensor_split(2), y.tensor_split(2), strict=True)
    torch.stack(
        [nn.functional.mse_loss(reference[1](reference[0]((xi, wi), 0.5)), yi) for xi, wi, yi in pieces]
    ).mean().backward()
    if rank == 1:
        assert isinstance(out, tuple) and len(out) == 1  # torch's merge returns the spec's structure
        close(out[0], reference[1](reference[0]((x, w), 0.5)).detach(), "output")
    _same_grads(stage, reference[rank], "gradient")
