"""The data-flow model every pass shares: which step needs which, and over which wire.

Details: [Note: dependency model], [Note: order walk].
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from hp_pipeline.errors import ScheduleError
from hp_pipeline.ir import MetaStep, MetaStepType

__all__ = ["Edge", "OrderView", "matching", "walk_order"]


# [Note: dependency model]
# Each step kind declares its own rules ([Note: step-kind registry] in
# :mod:`hp_pipeline.kinds`); :class:`OrderView` only indexes an order and asks
# them. For the built-in kinds (:mod:`hp_pipeline._builtin_kinds`) a step on
# stage ``s`` for micro-batch ``i`` depends on:
#
# * ``F(s, i)`` on ``F(s-1, i)`` (the activation), and on the loaded micro-batch
#   when ``s`` is the loading stage or receives the data (``RECV_D``);
# * ``B(s, i)`` / ``I(s, i)`` on ``F(s, i)`` and on the input-gradient backward
#   (``B`` or ``I``) of ``s+1`` for the same micro-batch (the output gradient);
# * ``W(s, i)`` on ``I(s, i)``;
# * a send on the step that produced its payload, and the consumer of a payload
#   on the receive that brought it.
#
# The rules come in four shapes: ``needs`` (same-stage steps that come earlier
# in the rank's list), ``edges`` (edges from other stages into the step),
# ``feeds`` (edges *out of* a step into another kind's step: how a plug-in
# adds an input to a built-in step, e.g. MPipe's tower forward feeding stage
# 0's ``F``, see :mod:`hp_pipeline.mpipe.kinds`) and, for a receive,
# ``consumer``. The loaded micro-batch comes from the stage whose ``LOAD``
# names it; a plain order loads everything on stage 0, an MPipe order loads
# each micro-batch on its owning rank.
#
# An edge between stages on different ranks is carried by a SEND/RECV pair once
# communication is inserted; an edge within a rank is a local hand-off, ordered
# by the rank's list alone.
#
# An ``OVERLAP_F_B`` step is a *node* of its rank's list that holds two steps
# (its ``parts``). The index places both halves at the pair's position, so every
# question about a half (where it runs, what it needs) has its usual answer;
# the pair itself needs what its halves need (:meth:`OrderView.node_edges`).


@dataclass(frozen=True)
class Edge:
    """``consumer`` needs what ``producer`` made; ``send``/``recv`` would carry it across ranks.

    When producer and consumer run on one rank the pair is unused (the rank's
    list orders them), so a rule may repeat the producer there.
    """

    producer: MetaStep
    consumer: MetaStep
    send: MetaStep
    recv: MetaStep


class OrderView:
    """Index of an order: where each step sits and which rank hosts each stage.

    Raises :class:`ScheduleError` when a step appears twice or a stage's steps
    are spread over several ranks, since no other question about the order has
    a meaningful answer then.
    """

    def __init__(self, order: Mapping[int, Sequence[MetaStep]]) -> None:
        self.order = {rank: list(steps) for rank, steps in order.items()}
        for rank, steps in self.order.items():
            if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
                raise ScheduleError(f"ranks must be ints >= 0, got {rank!r}", self.order)
            for pos, step in enumerate(steps):
                if not isinstance(step, MetaStep):
                    raise ScheduleError(
                        f"rank {rank} position {pos} holds {step!r}, not a MetaStep",
                        self.order,
                    )
        self.position: dict[MetaStep, tuple[int, int]] = {}
        self.stage_rank: dict[int, int] = {}
        #: the half of an OVERLAP_F_B step -> the pair (the node of the rank's list)
        self.parent: dict[MetaStep, MetaStep] = {}
        duplicates, misplaced = [], []
        first_at: dict[int, tuple[int, int]] = {}  # stage -> where it first appeared
        for rank in sorted(self.order):
            for pos, node in enumerate(self.order[rank]):
                for step in (node, *node.sub_steps) if node.sub_steps is not None else (node,):
                    if step in self.position:
                        first = self.position[step]
                        duplicates.append(((rank, pos), first, step))
                        continue
                    self.position[step] = (rank, pos)
                    if step is not node:
                        self.parent[step] = node
                    host = self.stage_rank.setdefault(step.stage_index, rank)
                    first_at.setdefault(step.stage_index, (rank, pos))
                    if host != rank:
                        misplaced.append(((rank, pos), first_at[step.stage_index], step))
        if duplicates:
            raise ScheduleError(
                "a step appears more than once; each step must run exactly once",
                self.order,
                [
                    f"{s} at rank {r} position {p} repeats rank {fr} position {fp}"
                    for (r, p), (fr, fp), s in duplicates
                ],
                [m for d in duplicates for m in d[:2]],
            )
        if misplaced:
            raise ScheduleError(
                "a stage has steps on more than one rank; each stage lives on exactly one rank",
                self.order,
                [
                    f"{s} is on rank {r} but stage {s.stage_index} already runs on rank {h} "
                    f"({self.order[h][p]} at position {p})"
                    for (r, _), (h, p), s in misplaced
                ],
                [m for d in misplaced for m in d[:2]],
            )
        stages = set(self.stage_rank)
        stages.update(s.peer_stage for s in self.position if s.peer_stage is not None)
        self.num_stages = max(stages) + 1 if stages else 0
        self.has_comms = any(s.type.is_comm for s in self.position)
        loaders = sorted({s.stage_index for s in self.position if s.type is MetaStepType.DATA_LOAD})
        self.loader_stage = loaders[0] if len(loaders) == 1 else None
        self.loader_stages = loaders
        # micro-batch -> the stage that loads it (first one found).
        self.loader_of: dict[int, int] = {}
        #: kind -> its steps, in the order of ``position`` (halves of pairs included).
        self.of_type: dict[MetaStepType, list[MetaStep]] = {}
        for step in self.position:
            self.of_type.setdefault(step.type, []).append(step)
            if step.type is MetaStepType.DATA_LOAD and step.micro_index is not None:
                self.loader_of.setdefault(step.micro_index, step.stage_index)
        self._edges: dict[MetaStep, list[Edge]] = {}
        self._fed: dict[MetaStep, list[Edge]] | None = None

    # -- lookups --------------------------------------------------------------

    def rank_of(self, stage: int) -> int | None:
        return self.stage_rank.get(stage)

    def pos(self, step: MetaStep) -> tuple[int, int] | None:
        return self.position.get(step)

    def backward_input(self, stage: int, micro: int) -> MetaStep:
        """The step that makes stage's input gradient: ``I`` when the order splits backward."""
        split = MetaStep(micro, MetaStepType.BWD_INPUT, stage)
        return split if split in self.position else MetaStep(micro, MetaStepType.BWD, stage)

    def own_load(self, step: MetaStep) -> list[MetaStep]:
        """``[LOAD]`` of the step's micro-batch when its own stage loads it, else ``[]``."""
        i, s = step.micro_index, step.stage_index
        return (
            [MetaStep(i, MetaStepType.DATA_LOAD, s)] if i is not None and self.loader_of.get(i) == s else []
        )

    def node(self, step: MetaStep) -> MetaStep:
        """The entry of a rank's list that runs ``step``: its pair, or the step itself."""
        return self.parent.get(step, step)

    @property
    def has_overlaps(self) -> bool:
        return bool(self.parent)

    def same_rank(self, a: int, b: int) -> bool:
        ra, rb = self.rank_of(a), self.rank_of(b)
        return ra is not None and ra == rb

    # -- the dependency model (see the module note) ---------------------------

    def edges_into(self, step: MetaStep) -> list[Edge]:
        """The edges from other stages into a local (non-comm) step (memoised: the passes ask often)."""
        edges = self._edges.get(step)
        if edges is None:
            edges = self._edges[step] = self._find_edges(step)
        return edges

    def node_edges(self, node: MetaStep) -> list[Edge]:
        """The edges into an entry of a list: into each half of a pair, else into the step."""
        if node.sub_steps is None:
            return self.edges_into(node)
        return [edge for part in node.sub_steps for edge in self.edges_into(part)]

    def _find_edges(self, step: MetaStep) -> list[Edge]:
        rule = step.type.spec.edges
        edges = list(rule(self, step)) if rule is not None else []
        return edges + self._fed_into().get(step, [])

    def _fed_into(self) -> dict[MetaStep, list[Edge]]:
        """The edges the ``feeds`` rules of the order's steps send into other steps, by consumer."""
        if self._fed is None:
            self._fed = {}
            for kind, steps in self.of_type.items():
                rule = kind.spec.feeds
                if rule is None:
                    continue
                for step in steps:
                    for edge in rule(self, step):
                        self._fed.setdefault(edge.consumer, []).append(edge)
        return self._fed

    def local_inputs(self, step: MetaStep) -> list[MetaStep]:
        """Same-stage steps that must come earlier in the same rank's list."""
        rule = step.type.spec.needs
        return list(rule(self, step)) if rule is not None else []

    def local_consumer(self, step: MetaStep) -> MetaStep | None:
        """For a RECV: the same-stage step that uses what it received."""
        rule = step.type.spec.consumer
        return rule(self, step) if rule is not None else None


def matching(step: MetaStep) -> MetaStep:
    """The other half of a SEND/RECV pair: same micro-batch, stage and peer swapped."""
    assert step.peer_stage is not None
    return MetaStep(step.micro_index, step.type.matching, step.peer_stage, step.stage_index)


# [Note: order walk]
# ``validate_order`` (does the order deadlock?) and ``simulate`` (when does each
# step run?) execute an order the same way: every rank runs its list in order,
# round robin, each as far as it can go; a step of a ``collective`` kind runs
# when every rank stands at one, on all of them together. :func:`walk_order` is
# that loop; the two passes differ only in what a rank's step waits for (a
# rendezvous with its peer's matching step, or the arrival of its inputs) and in
# what they record, which they pass in.


def walk_order(
    view: OrderView,
    run: Callable[[int, MetaStep], bool],
    *,
    rendezvous: Callable[[MetaStep, MetaStep], None] | None = None,
    collective: Callable[[dict[int, MetaStep]], None],
) -> dict[int, int]:
    """Execute ``view.order`` round robin ([Note: order walk]); return where each rank stopped.

    ``run(rank, step)`` runs the step at a rank's head and says whether it
    could (``False`` leaves the rank waiting there). With ``rendezvous`` given,
    a SEND or RECV runs only together with its peer's matching step, which must
    be at the peer's head: ``rendezvous(step, other)`` is told and both ranks
    advance (blocking point-to-point); without it transfers go to ``run``.
    A step of a collective kind runs when every rank's head is one:
    ``collective({rank: step})``. A rank that finished stops at ``len(steps)``.
    """
    order = view.order
    head = {rank: 0 for rank in order}

    def at(rank: int) -> MetaStep | None:
        return order[rank][head[rank]] if head[rank] < len(order[rank]) else None

    progress = True
    while progress:
        progress = False
        for rank, steps in order.items():
            while head[rank] < len(steps):
                step = steps[head[rank]]
                if step.type.is_collective:
                    heads = {r: at(r) for r in order}
                    if not all(s is not None and s.type.is_collective for s in heads.values()):
                        break
                    collective(heads)  # type: ignore[arg-type]
                    for r in order:
                        head[r] += 1
                elif rendezvous is not None and step.type.is_comm:
                    other = matching(step)
                    peer = view.rank_of(other.stage_index)
                    assert peer is not None
                    if at(peer) != other:
                        break
                    rendezvous(step, other)
                    head[peer] += 1
                    head[rank] += 1
                elif run(rank, step):
                    head[rank] += 1
                else:
                    break
                progress = True
    return head
