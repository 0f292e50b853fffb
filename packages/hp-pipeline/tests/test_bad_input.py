# mypy: ignore-errors
# (every case passes a wrongly typed argument on purpose)
"""Bad input to every public entry point: a clear error, on every rank, with nothing changed.

Each case checks the message (it names the value the call saw and the fix),
that the call raised, on every rank for the distributed cases (the body runs
on each rank and fails where a rank does not raise), and that nothing
changed: the module of a refused stage or schedule keeps its parameters and
has no hooks, an order handed to a pass is left as it was, the step-kind
registry keeps its members, and a refused step leaves no gradient and no
learned metadata behind. Ranks that built different schedules raise at the
first step, before any transfer ([Note: schedule agreement] in
``hp_pipeline._checks``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hp_pipeline import (
    MetaStep,
    MetaStepType,
    PipelineScheduleSingle,
    PipelineStage,
    PipelineStepError,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleMPipe,
    ScheduleZBV,
    StepCosts,
    TensorChunkSpec,
    build_1f1b_order,
    get_schedule_class,
    insert_comms,
    register_step_kind,
    render_order,
    simulate,
    stages_on_rank,
    step_kinds,
    validate_order,
)
from torch import nn

T = MetaStepType
mse = nn.functional.mse_loss


def _fingerprint(module: nn.Module) -> tuple[Any, ...]:
    """What a refused call must not change on a module: its parameters (values and identity) and hooks."""
    return (
        [(name, id(p), p.detach().clone()) for name, p in module.named_parameters()],
        len(module._forward_hooks),
        len(module._forward_pre_hooks),
        len(module._backward_hooks),
    )


def _same(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    params_a, *hooks_a = a
    params_b, *hooks_b = b
    return (
        hooks_a == hooks_b
        and [(n, i) for n, i, _ in params_a] == [(n, i) for n, i, _ in params_b]
        and all(torch.equal(x, y) for (_, _, x), (_, _, y) in zip(params_a, params_b, strict=True))
    )


# -- PipelineStage: no process group needed ----------------------------------------------------

STAGE_CASES: list[tuple[str, dict[str, Any], type[Exception], str]] = [
    (
        "submodule a str",
        {"submodule": "lin"},
        TypeError,
        r"PipelineStage: submodule is a str, not an nn.Module; wrap a function in a module",
    ),
    (
        "stage_index a float",
        {"stage_index": 1.0},
        TypeError,
        r"stage_index=1.0 is a float, not an int; pass an int",
    ),
    ("stage_index a bool", {"stage_index": True}, TypeError, r"stage_index=True is a bool, not an int"),
    (
        "stage_index out of range",
        {"stage_index": 2},
        ValueError,
        r"stage_index must be in 0 .. 1 \(num_stages=2\), got 2",
    ),
    ("stage_index negative", {"stage_index": -1}, ValueError, r"stage_index must be in 0 .. 1 .*got -1"),
    (
        "num_stages zero",
        {"num_stages": 0, "stage_index": 0},
        ValueError,
        r"num_stages must be an int >= 1, got 0",
    ),
    ("num_stages a str", {"num_stages": "2"}, TypeError, r"num_stages='2' is a str, not an int"),
    (
        "device a made-up name",
        {"device": "gpu0"},
        ValueError,
        r"device='gpu0' is not a device; pass a torch.device",
    ),
    ("device a list", {"device": [0]}, ValueError, r"device=\[0\] is not a device; pass .* or None"),
    (
        "device meta",
        {"device": "meta"},
        ValueError,
        r"device='meta' cannot hold received activations; pass the device",
    ),
    (
        "group a str",
        {"group": "pp"},
        TypeError,
        r"group='pp' is a str, not a ProcessGroup or a DeviceMesh; pass the pipeline's group",
    ),
]


@pytest.mark.parametrize(("case", "kwargs", "error", "message"), STAGE_CASES, ids=[c[0] for c in STAGE_CASES])
def test_pipeline_stage_bad_input(
    case: str, kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    module = nn.Linear(2, 2)
    before = _fingerprint(module)
    args: dict[str, Any] = {"submodule": module, "stage_index": 1, "num_stages": 2, **kwargs}
    with pytest.raises(error, match=message):
        PipelineStage(**args)
    assert _same(before, _fingerprint(module)), case


# -- schedule keywords: checked before any process-group call ----------------------------------


def _stage(index: int = 0, num_stages: int = 1) -> PipelineStage:
    return PipelineStage(nn.Linear(2, 2), index, num_stages)


SCHEDULE_CASES: list[tuple[str, Callable[[PipelineStage], Any], type[Exception], str]] = [
    (
        "n_microbatches a float",
        lambda s: Schedule1F1B(s, 2.0, mse),
        ValueError,
        r"n_microbatches must be an int >= 1, got 2.0",
    ),
    (
        "n_microbatches zero",
        lambda s: Schedule1F1B(s, 0, mse),
        ValueError,
        r"n_microbatches must be an int >= 1, got 0",
    ),
    (
        "n_microbatches a bool",
        lambda s: ScheduleGPipe(s, True, mse),
        ValueError,
        r"n_microbatches must be an int >= 1, got True",
    ),
    (
        "loss_fn a str",
        lambda s: Schedule1F1B(s, 2, "mse"),
        TypeError,
        r"loss_fn='mse' is a str, not a callable; pass e.g. loss_fn=torch",
    ),
    (
        "args_chunk_spec a bare spec",
        lambda s: Schedule1F1B(s, 2, mse, args_chunk_spec=TensorChunkSpec(0)),
        TypeError,
        r"args_chunk_spec=TensorChunkSpec\(split_dim=0\) is a TensorChunkSpec, not a sequence; "
        r"pass one spec per",
    ),
    (
        "args_chunk_spec entry an int",
        lambda s: Schedule1F1B(s, 2, mse, args_chunk_spec=[0]),
        TypeError,
        r"args_chunk_spec\[0\] is 0 \(int\); each entry must be TensorChunkSpec\(dim\) \(ours or torch's\), "
        r"REPLICATE or None",
    ),
    (
        "kwargs_chunk_spec a list",
        lambda s: Schedule1F1B(s, 2, mse, kwargs_chunk_spec=[TensorChunkSpec(0)]),
        TypeError,
        r"kwargs_chunk_spec=\[TensorChunkSpec\(split_dim=0\)\] is a list, not a mapping; pass a dict",
    ),
    (
        "kwargs_chunk_spec value an int",
        lambda s: Schedule1F1B(s, 2, mse, kwargs_chunk_spec={"mask": 1}),
        TypeError,
        r"kwargs_chunk_spec\['mask'\] is 1 \(int\); each entry must be",
    ),
    (
        "kwargs_chunk_spec key an int",
        lambda s: Schedule1F1B(s, 2, mse, kwargs_chunk_spec={0: None}),
        TypeError,
        r"kwargs_chunk_spec has the key 0 \(int\); keys are the names of step\(\)'s keyword arguments",
    ),
    (
        "output_merge_spec a str",
        lambda s: Schedule1F1B(s, 2, mse, output_merge_spec="0"),
        TypeError,
        r"output_merge_spec='0' is a str, not a merge spec; pass an int dim",
    ),
    (
        "output_merge_spec leaf a str",
        lambda s: Schedule1F1B(s, 2, mse, output_merge_spec=(TensorChunkSpec(0), "cat")),
        TypeError,
        r"output_merge_spec\[1\]='cat' is a str, not a merge spec; .* one leaf per tensor",
    ),
    (
        "defer_pp_recv=True",
        lambda s: ScheduleInterleaved1F1B([s], 2, mse, defer_pp_recv=True),
        ValueError,
        r"defer_pp_recv=True \(torch's option .*\) is not supported; .* pass recv_lookahead=1",
    ),
    (
        "defer_pp_recv on a single-stage schedule (torch's take none)",
        lambda s: Schedule1F1B(s, 2, mse, defer_pp_recv=False),
        TypeError,
        r"Schedule1F1B got unknown keyword option\(s\) \['defer_pp_recv'\]",
    ),
    (
        "use_full_backward on a multi-stage schedule (torch's base only)",
        lambda s: ScheduleInterleaved1F1B([s], 2, mse, use_full_backward=True),
        TypeError,
        r"ScheduleInterleaved1F1B got unknown keyword option\(s\) \['use_full_backward'\]",
    ),
    (
        "backward_requires_autograd a str",
        lambda s: ScheduleInterleaved1F1B([s], 2, mse, backward_requires_autograd="yes"),
        TypeError,
        r"backward_requires_autograd='yes' is a str, not a bool",
    ),
    (
        "scale_grads a str",
        lambda s: Schedule1F1B(s, 2, mse, scale_grads="yes"),
        TypeError,
        r"scale_grads='yes' is a str, not a bool; pass True or False",
    ),
    (
        "scale_grads an int",
        lambda s: Schedule1F1B(s, 2, mse, scale_grads=1),
        TypeError,
        r"scale_grads=1 is a int, not a bool",
    ),
    (
        "abort_timeout negative",
        lambda s: Schedule1F1B(s, 2, mse, abort_timeout=-1),
        ValueError,
        r"abort_timeout=-1 must be > 0 \(seconds\); pass e.g. abort_timeout=10.0",
    ),
    (
        "abort_timeout a str",
        lambda s: Schedule1F1B(s, 2, mse, abort_timeout="10"),
        TypeError,
        r"abort_timeout='10' is a str, not a number",
    ),
    (
        "recv_lookahead zero",
        lambda s: Schedule1F1B(s, 2, mse, recv_lookahead=0),
        ValueError,
        r"recv_lookahead must be None .* got 0",
    ),
    (
        "unknown option (single)",
        lambda s: Schedule1F1B(s, 2, mse, n_microbatch=4),
        TypeError,
        r"Schedule1F1B got unknown keyword option\(s\) \['n_microbatch'\]; "
        r"the valid options are \['abort_timeout', 'args_chunk_spec'",
    ),
    (
        "unknown option (multi)",
        lambda s: ScheduleInterleaved1F1B([s], 2, mse, chunks=2),
        TypeError,
        r"ScheduleInterleaved1F1B got unknown keyword option\(s\) \['chunks'\]; "
        r"the valid options are \[.*'scale_grads'",
    ),
    (
        "unknown option (V)",
        lambda s: ScheduleZBV([s, s], 2, mse, stage_order="v"),
        TypeError,
        r"ScheduleZBVZeroBubble got unknown keyword option\(s\) \['stage_order'\]",
    ),
    (
        "ZBV given one stage",
        lambda s: ScheduleZBV([s], 2, mse),
        ValueError,
        r"runs exactly 2 stages per rank \(r and 2p-1-r\), got 1; pass \[PipelineStage\(chunk_a, r, 2 \* p\)",
    ),
    (
        "DualPipeV given one stage",
        lambda s: ScheduleDualPipeV(s, 4, mse),
        ValueError,
        r"ScheduleDualPipeV runs exactly 2 stages per rank .*got 1",
    ),
    (
        "a module, not a stage",
        lambda s: Schedule1F1B(s.submod, 2, mse),
        TypeError,
        r"pass this rank's PipelineStage \(PipelineStage\(submodule, rank, num_ranks\)\), got Linear",
    ),
    (
        "two stages to a single-stage schedule",
        lambda s: Schedule1F1B([s, s], 2, mse),
        TypeError,
        r"got list of 2 stages \(use ScheduleInterleaved1F1B\)",
    ),
    (
        "an empty list",
        lambda s: ScheduleInterleaved1F1B([], 2, mse),
        TypeError,
        r"needs PipelineStage objects, got nothing; wrap each",
    ),
    (
        "the base class",
        lambda s: PipelineScheduleSingle(s, 2, mse),
        TypeError,
        r"PipelineScheduleSingle is a base class .*build a schedule such as",
    ),
    (
        "swap_policy a str",
        lambda s: Schedule1F1B(s, 2, mse, swap_policy="all"),
        TypeError,
        r"swap_policy must be a SwapPolicy or None, got str",
    ),
]

_TOWER = nn.Linear(2, 2)

MPIPE_CASES: list[tuple[str, dict[str, Any], type[Exception], str]] = [
    (
        "input_keys a str",
        {"input_keys": "input_ids"},
        TypeError,
        r"input_keys='input_ids' is a str, not a sequence of key names; "
        r"pass a tuple, e.g. input_keys=\('input_ids',\)",
    ),
    (
        "preprocess_keys holds an int",
        {"preprocess_keys": ("pixels", 3)},
        TypeError,
        r"preprocess_keys holds \[3\], which are not str",
    ),
    (
        "target_key an int",
        {"target_key": 3},
        TypeError,
        r"target_key=3 is a int, not a str; pass the key of the labels",
    ),
    (
        "ignore_index a float",
        {"ignore_index": -100.0},
        TypeError,
        r"ignore_index=-100.0 is a float, not an int",
    ),
    (
        "owner_backward a str",
        {"owner_backward": "yes"},
        TypeError,
        r"owner_backward='yes' is a str, not a bool",
    ),
    (
        "in_schedule_loading an int",
        {"in_schedule_loading": 1},
        TypeError,
        r"in_schedule_loading=1 is a int, not a bool",
    ),
    (
        "dp_group a str",
        {"dp_group": "dp"},
        TypeError,
        r"dp_group='dp' is a str, not a ProcessGroup or a DeviceMesh; pass the data-parallel group",
    ),
    (
        "overflow_mode unknown",
        {"overflow_mode": "max"},
        ValueError,
        r"overflow_mode must be 'full' or 'min', got 'max'",
    ),
    (
        "preprocess a function",
        {"preprocess": lambda x: x},
        TypeError,
        r"preprocess must be an nn.Module, got function; pass the preprocess tower",
    ),
    (
        "unknown option",
        {"overflow": "min"},
        TypeError,
        r"ScheduleMPipe got unknown keyword option\(s\) \['overflow'\]; the valid options are",
    ),
]


@pytest.mark.parametrize(
    ("case", "build", "error", "message"), SCHEDULE_CASES, ids=[c[0] for c in SCHEDULE_CASES]
)
def test_schedule_bad_keywords(
    case: str, build: Callable[[PipelineStage], Any], error: type[Exception], message: str
) -> None:
    stage = _stage()
    before = _fingerprint(stage.submod)
    with pytest.raises(error, match=message):
        build(stage)
    assert _same(before, _fingerprint(stage.submod)), case
    assert not stage.inputs_meta and not stage.outputs_meta


@pytest.mark.parametrize(("case", "kwargs", "error", "message"), MPIPE_CASES, ids=[c[0] for c in MPIPE_CASES])
def test_mpipe_bad_keywords(case: str, kwargs: dict[str, Any], error: type[Exception], message: str) -> None:
    stage = _stage()
    before = _fingerprint(stage.submod), _fingerprint(_TOWER)
    with pytest.raises(error, match=message):
        ScheduleMPipe(stage, 2, **{"preprocess": _TOWER, "loss_fn": mse, **kwargs})
    after = _fingerprint(stage.submod), _fingerprint(_TOWER)
    assert _same(before[0], after[0]) and _same(before[1], after[1]), case


# -- the IR and the passes: pure Python ------------------------------------------------------------

_ORDER = build_1f1b_order(2, 2)

PASS_CASES: list[tuple[str, Callable[[dict[int, list[MetaStep]]], Any], type[Exception], str]] = [
    (
        "insert_comms: a list",
        lambda o: insert_comms(list(o.values())),
        TypeError,
        r"insert_comms: order is a list, not a mapping; pass a dict rank -> list of MetaStep",
    ),
    (
        "insert_comms: data_stages an int",
        lambda o: insert_comms(o, data_stages=1),
        TypeError,
        r"data_stages=1 is a int, not a collection of stage indices; pass e.g. data_stages=\[1\]",
    ),
    (
        "insert_comms: data_stages out of range",
        lambda o: insert_comms(o, data_stages=[5]),
        ValueError,
        r"data_stages must be stage indices in 0 .. 1, got 5",
    ),
    (
        "insert_comms: costs a dict",
        lambda o: insert_comms(o, costs={"F": 1}),
        TypeError,
        r"insert_comms: costs=\{'F': 1\} is a dict, not a StepCosts; pass e.g. StepCosts\(",
    ),
    (
        "validate_order: None",
        lambda o: validate_order(None),
        TypeError,
        r"validate_order: order is a NoneType, not a mapping",
    ),
    (
        "validate_order: steps as text",
        lambda o: validate_order({0: "0F0"}),
        TypeError,
        r"rank 0's steps are a str \('0F0'\), not a list of MetaStep; parse text with MetaStep.parse",
    ),
    (
        "validate_order: n_microbatches a str",
        lambda o: validate_order(o, n_microbatches="2"),
        TypeError,
        r"n_microbatches='2' is a str, not an int; pass an int >= 1 or None",
    ),
    (
        "validate_order: num_stages negative",
        lambda o: validate_order(o, num_stages=-1),
        ValueError,
        r"num_stages=-1 is below 1; pass an int >= 1",
    ),
    (
        "validate_order: require_comms a str",
        lambda o: validate_order(o, require_comms="yes"),
        TypeError,
        r"require_comms='yes' is a str, not a bool",
    ),
    (
        "simulate: costs a dict",
        lambda o: simulate(o, {"F": 1}),
        TypeError,
        r"simulate: costs=\{'F': 1\} is a dict, not a StepCosts",
    ),
    (
        "simulate: validate a str",
        lambda o: simulate(o, validate="no"),
        TypeError,
        r"simulate: validate='no' is a str, not a bool; pass True or False",
    ),
    (
        "StepCosts: negative",
        lambda o: StepCosts(forward=-1),
        ValueError,
        r"StepCosts.forward must be >= 0, got -1",
    ),
    (
        "render_order: a png path",
        lambda o: render_order(o, "x.png"),
        ValueError,
        r"got path 'x.png', use a name ending in '.svg'",
    ),
    (
        "render_order: path an int",
        lambda o: render_order(o, 3),
        TypeError,
        r"render_order: path=3 is a int; pass a file name ending in '.svg'",
    ),
    (
        "render_order: title an int",
        lambda o: render_order(o, title=5),
        TypeError,
        r"render_order: title=5 is a int, not a str",
    ),
    (
        "render_order: costs a dict",
        lambda o: render_order(o, costs={"F": 1}),
        TypeError,
        r"render_order: costs=\{'F': 1\} is a dict, not a StepCosts",
    ),
    (
        "MetaStep: type as text",
        lambda o: MetaStep(0, "F", 0),
        TypeError,
        r"MetaStep type must be a MetaStepType, got 'F'; use e.g. MetaStepType.FWD",
    ),
    (
        "MetaStep: negative micro-batch",
        lambda o: MetaStep(-1, T.FWD, 0),
        ValueError,
        r"micro_index must be an int >= 0 or None, got -1",
    ),
    (
        "MetaStep: stage as text",
        lambda o: MetaStep(0, T.FWD, "0"),
        ValueError,
        r"stage_index must be an int >= 0, got '0'",
    ),
    (
        "MetaStep.parse: unknown code",
        lambda o: MetaStep.parse("0X9"),
        ValueError,
        r"unknown step code 'X' in '0X9'; known codes: F, B",
    ),
    (
        "get_schedule_class: unknown name",
        lambda o: get_schedule_class("2F2B"),
        ValueError,
        r"unknown schedule name '2F2B'; the valid names .* are \['1F1B'",
    ),
    (
        "register_step_kind: a str",
        lambda o: register_step_kind("X"),
        TypeError,
        r"register_step_kind takes a StepKind, got str \('X'\); declare the kind as StepKind\(",
    ),
]


@pytest.mark.parametrize(("case", "call", "error", "message"), PASS_CASES, ids=[c[0] for c in PASS_CASES])
def test_ir_and_passes_bad_input(
    case: str,
    call: Callable[[Any], Any],
    error: type[Exception],
    message: str,
    tmp_path: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)  # a render that wrongly went ahead would write here
    order = copy.deepcopy(_ORDER)
    kinds = list(step_kinds())
    with pytest.raises(error, match=message):
        call(order)
    assert order == _ORDER, case
    assert list(step_kinds()) == kinds
    assert not list(tmp_path.iterdir())


# -- placement and the minimum m: every rank raises when the schedule is built -----------------


def _v_stages(rank: int) -> list[PipelineStage]:
    return [PipelineStage(nn.Linear(2, 2), s, 4) for s in stages_on_rank(rank, 2, 2, style="v")]


def _loop_stages(rank: int) -> list[PipelineStage]:
    return [PipelineStage(nn.Linear(2, 2), s, 4) for s in stages_on_rank(rank, 2, 2, style="loop")]


PLACEMENT_CASES: list[tuple[str, Callable[[int], Any], str]] = [
    (
        "interleaved given V stages",
        lambda r: ScheduleInterleaved1F1B(_v_stages(r), 4, mse),
        r"ScheduleInterleaved1F1B: rank \d of 2 must host stages \[\d, \d\] \(loop placement\), "
        r"got \[\d, \d\]; "
        r"build this rank's stages for hp_pipeline.stages_on_rank\(\d, 2, 2, style='loop'\)",
    ),
    (
        "ZBV given looped stages",
        lambda r: ScheduleZBV(_loop_stages(r), 4, mse),
        r"ScheduleZBVZeroBubble: rank \d of 2 must host stages \[\d, \d\] \(v placement\), "
        r"got \[\d, \d\]; .*style='v'",
    ),
    (
        "DualPipeV given looped stages",
        lambda r: ScheduleDualPipeV(_loop_stages(r), 4, mse),
        r"ScheduleDualPipeV: rank \d of 2 must host stages .*\(v placement\)",
    ),
    (
        "stages built with the wrong num_stages",
        lambda r: Schedule1F1B(PipelineStage(nn.Linear(2, 2), r, 4), 4, mse),
        r"Schedule1F1B over 2 ranks with 1 stage\(s\) per rank runs 2 stages, but the stages say "
        r"num_stages=\[4\]; build them with num_stages=2",
    ),
    (
        "DualPipeV with m below 2p",
        lambda r: ScheduleDualPipeV(_v_stages(r), 3, mse),
        r"ScheduleDualPipeV over 2 ranks runs 4 stages and needs at least one micro-batch per stage, "
        r"got n_microbatches=3; use n_microbatches >= 4",
    ),
    (
        "interleaved rounds that do not split",
        lambda r: ScheduleInterleaved1F1B(_loop_stages(r), 5, mse),
        r"n_microbatches=5 cannot be split into equal rounds over num_ranks=2 .*; use n_microbatches <= 2",
    ),
]


def _by_name(cases: list[tuple[Any, ...]]) -> list[Any]:
    """Distributed cases are parametrized by name only: the ranks get picklable parameters."""
    return [
        pytest.param(c[0], marks=pytest.mark.distributed(world_size=2, timeout=60), id=c[0]) for c in cases
    ]


def _case(cases: list[tuple[Any, ...]], name: str) -> tuple[Any, ...]:
    return next(c[1:] for c in cases if c[0] == name)


@pytest.mark.parametrize("case", _by_name(PLACEMENT_CASES))
def test_placement_every_rank_raises(rank: int, world_size: int, case: str) -> None:
    build, message = _case(PLACEMENT_CASES, case)
    with pytest.raises(ValueError, match=message):
        build(rank)


@pytest.mark.distributed(world_size=2, timeout=60)
def test_stages_on_two_groups(rank: int, world_size: int) -> None:
    solo = [dist.new_group([r]) for r in range(world_size)]  # new_group is collective: every rank builds both
    stages = _loop_stages(rank)
    stages[1].group = solo[rank]
    with pytest.raises(
        ValueError,
        match=r"all stages of a rank must use the same process group, got \{.*'the default "
        r"group', .*'group of ranks \[\d\]'\}; build every stage of the schedule with the same group=",
    ):
        ScheduleInterleaved1F1B(stages, 4, mse)


# -- ranks that built different schedules: every rank raises at the first step, before any transfer --


def _this_rank(rank: int) -> PipelineStage:
    torch.manual_seed(0)
    return PipelineStage(nn.Linear(4, 4), rank, 2)


DISAGREE_CASES: list[tuple[str, Callable[[int, PipelineStage], Any], str]] = [
    (
        "n_microbatches differs",
        lambda r, s: Schedule1F1B(s, 2 if r == 0 else 4, mse),
        r"rank 0: Schedule1F1B\(n_microbatches=2, .*\); rank 1: Schedule1F1B\(n_microbatches=4,",
    ),
    (
        "schedule class differs",
        lambda r, s: (Schedule1F1B if r == 0 else ScheduleGPipe)(s, 2, mse),
        r"rank 0: Schedule1F1B\(.*\); rank 1: ScheduleGPipe\(",
    ),
    (
        "loss_fn on one rank only",
        lambda r, s: Schedule1F1B(s, 2, mse if r == 1 else None),
        r"rank 0: Schedule1F1B\(.*loss_fn=None.*\); rank 1: Schedule1F1B\(.*loss_fn='given'",
    ),
    (
        "scale_grads differs",
        lambda r, s: Schedule1F1B(s, 2, mse, scale_grads=r == 0),
        r"rank 0: Schedule1F1B\(.*scale_grads=True\); rank 1: Schedule1F1B\(.*scale_grads=False\)",
    ),
]


def _refused_step(
    rank: int,
    build: Callable[[int, PipelineStage], Any],
    call: Callable[[int, Any, torch.Tensor, torch.Tensor], Any],
    error: type[Exception],
    message: str,
) -> tuple[PipelineStage, Any, pytest.ExceptionInfo[Exception]]:
    """Build this rank's schedule, make the refused step, and check it left the stage as it was."""
    stage = _this_rank(rank)
    before = _fingerprint(stage.submod)
    schedule = build(rank, stage)
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    with pytest.raises(error, match=message) as info:
        call(rank, schedule, x, y)
    assert _same(before, _fingerprint(stage.submod))
    assert all(p.grad is None for p in stage.submod.parameters())  # no backward ran anywhere
    return stage, schedule, info


def _good_step(rank: int, schedule: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
    return schedule.step(x) if rank == 0 else schedule.step(target=y, losses=[])


@pytest.mark.parametrize("case", _by_name(DISAGREE_CASES))
def test_ranks_that_disagree_raise_on_every_rank(rank: int, world_size: int, case: str) -> None:
    build, message = _case(DISAGREE_CASES, case)
    # Construction is local (nothing to compare yet); the first step agrees before any transfer.
    stage, _, info = _refused_step(
        rank,
        build,
        _good_step,
        ValueError,
        r"the ranks of the pipeline built different schedules \(" + message,
    )
    assert "Build the same schedule on every rank: the same class, n_microbatches" in str(info.value)
    assert not stage.inputs_meta and not stage.outputs_meta  # no transfer happened


@pytest.mark.distributed(world_size=2, timeout=60)
def test_mpipe_ranks_that_disagree_raise_when_built(rank: int, world_size: int) -> None:
    """MPipe's construction broadcasts the tower, so it agrees first: before the broadcast, on every rank."""
    torch.manual_seed(rank)  # the replicas differ until the broadcast
    tower = nn.Linear(2, 2)
    before = _fingerprint(tower)
    with pytest.raises(
        ValueError,
        match=r"built different schedules \(rank 0: ScheduleMPipe\(.*overflow_mode='full'.*\); "
        r"rank 1: ScheduleMPipe\(.*overflow_mode='min'",
    ):
        ScheduleMPipe(
            _this_rank(rank), 2, preprocess=tower, loss_fn=mse, overflow_mode="full" if rank == 0 else "min"
        )
    assert _same(before, _fingerprint(tower))  # not broadcast: nothing changed


@pytest.mark.distributed(world_size=2, timeout=60, mode="process")  # it patches torch.distributed
def test_agreeing_ranks_step_after_the_check(rank: int, world_size: int) -> None:
    """The check is one digest exchange at the first step, none after; no object collective at all."""
    import torch.distributed as dist

    stage = _this_rank(rank)
    schedule = Schedule1F1B(stage, 2, mse)
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    calls: list[str] = []
    originals = {name: getattr(dist, name) for name in ("all_gather", "all_gather_object")}

    def counting(name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return originals[name](*args, **kwargs)

        return call

    for name in originals:
        setattr(dist, name, counting(name))
    try:
        schedule.step(x) if rank == 0 else schedule.step(target=y)
        assert schedule._agreed and calls == ["all_gather"]
        schedule.step(x) if rank == 0 else schedule.step(target=y)
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
    assert calls == ["all_gather"]


# -- step() inputs: a bad input on one rank makes every rank raise, before any compute ------------

STEP_CASES: list[tuple[str, Callable[[int, Any, torch.Tensor, torch.Tensor], Any], str]] = [
    (
        "target missing on the last stage",
        lambda r, s, x, y: s.step(x) if r == 0 else s.step(losses=[]),
        r"rank 1 hosts the last stage \(1\) and the schedule has a loss_fn, but step\(\) got target=None; "
        r"pass the batch's targets there",
    ),
    (
        "losses a tuple",
        lambda r, s, x, y: s.step(x) if r == 0 else s.step(target=y, losses=()),
        r"step\(losses=...\) takes a list to append each micro-batch's loss to, "
        r"got a tuple \(\(\)\); pass losses=\[\]",
    ),
    (
        "batch smaller than n_microbatches",
        lambda r, s, x, y: s.step(x[:1]) if r == 0 else s.step(target=y[:1]),
        r"positional argument 0 has size 1 along dim 0 but the schedule needs n_microbatches=2 pieces; "
        r"pass a batch of at least 2",
    ),
    (
        "no batch on stage 0",
        lambda r, s, x, y: s.step() if r == 0 else s.step(target=y),
        r"rank 0 hosts stage 0 but step\(\) got no inputs; pass the batch here",
    ),
    (
        "return_outputs a str",
        lambda r, s, x, y: s.step(x, return_outputs="no") if r == 0 else s.step(target=y),
        r"step: return_outputs='no' is a str, not a bool; pass True or False",
    ),
    (
        "loss_kwargs a list of pairs",
        lambda r, s, x, y: s.step(x) if r == 0 else s.step(target=y, loss_kwargs=[("reduction", "sum")]),
        r"step\(loss_kwargs=...\) takes a dict of keyword arguments for loss_fn, got a list .*; "
        r"pass e.g. loss_kwargs=\{'reduction': 'sum'\}",
    ),
    (
        "a 0-d tensor in the target",
        lambda r, s, x, y: s.step(x) if r == 0 else s.step(target=(y, torch.tensor(2.0))),
        r"target\[1\] is a 0-d tensor \(tensor\(2.\)\), which has no dim 0 to split into micro-batches; "
        r"pass a whole-batch value to the loss through step\(loss_kwargs=",
    ),
    (
        "eval losses without a target",
        lambda r, s, x, y: s.eval(x) if r == 0 else s.eval(losses=[]),
        r"rank 1 hosts the last stage \(1\) and eval\(\) got losses= but no target=, so there is no loss "
        r"to compute; pass the batch's targets",
    ),
]


@pytest.mark.parametrize("case", _by_name(STEP_CASES))
def test_step_bad_input_every_rank_raises(rank: int, world_size: int, case: str) -> None:
    call, message = _case(STEP_CASES, case)
    stage, schedule, _ = _refused_step(
        rank, lambda r, s: Schedule1F1B(s, 2, mse), call, PipelineStepError, message
    )
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    # The group is still usable: the same schedule steps once the input is fixed.
    schedule.step(x) if rank == 0 else schedule.step(target=y)
    assert all(p.grad is not None for p in stage.submod.parameters())
