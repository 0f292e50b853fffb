"""The schedule classes as names and types: torch's names, bases and constructor arguments."""

from __future__ import annotations

import ast
import inspect

import hp_pipeline
import pytest
from hp_pipeline import (
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBV,
    ScheduleZBVZeroBubble,
    ScheduleZeroBubble,
    get_schedule_class,
)

tp = pytest.importorskip("torch.distributed.pipelining.schedules")


def _torch_names() -> list[str]:
    """The names torch's get_schedule_class accepts, read from its own error message."""
    with pytest.raises(ValueError) as info:
        tp.get_schedule_class("no such schedule")
    message = str(info.value)
    return list(ast.literal_eval(message[message.index("[") :]))


def test_every_torch_name_maps_to_our_class_of_the_same_name() -> None:
    names = _torch_names()
    assert {"1F1B", "GPipe", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"} <= set(names)
    for name in names:
        ours = get_schedule_class(name)
        assert ours.__name__ == tp.get_schedule_class(name).__name__, name
        assert ours is getattr(hp_pipeline, ours.__name__)
        # case-insensitive, as torch's
        assert get_schedule_class(name.lower()) is ours and get_schedule_class(name.upper()) is ours


def test_our_own_names() -> None:
    assert get_schedule_class("ZeroBubble") is ScheduleZeroBubble
    assert get_schedule_class("zbv") is ScheduleZBV is ScheduleZBVZeroBubble


def test_unknown_name_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError) as info:
        get_schedule_class("Interleaved2F2B")
    message = str(info.value)
    assert "unknown schedule name 'Interleaved2F2B'" in message
    for name in _torch_names():
        assert repr(name) in message
    with pytest.raises(ValueError, match="unknown schedule name 3"):
        get_schedule_class(3)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("cls", "base"),
    [
        (ScheduleGPipe, PipelineScheduleSingle),
        (Schedule1F1B, PipelineScheduleSingle),
        (ScheduleZeroBubble, PipelineScheduleSingle),
        (ScheduleInterleaved1F1B, PipelineScheduleMulti),
        (ScheduleLoopedBFS, PipelineScheduleMulti),
        (ScheduleInterleavedZeroBubble, PipelineScheduleMulti),
        (ScheduleZBVZeroBubble, PipelineScheduleMulti),
        (ScheduleDualPipeV, PipelineScheduleMulti),
    ],
    ids=lambda c: getattr(c, "__name__", ""),
)
def test_bases_tell_how_many_stages_per_rank(cls: type, base: type) -> None:
    """torchtitan's check: issubclass(cls, PipelineScheduleSingle) means one stage per rank."""
    assert issubclass(cls, base)
    other = PipelineScheduleMulti if base is PipelineScheduleSingle else PipelineScheduleSingle
    assert not issubclass(cls, other)
    torch_cls = getattr(tp, cls.__name__, None)
    if torch_cls is not None:
        assert issubclass(torch_cls, getattr(tp, base.__name__))


@pytest.mark.parametrize(
    "cls",
    [ScheduleLoopedBFS, ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble, ScheduleDualPipeV],
    ids=lambda c: c.__name__,
)
def test_constructor_arguments_follow_torch(cls: type) -> None:
    ours = inspect.signature(cls)
    theirs = inspect.signature(getattr(tp, cls.__name__))
    assert list(ours.parameters)[:3] == list(theirs.parameters)[:3] == ["stages", "n_microbatches", "loss_fn"]
    # Our options are keyword-only and shared by every class (torch's vary: LoopedBFS has no
    # chunk specs); torch's options that we take have the same name.
    shared = inspect.signature(hp_pipeline.PipelineSchedule).parameters
    common = [name for name in list(theirs.parameters)[3:] if name in shared]
    assert {"output_merge_spec", "scale_grads"} <= set(common)
    assert all(shared[name].kind is inspect.Parameter.KEYWORD_ONLY for name in common)


def test_subclass_hooks_keep_the_base_signatures() -> None:
    """Every schedule's hooks take the base class's argument names, so keyword calls work on all of them."""
    from hp_pipeline.schedules import PipelineSchedule

    hooks = ("build_order", "add_comms", "make_runner", "expected_num_stages", "fingerprint")
    classes = [
        obj
        for obj in vars(hp_pipeline).values()
        if isinstance(obj, type) and issubclass(obj, PipelineSchedule) and obj is not PipelineSchedule
    ]
    assert len(classes) >= 9, [c.__name__ for c in classes]
    for cls in classes:
        for hook in hooks:
            want = list(inspect.signature(getattr(PipelineSchedule, hook)).parameters)
            got = list(inspect.signature(getattr(cls, hook)).parameters)
            assert got == want, f"{cls.__name__}.{hook}{got} differs from PipelineSchedule.{hook}{want}"
