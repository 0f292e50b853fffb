"""``validate_order``: reject a schedule before it can hang or corrupt a training step.

A wrong schedule on a real cluster shows up as a hang (every rank waiting in a
recv) or as silently wrong gradients; both are expensive to debug on many
devices. The checks here run on the order alone, in one process, and print the
rank x step grid with the offending steps marked.

[Note: blocking semantics]
The deadlock check executes the order with *rendezvous* point-to-point: a SEND
completes only when the peer is at the matching RECV, and vice versa. That is
the strictest behaviour a backend may show (NCCL and gloo sends of large
tensors block until received), so an order that passes also runs under any
buffering backend, and under an executor that posts receives early.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence

from hp_pipeline._checks import check_bool, check_int, check_order_mapping
from hp_pipeline._deps import OrderView, matching, walk_order
from hp_pipeline.errors import ScheduleError
from hp_pipeline.ir import MetaStep, MetaStepType

__all__ = ["validate_order"]

# One entry per offending step: the sentence, and the (rank, position) cells to mark.
Problems = list[tuple[str, list[tuple[int, int]]]]


def validate_order(
    order: Mapping[int, Sequence[MetaStep]],
    *,
    n_microbatches: int | None = None,
    num_stages: int | None = None,
    require_comms: bool = False,
) -> None:
    """Check that ``order`` is a complete, correctly ordered, deadlock-free schedule.

    Rules, checked in this order (the first rule that fails raises):

    1. every step appears once and each stage's steps sit on one rank;
    2. stages ``0 .. num_stages-1`` all exist, communication names existing
       adjacent stages on *other* ranks (same-rank stages hand off locally);
    3. each stage runs ``F`` exactly once per micro-batch ``0 .. m-1`` and either
       ``B``, or both ``I`` and ``W``, for each;
    4. within a rank, everything a step needs comes before it: ``F`` before its
       ``B``/``I``, ``I`` before ``W``, ``F`` of stage ``s`` before ``F`` of
       ``s+1`` (and backward the other way) when both stages share the rank,
       the producer before a SEND, a RECV before its consumer;
    5. when the order has communication steps (or ``require_comms``), every
       cross-rank dependency is carried by a SEND on the producer's rank and the
       matching RECV on the consumer's rank, with no unmatched SEND or RECV;
    6. an ``OVERLAP_F_B`` pairs two steps that do not need each other, since
       a runtime may start both at once ([Note: running overlapped steps]):
       ``MetaStep`` refuses a backward paired with its own forward, rule 4
       a need through the rank's other stage (it would come after the pair),
       rule 7 a need through other ranks (the pair waits for all its inputs);
       FSDP steps, if any: a stage computes only while unsharded, and
       ``REDUCE_GRAD`` follows the stage's last backward; each micro-batch is
       loaded once; a plug-in kind's own ``check`` (MPipe's: one ``PF``, and
       if any one ``PB``, per micro-batch, one ``REDUCE_P`` per rank);
    7. executing the order with blocking point-to-point never deadlocks (see
       [Note: blocking semantics]); for a compute-only order, a step simply
       waits for its producers on other ranks.

    Args:
        order: rank -> steps.
        n_microbatches: the expected ``m``; inferred from the forwards if omitted.
        num_stages: the expected number of stages; inferred if omitted.
        require_comms: also fail a compute-only order whose stages span ranks,
            i.e. demand an order that an executor can run as is.

    Raises:
        ScheduleError: (a ``ValueError``) naming the rule, each offending step,
            and the grid with those steps marked.
    """
    check_order_mapping("validate_order", order)
    check_int("validate_order", "n_microbatches", n_microbatches, least=1, allow_none=True)
    check_int("validate_order", "num_stages", num_stages, least=1, allow_none=True)
    check_bool("validate_order", "require_comms", require_comms)
    view = OrderView(order)
    _check_structure(view, num_stages)
    _check_counts(view, n_microbatches)
    _check_local_order(view)
    if view.has_comms or require_comms:
        _check_comms(view)
    _check_fsdp(view)
    _check_deadlock(view)


def _fail(view: OrderView, summary: str, problems: Problems) -> None:
    if problems:
        raise ScheduleError(
            summary, view.order, [p for p, _ in problems], [m for _, ms in problems for m in ms]
        )


def _check_structure(view: OrderView, num_stages: int | None) -> None:
    problems: Problems = []
    if not view.position:
        raise ScheduleError("the order has no steps", view.order)
    if num_stages is not None and num_stages != view.num_stages:
        problems.append(
            (
                f"the order has {view.num_stages} stages (highest stage index "
                f"{view.num_stages - 1}), but num_stages={num_stages}",
                [],
            )
        )
    missing = [s for s in range(view.num_stages) if view.rank_of(s) is None]
    if missing:
        problems.append(
            (
                f"stages {missing} have no steps on any rank (stages must be numbered "
                f"0 .. {view.num_stages - 1} without gaps)",
                [],
            )
        )
    for step, where in view.position.items():
        if not step.type.is_comm:
            continue
        peer = step.peer_stage
        assert peer is not None  # MetaStep gives every SEND/RECV a peer
        if step.default_peer is not None and peer != step.default_peer:
            problems.append(
                (
                    f"{step} talks to stage {peer}; {step.type.name} goes to the adjacent stage "
                    f"{step.default_peer}",
                    [where],
                )
            )
        elif view.rank_of(peer) is None:
            problems.append((f"{step} names stage {peer}, which has no steps", [where]))
        elif view.same_rank(step.stage_index, peer):
            problems.append(
                (
                    f"{step} communicates between stages {step.stage_index} and {peer}, which both "
                    f"run on rank {where[0]}; adjacent stages on one rank hand off locally, "
                    "without SEND/RECV",
                    [where],
                )
            )
    _fail(view, "the order's stages or communication peers are inconsistent", problems)


def _check_counts(view: OrderView, n_microbatches: int | None) -> None:
    micros = [s.micro_index for s in view.position if s.type is MetaStepType.FWD]
    if n_microbatches is None:
        if not micros:
            raise ScheduleError("the order has no forward (F) steps", view.order)
        m = max(m for m in micros if m is not None) + 1
    else:
        m = n_microbatches
    problems: Problems = []
    by_stage: dict[tuple[int, MetaStepType], set[int]] = defaultdict(set)
    for step, where in view.position.items():
        if step.micro_index is None or step.sub_steps is not None:  # a pair counts as its halves
            continue
        if step.micro_index >= m:
            problems.append(
                (
                    f"{step} is for micro-batch {step.micro_index}, but there are only {m} (0 .. {m - 1})",
                    [where],
                )
            )
        by_stage[step.stage_index, step.type].add(step.micro_index)
    expected = set(range(m))
    for stage in range(view.num_stages):
        fwd = by_stage[stage, MetaStepType.FWD]
        if fwd != expected:
            problems.append(
                (
                    f"stage {stage} runs F for {_ranges(fwd & expected)}, expected "
                    f"every micro-batch 0 .. {m - 1}; missing {_ranges(expected - fwd)}",
                    [],
                )
            )
        full = by_stage[stage, MetaStepType.BWD]
        split_i = by_stage[stage, MetaStepType.BWD_INPUT]
        split_w = by_stage[stage, MetaStepType.BWD_WEIGHT]
        both = full & (split_i | split_w)
        if both:
            problems.append(
                (
                    f"stage {stage} has both B and I/W for micro-batches {_ranges(both)}; use B, "
                    "or split it into I and W",
                    [],
                )
            )
        missing_b = expected - full - split_i - split_w
        if missing_b:
            problems.append(
                (f"stage {stage} has no backward (B, or I and W) for micro-batches {_ranges(missing_b)}", [])
            )
        if split_i != split_w:
            odd = split_i ^ split_w
            problems.append(
                (
                    f"stage {stage}: micro-batches {_ranges(odd)} have only one of I and W; a "
                    "split backward needs both",
                    [],
                )
            )
    loads = [s for s in view.position if s.type is MetaStepType.DATA_LOAD]
    loaded: dict[int | None, list[int]] = defaultdict(list)
    for step in loads:
        loaded[step.micro_index].append(step.stage_index)
    twice = {i: stages for i, stages in loaded.items() if len(stages) > 1}
    if twice:
        problems.append(
            (
                "micro-batches are loaded more than once ("
                + ", ".join(f"{i} on stages {sorted(st)}" for i, st in sorted(twice.items(), key=str))
                + "); load each on one stage and send the data to the others",
                [],
            )
        )
    elif loads and set(loaded) != expected:
        problems.append(
            (
                f"DATA_LOAD steps cover micro-batches {_ranges(set(loaded) & expected)}, "
                f"expected 0 .. {m - 1}",
                [],
            )
        )
    # Plug-in kinds' order-wide rules ([Note: step-kind registry]), each function once.
    checks = {kind.spec.check: None for kind in view.of_type if kind.spec.check is not None}
    for check in checks:
        problems += check(view, expected)
    _fail(view, f"the order does not run every stage once per micro-batch (m={m})", problems)


def _check_local_order(view: OrderView) -> None:
    problems: Problems = []
    for step, (rank, pos) in view.position.items():
        needs = list(view.local_inputs(step))
        needs += [
            e.producer
            for e in view.edges_into(step)
            if view.same_rank(e.producer.stage_index, step.stage_index)
        ]
        for need in needs:
            where = view.pos(need)
            if where is None:
                problems.append(
                    (
                        f"{step} (rank {rank}, position {pos}) needs {need}, which is not in the order",
                        [(rank, pos)],
                    )
                )
            elif where[0] == rank and where[1] > pos:
                problems.append(
                    (
                        f"{step} (rank {rank}, position {pos}) runs before {need} "
                        f"(position {where[1]}), which it needs",
                        [(rank, pos), where],
                    )
                )
        if step.type.is_recv:
            consumer = view.local_consumer(step)
            where = view.pos(consumer) if consumer is not None else None
            if where is not None and where[1] < pos:
                problems.append(
                    (
                        f"{step} (rank {rank}, position {pos}) arrives after {consumer} "
                        f"(position {where[1]}) already used it",
                        [(rank, pos), where],
                    )
                )
    _fail(view, "a step runs before a step it depends on", problems)


def _check_comms(view: OrderView) -> None:
    problems: Problems = []
    for step, where in view.position.items():
        if step.type.is_comm:
            other = matching(step)
            if other not in view.position:
                peer_rank = view.rank_of(other.stage_index)
                problems.append(
                    (f"{step} on rank {where[0]} has no matching {other} on rank {peer_rank}", [where])
                )
            continue
        for edge in view.edges_into(step):
            if view.same_rank(edge.producer.stage_index, step.stage_index):
                continue
            for half in (edge.send, edge.recv):
                if half not in view.position:
                    problems.append(
                        (
                            f"{step} on rank {where[0]} needs {edge.producer} from rank "
                            f"{view.rank_of(edge.producer.stage_index)}, but {half} is missing",
                            [where],
                        )
                    )
    _fail(view, "communication steps do not pair up", problems)


def _check_fsdp(view: OrderView) -> None:
    fsdp_stages = {s.stage_index for s in view.position if s.type.is_fsdp}
    problems: Problems = []
    for stage in sorted(fsdp_stages):
        rank = view.rank_of(stage)
        assert rank is not None
        has_unshard = any(s.type is MetaStepType.UNSHARD and s.stage_index == stage for s in view.position)
        unsharded = not has_unshard
        last_backward = max(
            (
                pos
                for s, (r, pos) in view.position.items()
                if s.stage_index == stage and s.type in (MetaStepType.BWD, MetaStepType.BWD_WEIGHT)
            ),
            default=-1,
        )
        for pos, step in ((pos, part) for pos, node in enumerate(view.order[rank]) for part in node.parts):
            if step.stage_index != stage:
                continue
            if step.type is MetaStepType.UNSHARD:
                unsharded = True
            elif step.type is MetaStepType.RESHARD:
                unsharded = False
            elif step.type.is_compute and not unsharded:
                problems.append(
                    (
                        f"{step} (rank {rank}, position {pos}) runs while stage {stage} "
                        "is resharded; UNSHARD it first",
                        [(rank, pos)],
                    )
                )
            elif step.type is MetaStepType.REDUCE_GRAD and pos < last_backward:
                problems.append(
                    (
                        f"{step} (rank {rank}, position {pos}) reduces gradients before "
                        f"the stage's last backward (position {last_backward})",
                        [(rank, pos), (rank, last_backward)],
                    )
                )
    _fail(view, "FSDP steps are out of order", problems)


def _check_deadlock(view: OrderView) -> None:
    """Run the order with rendezvous point-to-point ([Note: blocking semantics], [Note: order walk])."""
    order = view.order
    done: set[MetaStep] = set()

    def run(rank: int, step: MetaStep) -> bool:
        # With communication steps, cross-rank inputs arrive through RECVs that precede the step.
        if not view.has_comms and not all(e.producer in done for e in view.node_edges(step)):
            return False
        done.update(step.parts)
        return True

    head = walk_order(
        view,
        run,
        rendezvous=lambda step, other: done.update((step, other)),
        collective=lambda steps: done.update(steps.values()),
    )
    stuck = [(rank, head[rank]) for rank in sorted(order) if head[rank] < len(order[rank])]
    if not stuck:
        return

    def at(rank: int) -> MetaStep | None:
        return order[rank][head[rank]] if head[rank] < len(order[rank]) else None

    problems: Problems = []
    for rank, pos in stuck:
        step = order[rank][pos]
        if step.type.is_collective:
            others = [
                r
                for r in sorted(order)
                if r != rank and not ((now := at(r)) is not None and now.type.is_collective)
            ]
            problems.append(
                (
                    f"rank {rank} waits in the collective {step} for ranks {others} to reach "
                    f"their {step.type.code}",
                    [(rank, pos)],
                )
            )
        elif step.type.is_comm:
            other = matching(step)
            peer = view.rank_of(other.stage_index)
            assert peer is not None
            now = at(peer)
            where = f"is at {now} (position {head[peer]})" if now is not None else "has finished"
            problems.append(
                (
                    f"rank {rank} waits in {step} for rank {peer} to reach {other}; rank {peer} {where}",
                    [(rank, pos)],
                )
            )
        else:
            waiting = [e.producer for e in view.node_edges(step) if e.producer not in done]
            problems.append(
                (
                    f"rank {rank} waits in {step} for {', '.join(str(w) for w in waiting)} from another rank",
                    [(rank, pos)],
                )
            )
    _fail(
        view,
        "the order deadlocks: every remaining rank waits on another "
        "(blocking SEND/RECV, see validate.py [Note: blocking semantics])",
        problems,
    )


def _ranges(values: set[int | None] | set[int]) -> str:
    """``{0, 1, 2, 5}`` -> ``"[0-2, 5]"``, short enough for an error message."""
    nums = sorted(v for v in values if v is not None)
    if not nums:
        return "[]"
    parts, start, prev = [], nums[0], nums[0]
    for n in [*nums[1:], None]:
        if n is not None and n == prev + 1:
            prev = n
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if n is not None:
            start = prev = n
    return "[" + ", ".join(parts) + "]"
