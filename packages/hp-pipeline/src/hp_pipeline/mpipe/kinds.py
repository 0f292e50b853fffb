"""MPipe's step kinds, declared through the step-kind registry like any plug-in.

The steps themselves are described in [Note: MPipe steps] (:mod:`hp_pipeline.mpipe.order`);
this module says, for each, what the passes need to know ([Note: step-kind
registry] in :mod:`hp_pipeline.kinds`): its code, its dependencies, its cost,
its colour (:mod:`hp_pipeline.mpipe.runner` holds the executor handlers).

Details: [Note: MPipe dependencies].
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING, Any

from hp_pipeline._builtin_kinds import loaded_here
from hp_pipeline._deps import Edge, OrderView
from hp_pipeline.ir import MetaStep
from hp_pipeline.kinds import MetaStepType, StepKind

if TYPE_CHECKING:
    from hp_pipeline.kinds import Problems

__all__ = ["MPIPE_GROUP", "MPIPE_KINDS", "is_mpipe_kind"]

# [Note: MPipe dependencies]
# On top of the built-in model ([Note: dependency model] in :mod:`hp_pipeline._deps`):
#
# * ``F(0, i)`` needs ``PF(o, i)``, the tower's features of micro-batch ``i`` made
#   on its owner stage ``o`` (``SEND_P``/``RECV_P`` when ``o`` is on another
#   rank). ``PF`` declares it as a ``feeds`` rule, so the built-in ``F`` knows
#   nothing of the tower;
# * ``PF(o, i)`` needs ``LOAD(o, i)`` when the owner loads the micro-batch;
# * ``PB(s, i)`` needs the input-gradient backward of stage 0 (the gradient of
#   the features, ``SEND_PG``/``RECV_PG`` when ``s`` is on another rank) and
#   ``PF(s, i)`` when the same stage ran the tower forward;
# * ``REDUCE_P``, a collective over every rank, needs every ``PB`` of its rank.


#: The ``group`` of MPipe's kinds (``strip_mpipe`` drops them).
MPIPE_GROUP = "mpipe"


def is_mpipe_kind(kind: MetaStepType) -> bool:
    """Whether ``kind`` is one of MPipe's (the tower's compute, transfers and reduction)."""
    return kind.group == MPIPE_GROUP


def _tower_feeds_stage0(view: OrderView, step: MetaStep) -> list[Edge]:
    """``PF(o, i)`` feeds ``F(0, i)``; on stage 0 itself the pair is unused (a local hand-off)."""
    T, i, o = MetaStepType, step.micro_index, step.stage_index
    consumer = MetaStep(i, T.FWD, 0)
    if o == 0:
        return [Edge(step, consumer, step, step)]
    return [Edge(step, consumer, MetaStep(i, T.PREPROCESS_SEND, o, 0), MetaStep(i, T.PREPROCESS_RECV, 0, o))]


def _tower_backward_edges(view: OrderView, step: MetaStep) -> list[Edge]:
    """``PB(s, i)`` needs dL/dfeatures, made by stage 0's input-gradient backward."""
    T, i, s = MetaStepType, step.micro_index, step.stage_index
    if i is None or 0 not in view.stage_rank:
        return []
    producer = view.backward_input(0, i)
    if s == 0:
        return [Edge(producer, step, step, step)]
    return [
        Edge(
            producer,
            step,
            MetaStep(i, T.PREPROCESS_GRAD_SEND, 0, s),
            MetaStep(i, T.PREPROCESS_GRAD_RECV, s, 0),
        )
    ]


def _tower_backward_needs(view: OrderView, step: MetaStep) -> list[MetaStep]:
    forward = MetaStep(step.micro_index, MetaStepType.PREPROCESS_FWD, step.stage_index)
    return [forward] if forward in view.position else []


def _tower_forward_of(view: OrderView, step: MetaStep) -> list[MetaStep]:
    return [MetaStep(step.micro_index, MetaStepType.PREPROCESS_FWD, step.stage_index)]


def _input_grad_of(view: OrderView, step: MetaStep) -> list[MetaStep]:
    assert step.micro_index is not None
    return [view.backward_input(step.stage_index, step.micro_index)]


def _stage_forward(view: OrderView, step: MetaStep) -> MetaStep:
    return MetaStep(step.micro_index, MetaStepType.FWD, step.stage_index)


def _tower_backward_of(view: OrderView, step: MetaStep) -> MetaStep:
    return MetaStep(step.micro_index, MetaStepType.PREPROCESS_BWD, step.stage_index)


def _rank_tower_backwards(view: OrderView, step: MetaStep) -> list[MetaStep]:
    """``REDUCE_P`` comes after every ``PB`` of its rank."""
    where = view.position.get(step)
    if where is None:
        return []
    backwards = view.of_type.get(MetaStepType.PREPROCESS_BWD, [])
    return [b for b in backwards if view.position[b][0] == where[0]]


def _counts(view: OrderView, expected: set[int]) -> Problems:
    """One ``PF`` per micro-batch, one ``PB`` per micro-batch if any, one ``REDUCE_P`` per rank."""
    from hp_pipeline.validate import _ranges

    T = MetaStepType
    problems: Problems = []
    found: dict[MetaStepType, dict[int | None, list[int]]] = {T.PREPROCESS_FWD: {}, T.PREPROCESS_BWD: {}}
    for kind, steps in found.items():
        for step in view.of_type.get(kind, []):
            steps.setdefault(step.micro_index, []).append(step.stage_index)
    reduces: dict[int, int] = defaultdict(int)
    for step in view.of_type.get(T.PREPROCESS_REDUCE, []):
        reduces[view.position[step][0]] += 1
    forwards, backwards = found[T.PREPROCESS_FWD], found[T.PREPROCESS_BWD]
    if not forwards and (backwards or reduces):
        return [("the order has PB/REDUCE_P steps but no preprocess forward (PF)", [])]
    for name, by_micro in (("PF", forwards), ("PB", backwards)):
        if not by_micro:
            continue
        twice = sorted((i, st) for i, st in by_micro.items() if len(st) > 1 and i is not None)
        if twice:
            problems.append(
                (
                    f"the preprocess {name} of micro-batches {[i for i, _ in twice]} runs more than once "
                    f"(stages {[st for _, st in twice]}); each micro-batch has exactly one owner",
                    [],
                )
            )
        covered = set(by_micro)
        if covered != expected:
            problems.append(
                (
                    f"{name} steps cover micro-batches {_ranges(covered & expected)}, expected every "
                    f"micro-batch 0 .. {max(expected, default=-1)}; missing {_ranges(expected - covered)}",
                    [],
                )
            )
    if reduces:
        bad = sorted(r for r in view.order if reduces.get(r, 0) != 1)
        if bad:
            problems.append(
                (
                    f"REDUCE_P is a collective over every rank: each rank needs exactly one, but ranks "
                    f"{bad} have {[reduces.get(r, 0) for r in bad]}",
                    [],
                )
            )
    return problems


_MPIPE: dict[str, Any] = {"group": MPIPE_GROUP, "check": _counts}

MPIPE_KINDS = (
    StepKind(
        "PREPROCESS_FWD",
        "PF",
        "MPipe: run the preprocess tower on the owning rank",
        busy=True,
        needs=loaded_here,
        feeds=_tower_feeds_stage0,
        cost="preprocess_forward",
        colour="#edc948",
        **_MPIPE,
    ),
    StepKind(
        "PREPROCESS_BWD",
        "PB",
        "MPipe: backpropagate through the tower",
        busy=True,
        training_only=True,
        needs=_tower_backward_needs,
        edges=_tower_backward_edges,
        cost="preprocess_backward",
        colour="#e15759",
        **_MPIPE,
    ),
    StepKind(
        "PREPROCESS_SEND",
        "SEND_P",
        "MPipe: send the tower's features to stage 0",
        transfer="send",
        matching="RECV_P",
        needs=_tower_forward_of,
        **_MPIPE,
    ),
    StepKind(
        "PREPROCESS_RECV",
        "RECV_P",
        "MPipe: receive the tower's features on stage 0",
        transfer="recv",
        matching="SEND_P",
        consumer=_stage_forward,
        **_MPIPE,
    ),
    StepKind(
        "PREPROCESS_GRAD_SEND",
        "SEND_PG",
        "MPipe: send dL/dfeatures back to the owner",
        transfer="send",
        matching="RECV_PG",
        needs=_input_grad_of,
        carries_backward=True,
        training_only=True,
        **_MPIPE,
    ),
    StepKind(
        "PREPROCESS_GRAD_RECV",
        "RECV_PG",
        "MPipe: receive dL/dfeatures on the owner",
        transfer="recv",
        matching="SEND_PG",
        consumer=_tower_backward_of,
        training_only=True,
        **_MPIPE,
    ),
    StepKind(
        "PREPROCESS_REDUCE",
        "REDUCE_P",
        "MPipe: sum the tower's gradients over the ranks",
        whole_stage=True,
        collective=True,
        training_only=True,
        runs_while_draining=True,
        needs=_rank_tower_backwards,
        cost="preprocess_reduce",
        colour="#af7aa1",
        **_MPIPE,
    ),
)
