"""``simulate``: time an order with per-step costs, exactly.

People choose between schedules by their bubble and their activation memory;
the simulator gives both without a cluster, in exact arithmetic
(:class:`fractions.Fraction`), so the textbook formulas can be checked with
``==`` rather than with a tolerance.

Details in the [Note]s below: timing model, bubble definitions, live
activations, device activations.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import NamedTuple

from hp_pipeline._checks import check_bool, check_costs, check_order_mapping
from hp_pipeline._deps import OrderView, walk_order
from hp_pipeline.costs import StepCosts
from hp_pipeline.errors import ScheduleError
from hp_pipeline.ir import MetaStep, MetaStepType
from hp_pipeline.overlap import split_order
from hp_pipeline.validate import validate_order

__all__ = ["SimulationResult", "StepCosts", "TimedStep", "simulate"]


# [Note: timing model]
# * Every rank starts at time 0 and runs its list in order, one step at a time.
# * A compute step (and ``LOAD``, ``UNSHARD``, ``RESHARD``, ``REDUCE_GRAD``, and
#   any other kind that is not a transfer) takes the cost its kind declares
#   ([Note: step-kind registry] in :mod:`hp_pipeline.kinds`), read from
#   :class:`StepCosts`. It starts when the rank is free and every
#   input from another rank has arrived (see ``_deps.py`` [Note: dependency model]).
# * An input from another rank arrives ``comm`` after it was sent. In an order with
#   communication steps it is sent when the sender reaches the ``SEND`` step; in
#   a compute-only order, when the producing step ends.
# * ``SEND`` and ``RECV`` take no time on the rank: sends are issued
#   asynchronously and receives are posted early and waited for by the step that
#   needs the data, which is how the executor runs them. Whether an order could
#   deadlock under blocking point-to-point is ``validate_order``'s question, not
#   the simulator's.
# * An ``OVERLAP_F_B`` runs as the executor runs it ([Note: running overlapped
#   steps] in :mod:`hp_pipeline.overlap`): its forward, then its backward, each
#   at its own cost and waiting for its own inputs; the forward's outputs leave
#   when the forward ends. Its entry in the timeline spans both halves; its
#   compute time is the halves' costs. With ``StepCosts.overlap_f_b`` set, the
#   pair is instead one step of that cost (two streams on an accelerator): it
#   starts when both halves' inputs are there and both halves end with it,
#   which is how DualPipe's bubble formula counts.
# * A step of a ``collective`` kind (MPipe's ``REDUCE_P``) starts on every rank
#   when the last rank reaches it and ends after its cost ([Note: order walk]
#   in :mod:`hp_pipeline._deps`).


class TimedStep(NamedTuple):
    """A step and when it ran; SEND/RECV have ``start == end``."""

    step: MetaStep
    start: Fraction
    end: Fraction


# [Note: bubble definitions]
# With ``compute[r]`` the time rank ``r`` spends in ``F``/``B``/``I``/``W`` (and
# in the steps of any kind declared ``busy``, e.g. MPipe's tower steps ``PF``/``PB``) and
# ``idle[r] = makespan - compute[r]``:
#
# * ``bubble_ratio[r] = idle[r] / makespan``, the share of the step rank ``r``
#   does no model compute. GPipe and 1F1B with ``F = B`` and ``comm = 0`` give
#   exactly ``(p-1)/(m+p-1)``, the GPipe paper's figure.
# * ``bubble_overhead[r] = idle[r] / compute[r]``, the bubble relative to the ideal
#   (bubble-free) compute time, as in the Megatron-LM paper. Interleaved 1F1B with
#   ``v`` stages per rank, ``m`` a multiple of ``p``, ``F = B`` and ``comm = 0``
#   gives exactly ``(p-1)/(v*m)``; for GPipe and 1F1B it is ``(p-1)/m``.
#
# The two are related by ``ratio = overhead / (1 + overhead)``.


# [Note: device activations]
# ``peak_device_activations_per_rank`` counts the micro-batches whose saved
# activations are on the device, walking each rank's list in order as the
# executor does: every step changes the count by what its kind declares
# (``StepKind.resident``: ``F`` +1, ``B`` and ``W`` -1, ``SWAP_OUT`` -1 and
# ``SWAP_IN`` +1, see :mod:`hp_pipeline.swap`), and the peak is the largest
# count after any step. Without swap steps it equals
# ``peak_activations_per_rank`` (a rank runs its steps one after another, so
# list order is time order); with them it is the figure the executor's swap
# accounting measures, in micro-batches ([Note: activation accounting] in
# :mod:`hp_pipeline.swap`).


@dataclass(frozen=True)
class SimulationResult:
    """What :func:`simulate` measured. See ``simulate.py`` for the exact definitions.

    Attributes:
        makespan: when the last step on any rank ends.
        timeline: rank -> its steps with start and end times, in list order (an
            ``OVERLAP_F_B`` is one entry, from its forward's start to its backward's end).
        compute_time: rank -> time spent in ``F``/``B``/``I``/``W``.
        idle_time: rank -> ``makespan - compute_time``.
        bubble_ratio: rank -> ``idle / makespan`` ([Note: bubble definitions]).
        bubble_overhead: rank -> ``idle / compute`` (ranks with compute only).
        peak_activations: stage -> most micro-batches live at once.
        peak_activations_per_rank: rank -> most (stage, micro-batch) pairs live at once.
        peak_device_activations_per_rank: rank -> most (stage, micro-batch) pairs whose
            activations are on the device at once: less than the live figure when the
            order swaps to host memory ([Note: device activations]).
    """

    makespan: Fraction
    timeline: dict[int, list[TimedStep]]
    compute_time: dict[int, Fraction]
    idle_time: dict[int, Fraction]
    bubble_ratio: dict[int, Fraction]
    bubble_overhead: dict[int, Fraction]
    peak_activations: dict[int, int]
    peak_activations_per_rank: dict[int, int]
    peak_device_activations_per_rank: dict[int, int] = field(default_factory=dict)

    def peak_device_bytes(self, rank: int, micro_bytes: int | Mapping[tuple[int, int], int]) -> int:
        """Rank ``rank``'s peak of saved-activation bytes on the device ([Note: device activations]).

        ``micro_bytes``: the bytes one micro-batch's activations take, the same
        for all, or per ``(stage, micro)`` (what the executor's
        ``SwapStats.bytes_by_micro`` gives), so uneven stages and micro-batches
        are counted exactly.
        """
        return _device_peak(self.timeline[rank], micro_bytes)

    @property
    def total_bubble_ratio(self) -> Fraction:
        """Idle time over all ranks divided by ``num_ranks * makespan``."""
        if not self.makespan:
            return Fraction(0)
        return sum(self.idle_time.values(), Fraction(0)) / (len(self.idle_time) * self.makespan)

    @property
    def total_idle_time(self) -> Fraction:
        return sum(self.idle_time.values(), Fraction(0))


def simulate(
    order: Mapping[int, Sequence[MetaStep]],
    costs: StepCosts | None = None,
    *,
    validate: bool = True,
) -> SimulationResult:
    """Run ``order`` on a model of the machine and report makespan, bubbles and memory.

    Works on compute-only orders (what the builders return) and on orders with
    communication steps (after :func:`~hp_pipeline.insert_comms`); with
    ``comm = 0`` both give the same times.

    Args:
        order: rank -> steps.
        costs: per-step-type costs; ``StepCosts()`` if omitted.
        validate: run :func:`~hp_pipeline.validate_order` first (recommended:
            timing a broken order answers the wrong question).

    Raises:
        ScheduleError: the order is invalid (or, with ``validate=False``, stalls).
    """
    check_order_mapping("simulate", order)
    check_costs("simulate", costs)
    check_bool("simulate", "validate", validate)
    if validate:
        validate_order(order)
    costs = StepCosts() if costs is None else costs
    view = OrderView(order)
    timeline, flat = _timelines(view, costs)
    makespan = max((t.end for steps in timeline.values() for t in steps), default=Fraction(0))
    compute = {
        rank: sum(
            (t.end - t.start for t in steps if t.step.type.busy),
            Fraction(0),
        )
        for rank, steps in flat.items()
    }
    idle = {rank: makespan - busy for rank, busy in compute.items()}
    ratio = {rank: (idle[rank] / makespan if makespan else Fraction(0)) for rank in timeline}
    overhead = {rank: idle[rank] / busy for rank, busy in compute.items() if busy}
    per_stage, per_rank = _peak_activations(view, flat)
    return SimulationResult(
        makespan=makespan,
        timeline=timeline,
        compute_time=compute,
        idle_time=idle,
        bubble_ratio=ratio,
        bubble_overhead=overhead,
        peak_activations=per_stage,
        peak_activations_per_rank=per_rank,
        peak_device_activations_per_rank={rank: _device_peak(steps, 1) for rank, steps in timeline.items()},
    )


def _timelines(
    view: OrderView, costs: StepCosts
) -> tuple[dict[int, list[TimedStep]], dict[int, list[TimedStep]]]:
    """The timeline of the lists as given, and of their split form (each half of a pair on its own).

    Without ``OVERLAP_F_B`` steps the two are the same object.
    """
    if not view.has_overlaps or costs.overlap_f_b is not None:
        flat = _run(view, costs)  # pairs, if any, as single steps
        return flat, flat
    flat = _run(OrderView(split_order(view.order)), costs)
    folded: dict[int, list[TimedStep]] = {}
    for rank, steps in view.order.items():
        when = {t.step: t for t in flat[rank]}
        folded[rank] = [
            TimedStep(step, when[step.sub_steps[0]].start, when[step.sub_steps[1]].end)
            if step.sub_steps is not None
            else when[step]
            for step in steps
        ]
    return folded, flat


def _run(view: OrderView, costs: StepCosts) -> dict[int, list[TimedStep]]:
    """Start and end of every step; a pair is one step of ``costs.overlap_f_b``."""
    order = view.order
    clock = {rank: Fraction(0) for rank in order}
    finished: dict[MetaStep, Fraction] = {}
    sent: dict[MetaStep, Fraction] = {}
    timeline: dict[int, list[TimedStep]] = {rank: [] for rank in order}
    comm = Fraction(costs.comm)

    def arrival(step: MetaStep) -> Fraction | None:
        """When every cross-rank input of ``step`` is usable, or None if one is not yet sent."""
        latest = Fraction(0)
        for edge in view.node_edges(step):
            if view.same_rank(edge.producer.stage_index, edge.consumer.stage_index):
                continue
            source = sent.get(edge.send) if view.has_comms else finished.get(edge.producer)
            if source is None:
                return None
            latest = max(latest, source + comm)
        return latest

    def run(rank: int, step: MetaStep) -> bool:
        now = clock[rank]
        if step.type.is_comm:
            if step.type.is_send:
                sent[step] = now
            timeline[rank].append(TimedStep(step, now, now))
            return True
        ready = arrival(step)
        if ready is None:
            return False
        start = max(now, ready)
        end = start + costs.of(step.type)
        for part in step.parts:
            finished[part] = end
        finished[step] = clock[rank] = end
        timeline[rank].append(TimedStep(step, start, end))
        return True

    def collective(steps: dict[int, MetaStep]) -> None:
        # It starts when the last rank reaches it, on every rank.
        start = max(clock.values())
        for r, s in steps.items():
            end = start + costs.of(s.type)
            finished[s] = clock[r] = end
            timeline[r].append(TimedStep(s, start, end))

    head = walk_order(view, run, collective=collective)
    stuck = [(rank, head[rank]) for rank in sorted(order) if head[rank] < len(order[rank])]
    if stuck:
        raise ScheduleError(
            "the simulation stalls: these steps wait for inputs that are never sent "
            "(run validate_order for the reason)",
            order,
            [f"rank {r} waits in {order[r][p]}" for r, p in stuck],
            stuck,
        )
    return timeline


def _device_peak(steps: Sequence[TimedStep], micro_bytes: int | Mapping[tuple[int, int], int]) -> int:
    """The peak of one rank's list, each micro-batch weighing ``micro_bytes`` ([Note: device activations])."""
    live = peak = 0
    for timed in steps:
        for part in timed.step.parts:
            delta = part.type.spec.resident
            if not delta:
                continue
            if isinstance(micro_bytes, int):
                weight = micro_bytes
            else:
                key = (part.stage_index, part.micro_index)
                if key not in micro_bytes:
                    raise KeyError(
                        f"peak_device_bytes: no size for stage {key[0]}'s micro-batch {key[1]} (step "
                        f"{part}); give one per (stage, micro) of the rank, or one int for all"
                    )
                weight = micro_bytes[key]  # type: ignore[index]
            live += delta * weight
            peak = max(peak, live)
    return peak


# [Note: live activations]
# A micro-batch's activations on a stage are live from the start of its ``F`` to
# the end of its last backward step there (``B``, or ``W`` when the backward is
# split: the weight gradient still needs the saved inputs). Where one step frees
# and another allocates at the same instant, the free counts first.


def _peak_activations(
    view: OrderView, timeline: Mapping[int, Sequence[TimedStep]]
) -> tuple[dict[int, int], dict[int, int]]:
    """Peak live micro-batches per stage and per rank ([Note: live activations])."""
    start: dict[tuple[int, int], Fraction] = {}
    end: dict[tuple[int, int], Fraction] = {}
    for steps in timeline.values():
        for timed, step in ((t, part) for t in steps for part in t.step.parts):
            if step.micro_index is None:
                continue
            key = (step.stage_index, step.micro_index)
            if step.type is MetaStepType.FWD:
                start[key] = timed.start
            elif step.type in (MetaStepType.BWD, MetaStepType.BWD_WEIGHT):
                end[key] = max(end.get(key, timed.end), timed.end)
    events: dict[int, list[tuple[Fraction, int]]] = defaultdict(list)
    for key, t0 in start.items():
        events[key[0]].append((t0, +1))
        if key in end:
            events[key[0]].append((end[key], -1))

    def peak(evs: list[tuple[Fraction, int]]) -> int:
        best = live = 0
        for _, delta in sorted(evs):  # -1 sorts before +1: frees first at equal times
            live += delta
            best = max(best, live)
        return best

    per_stage = {stage: peak(events[stage]) for stage in sorted(view.stage_rank)}
    per_rank = {}
    for rank in sorted(view.order):
        merged = [e for stage, r in view.stage_rank.items() if r == rank for e in events[stage]]
        per_rank[rank] = peak(merged)
    return per_stage, per_rank
