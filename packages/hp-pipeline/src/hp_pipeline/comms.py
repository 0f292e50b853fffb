"""``insert_comms``: turn a compute-only order into one an executor can run.

Details: [Note: deadlock-free placement].
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Mapping, Sequence
from fractions import Fraction

from hp_pipeline._checks import check_costs, check_order_mapping
from hp_pipeline._deps import Edge, OrderView
from hp_pipeline.errors import ScheduleError
from hp_pipeline.ir import MetaStep, MetaStepType, Order
from hp_pipeline.simulate import StepCosts, _timelines
from hp_pipeline.validate import validate_order

__all__ = ["insert_comms"]

_PAIR, _LOCAL = 0, 1  # at equal times pairs go first, so a RECV precedes its consumer


# [Note: deadlock-free placement]
# Every cross-rank dependency becomes a *pair*, a SEND on the producer's rank and
# the matching RECV on the consumer's rank. The pass builds one global sequence
# of all steps and pairs (a topological order of the data-flow graph plus each
# rank's program order) and appends each pair to *both* ranks' lists at the same
# point of that sequence. Every rank's list is then a subsequence of one global
# sequence in which each pair is a single event, so executing the global
# sequence in order is always possible, even with blocking (rendezvous) sends:
# whenever a pair comes up, both ranks have finished everything before it and
# stand at its SEND and RECV. Two ranks therefore always post their transfers to
# each other in the same relative order; sends and receives never cross.
#
# Among the steps that are ready, the sequence takes the earliest in simulated
# time (pairs first at equal times), using the simulator's timing of the
# compute-only order. So a SEND comes right after the step that produced its
# payload, and a RECV lands where the data arrives, before the step that needs
# it, without delaying anything under the simulator's model.
#
# Adjacent stages on the same rank (the turn of a V, or a whole V on one rank)
# need no pair: the producer precedes the consumer in the rank's own list.
#
# An ``OVERLAP_F_B`` step is one node of the sequence: every transfer into
# either half comes before the pair, and each half's sends follow it, the
# forward's first (its outputs are ready when the forward ends, see [Note:
# running overlapped steps] in :mod:`hp_pipeline.overlap`).


def insert_comms(
    order: Mapping[int, Sequence[MetaStep]],
    *,
    data_stages: Collection[int] | None = None,
    costs: StepCosts | None = None,
) -> Order:
    """Add the SEND/RECV steps ``order`` needs, placed so that it cannot deadlock.

    Activations go from stage ``s`` to ``s+1`` (``SEND_F``/``RECV_F``), gradients
    from ``s+1`` to ``s`` (``SEND_B``/``RECV_B``), only between stages on
    different ranks; see [Note: deadlock-free placement]. The input is not
    modified.

    Args:
        order: a compute-only order (``F``/``B``/``I``/``W``, optionally FSDP
            steps and any plug-in kind's steps, such as MPipe's
            ``PF``/``PB``/``REDUCE_P`` and ``LOAD``),
            e.g. from a builder. It is validated first.
        data_stages: when given, the micro-batches are loaded on stage 0's rank
            (a ``LOAD`` step before each ``F`` of stage 0) and sent to each of
            these other stages that needs them (``SEND_D``/``RECV_D``), e.g.
            ``[num_stages - 1]`` for a loss stage that needs the targets. A
            stage on the loading rank receives nothing: it reads the loaded
            batch. When the order already has ``LOAD`` steps (MPipe loads each
            micro-batch on its owner), those are kept and the data goes from
            each micro-batch's loading stage to these stages.
        costs: the step costs used to decide where transfers go; the default
            ``StepCosts()`` suits most cases. Any costs give a valid order.

    Returns:
        A new order that passes ``validate_order(..., require_comms=True)``.

    Raises:
        ScheduleError: the input order is invalid (see ``validate_order``).
        ValueError: the input already has communication or data steps, or
            ``data_stages`` names a stage that does not exist.
    """
    check_order_mapping("insert_comms", order)
    check_costs("insert_comms", costs)
    if data_stages is not None and (
        isinstance(data_stages, (str, bytes)) or not isinstance(data_stages, Collection)
    ):
        raise TypeError(
            f"insert_comms: data_stages={data_stages!r} is a {type(data_stages).__name__}, not a collection "
            f"of stage indices; pass e.g. data_stages=[{data_stages!r}] (or None: no data transfers)"
        )
    view = OrderView(order)
    present = sorted({s.type.name for s in view.position if s.type.is_comm})
    if present:
        raise ValueError(
            f"insert_comms takes a compute-only order, but this one already has {present} "
            "steps; pass the builder's order (F/B/I/W and FSDP steps only)"
        )
    preloaded = bool(view.loader_of)
    if preloaded and data_stages is None:
        data_stages = ()
    validate_order(order)
    consumers: list[int] = []
    if data_stages is not None:
        consumers = _data_consumers(data_stages, view)
        if not preloaded:
            view = OrderView(_with_loads(view))
    costs = StepCosts() if costs is None else costs
    folded, flat = _timelines(view, costs)
    start = {  # every entry of the lists, and each half of a pair
        timed.step: (timed.start, timed.end)
        for timeline in (flat, folded)
        for steps in timeline.values()
        for timed in steps
    }
    edges = [
        edge
        for steps in view.order.values()
        for node in steps
        for edge in view.node_edges(node)
        if not view.same_rank(edge.producer.stage_index, edge.consumer.stage_index)
    ]
    edges += _data_edges(view, consumers)
    result = _merge(view, edges, start)
    validate_order(result, require_comms=True)
    return result


def _data_consumers(data_stages: Collection[int], view: OrderView) -> list[int]:
    stages = sorted(set(data_stages))
    for stage in stages:
        if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < view.num_stages:
            raise ValueError(
                f"insert_comms: data_stages must be stage indices in 0 .. {view.num_stages - 1}, "
                f"got {stage!r} in {sorted(data_stages, key=str)!r}"
            )
    return stages


def _with_loads(view: OrderView) -> Order:
    """A copy of the order with ``LOAD`` right before each forward of stage 0."""
    result: Order = {}
    for rank, steps in view.order.items():
        out: list[MetaStep] = []
        for step in steps:
            for part in step.parts:  # a pair's forward loads before the pair
                if part.type is MetaStepType.FWD and part.stage_index == 0:
                    out.append(MetaStep(part.micro_index, MetaStepType.DATA_LOAD, 0))
            out.append(step)
        result[rank] = out
    return result


def _data_edges(view: OrderView, consumers: list[int]) -> list[Edge]:
    """One edge per micro-batch and data stage on another rank than the stage that loads it.

    A stage on the loader's rank shares the loaded batch without a transfer.
    """
    return [
        Edge(
            MetaStep(i, MetaStepType.DATA_LOAD, loader),
            MetaStep(i, MetaStepType.FWD, stage),
            MetaStep(i, MetaStepType.DATA_SEND, loader, stage),
            MetaStep(i, MetaStepType.DATA_RECV, stage, loader),
        )
        for i, loader in sorted(view.loader_of.items())
        for stage in consumers
        if not view.same_rank(stage, loader)
    ]


def _merge(
    view: OrderView,
    edges: list[Edge],
    times: dict[MetaStep, tuple[Fraction, Fraction]],
) -> Order:
    """Kahn's algorithm over steps and pairs, earliest simulated time first."""
    # A node is ("local", step) or ("pair", edge index); the heap holds (key, node id).
    pending: dict[MetaStep, int] = {}  # local step -> unmet inputs
    waiting_on: dict[MetaStep, list[int]] = {}  # producer -> pairs it releases
    for steps in view.order.values():
        for pos, step in enumerate(steps):
            pending[step] = 1 if pos else 0
    for index, edge in enumerate(edges):
        pending[view.node(edge.consumer)] += 1
        waiting_on.setdefault(edge.producer, []).append(index)
    heap: list[tuple[tuple[Fraction, int, int, int], MetaStep | int]] = []

    def push_local(rank: int, pos: int) -> None:
        step = view.order[rank][pos]
        heapq.heappush(heap, ((times[step][0], _LOCAL, rank, pos), step))

    for rank, steps in view.order.items():
        if steps and pending[steps[0]] == 0:
            push_local(rank, 0)
    result: Order = {rank: [] for rank in view.order}
    emitted = 0
    total = len(pending) + len(edges)
    while heap:
        _, node = heapq.heappop(heap)
        emitted += 1
        released: list[MetaStep] = []
        if isinstance(node, MetaStep):
            rank, pos = view.position[node]
            result[rank].append(node)
            if pos + 1 < len(view.order[rank]):
                released.append(view.order[rank][pos + 1])
            for part in node.parts:
                for index in waiting_on.get(part, ()):
                    edge = edges[index]
                    sender = view.position[edge.producer][0]
                    heapq.heappush(heap, ((times[edge.producer][1], _PAIR, sender, index), index))
        else:
            edge = edges[node]
            result[view.position[edge.producer][0]].append(edge.send)
            result[view.position[edge.consumer][0]].append(edge.recv)
            released.append(view.node(edge.consumer))
        for step in released:
            pending[step] -= 1
            if pending[step] == 0:
                push_local(*view.position[step])
    if emitted != total:  # pragma: no cover - validate_order rejected cyclic inputs already
        raise ScheduleError("insert_comms found a dependency cycle", view.order)
    return result
